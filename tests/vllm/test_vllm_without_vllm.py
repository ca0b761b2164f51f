"""Parts of the vLLM backend that need no vLLM: they run in every environment."""

from __future__ import annotations

import subprocess
import sys
import types

import attrs

from duplex_actors.core.engine_io import ModelTurnRequest, TurnKind
from duplex_actors.core.fence import Fence
from duplex_actors.engines.vllm_engine import VllmEngine, _VllmTimings, describe_turn


def test_importing_the_backend_does_not_import_vllm():
    code = (
        "import sys, duplex_actors.engines.vllm_engine as m; "
        "m.VllmEngine('/nowhere'); "
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, "
        "sorted(k for k in sys.modules if k.startswith(('vllm', 'torch')))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_prompt_describes_instructions_and_audio():
    fence = Fence("sess_a", 0, 0)
    one_second = b"\x01\x00" * 16000
    request = ModelTurnRequest(
        fence.request_id(), fence, TurnKind.RESPONSE, one_second, instructions="Be kind."
    )
    prompt = describe_turn(request)
    assert prompt.startswith("Be kind.\n") and "1.00 s" in prompt
    other = ModelTurnRequest(fence.request_id(), fence, TurnKind.RESPONSE, b"\x02\x00" * 16000)
    assert describe_turn(other).split("fingerprint")[1] != prompt.split("fingerprint")[1]


def _stats(n, first_ts, last_ts, ttft=0.05):
    return types.SimpleNamespace(
        num_generation_tokens=n, first_token_ts=first_ts, last_token_ts=last_ts, first_token_latency=ttft
    )


def test_timings_rebuild_inter_token_gaps_from_vllm_readings():
    timings = _VllmTimings()
    timings.observe(_stats(1, 10.0, 10.0))
    timings.observe(_stats(2, 10.0, 10.1))
    timings.observe(_stats(5, 10.0, 10.4))  # three tokens arrived together
    metrics = timings.metrics()
    assert metrics.source == "vllm" and metrics.token_count == 5
    assert metrics.first_token_s == 0.05
    assert len(metrics.inter_token_s) == 4
    assert abs(metrics.inter_token_s[0] - 0.1) < 1e-9
    assert all(abs(g - 0.1) < 1e-9 for g in metrics.inter_token_s[1:])


def test_no_stats_means_no_metrics_rather_than_guesses():
    timings = _VllmTimings()
    timings.observe(None)
    assert timings.metrics() is None


def test_engine_args_carry_what_users_set():
    engine = VllmEngine(
        "/models/x",
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=16,
        gpu_memory_utilization=0.5,
        enforce_eager=False,
        swap_space=1,
    )
    args = engine.config.engine_args()
    assert args["model"] == "/models/x" and args["dtype"] == "bfloat16"
    assert args["max_model_len"] == 512 and args["max_num_seqs"] == 16
    assert args["gpu_memory_utilization"] == 0.5 and args["enforce_eager"] is False
    assert args["swap_space"] == 1 and args["disable_log_stats"] is False
    assert engine.capabilities.max_concurrency == 16 and not engine.capabilities.produces_audio
    # Waiting requests are ordered by tenant load (VllmEngine.generate); users may turn it off.
    assert args["scheduling_policy"] == "priority"
    fcfs = VllmEngine("/models/x", scheduling_policy="fcfs")
    assert fcfs.config.engine_args()["scheduling_policy"] == "fcfs" and not fcfs._by_tenant


def test_prompt_reads_the_words_the_turn_brings_and_describes_audio_only_when_there_is_some():
    # A text model behind `serve --engine vllm` never read what its user typed: the prompt
    # described the (absent) audio only.
    fence = Fence("sess_a", 0, 0)
    typed = ModelTurnRequest(
        fence.request_id(),
        fence,
        TurnKind.RESPONSE,
        b"",
        instructions="Be kind.",
        input_text="  what time is it?\n",
    )
    assert describe_turn(typed) == "Be kind.\nUser: what time is it?\nAssistant:"
    spoken = attrs.evolve(typed, audio=b"\x01\x00" * 8000)
    prompt = describe_turn(spoken)
    assert prompt.startswith("Be kind.\nUser: what time is it?\nUser audio: 0.50 s, fingerprint ")
    assert prompt.endswith(".\nAssistant:")
    # Neither words nor audio: the audio line, as before.
    assert "User audio: 0.00 s" in describe_turn(attrs.evolve(typed, input_text=" "))


def test_prompt_reads_the_conversation_so_far_a_line_per_item():
    from duplex_actors.core.conversation import ContentPart, Item
    from duplex_actors.engines.vllm_engine import describe_item

    def said(role, part, text, **kw):
        return Item(id="it", role=role, content=(ContentPart(type=part, **{kw.get("key", "text"): text}),))

    history = (
        said("system", "input_text", "Speak French."),
        said("user", "input_text", "my name is Ada"),
        said("assistant", "output_audio", "bonjour Ada", key="transcript"),
        Item(id="fc", type="function_call", call_id="c1", name="weather", arguments='{"city":"Oslo"}'),
        Item(id="fo", type="function_call_output", call_id="c1", output='{"c": 4}'),
        said("user", "input_audio", None),  # audio whose transcript has not come: no line
    )
    fence = Fence("sess_h", 0, 1)
    request = ModelTurnRequest(
        fence.request_id(), fence, TurnKind.RESPONSE, b"", history=history, input_text="what is my name"
    )
    assert describe_turn(request).splitlines() == [
        "System: Speak French.",
        "User: my name is Ada",
        "Assistant: bonjour Ada",
        'Assistant called weather({"city":"Oslo"})',
        'Function returned: {"c": 4}',
        "User: what is my name",
        "Assistant:",
    ]
    assert describe_item(history[-1]) == ""
    assert VllmEngine("/nowhere").capabilities.reads_history
