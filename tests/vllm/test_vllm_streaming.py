"""Streaming, metrics and batching against a real vLLM engine (tiny random Llama on CPU)."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("vllm")

from .support import (
    Decision,
    TextDelta,
    TurnDone,
    check_protocol,
    collect,
    make_request,
)

pytestmark = pytest.mark.vllm


def test_stream_is_decision_then_deltas_then_one_turn_done(vllm):
    request = make_request(20)
    outputs = vllm.run(collect(vllm.engine, request))

    check_protocol(outputs, request.request_id)
    deltas = [o for o in outputs if isinstance(o, TextDelta)]
    done = outputs[-1]
    assert isinstance(done, TurnDone) and done.reason == "length"
    assert sum(d.token_count for d in deltas) == 20
    assert "".join(d.text for d in deltas).strip(), "no text came out"
    assert len(deltas) > 1, "tokens were not streamed one delta at a time"
    assert vllm.engine.num_unfinished_requests() == 0
    assert not vllm.engine.in_flight


def test_turn_done_carries_vllm_timings_with_their_source(vllm):
    request = make_request(16)
    started = time.perf_counter()
    outputs = vllm.run(collect(vllm.engine, request))
    elapsed = time.perf_counter() - started

    metrics = outputs[-1].metrics
    assert metrics is not None and metrics.source == "vllm"
    assert metrics.token_count == 16
    assert metrics.first_token_s is not None and 0 < metrics.first_token_s < elapsed
    # n tokens have n - 1 gaps; vLLM's engine-core clock measured every one of them.
    assert len(metrics.inter_token_s) == 15
    assert all(gap >= 0 for gap in metrics.inter_token_s)
    assert sum(metrics.inter_token_s) < elapsed


def test_first_output_is_the_speak_decision_at_first_token_time(vllm):
    outputs = vllm.run(collect(vllm.engine, make_request(4)))
    first, second = outputs[0], outputs[1]
    assert isinstance(first, Decision) and first.speak
    assert isinstance(second, TextDelta)
    # The response begins with its first token, not before: same instant of delivery.
    assert second.produced_at - first.produced_at < 0.005


def test_session_sampling_overrides_reach_vllm(vllm):
    def text_of(outputs):
        return "".join(o.text for o in outputs if isinstance(o, TextDelta))

    async def three():
        same_a = await collect(vllm.engine, make_request(12, temperature=1.0, seed=7))
        same_b = await collect(vllm.engine, make_request(12, temperature=1.0, seed=7))
        other = await collect(vllm.engine, make_request(12, temperature=1.0, seed=8))
        return same_a, same_b, other

    same_a, same_b, other = vllm.run(three())
    assert text_of(same_a) == text_of(same_b)
    assert text_of(same_a) != text_of(other)


def test_concurrent_sessions_are_batched(vllm):
    n, tokens = 8, 48

    async def together():
        peak = 0

        async def one(request):
            nonlocal peak
            outputs = []
            async for out in vllm.engine.generate(request):
                outputs.append(out)
                if isinstance(out, TextDelta):
                    peak = max(peak, vllm.engine.scheduler_load.running)
            return request, outputs

        started = time.perf_counter()
        results = await asyncio.gather(*(one(make_request(tokens)) for _ in range(n)))
        return results, peak, time.perf_counter() - started

    async def alone():
        started = time.perf_counter()
        await collect(vllm.engine, make_request(tokens))
        return time.perf_counter() - started

    single = vllm.run(alone())
    results, peak, together_s = vllm.run(together())

    for request, outputs in results:
        check_protocol(outputs, request.request_id)
        assert isinstance(outputs[-1], TurnDone)
        assert sum(o.token_count for o in outputs if isinstance(o, TextDelta)) == tokens
    # vLLM's scheduler saw them in one batch, and 8 streams took far less than 8 alone would.
    assert peak == n
    assert together_s < 0.5 * n * single, (together_s, single)
    assert vllm.engine.num_unfinished_requests() == 0


def test_unit_turns_are_refused_precisely(vllm):
    import attrs

    from duplex_actors.core.engine_io import EngineFailure, TurnKind

    request = attrs.evolve(make_request(4), kind=TurnKind.UNIT)
    outputs = vllm.run(collect(vllm.engine, request))
    assert len(outputs) == 1 and isinstance(outputs[0], EngineFailure)
    assert not outputs[0].retryable and "unit" in outputs[0].message


def test_a_request_vllm_rejects_fails_without_retry_and_leaves_nothing_behind(vllm):
    from duplex_actors.core.engine_io import EngineFailure

    # A prompt longer than max_model_len (1024 tokens) is refused by vLLM's input checks.
    request = make_request(8, instructions="hello there " * 2000)
    outputs = vllm.run(collect(vllm.engine, request))
    assert len(outputs) == 1 and isinstance(outputs[0], EngineFailure), outputs
    assert not outputs[0].retryable
    assert vllm.engine.num_unfinished_requests() == 0 and not vllm.engine.in_flight


def test_prompt_token_ids_match_vllms_own_tokenization(vllm):
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    from duplex_actors.engines.vllm_engine import describe_turn

    engine = vllm.engine
    llm = engine.async_llm
    assert engine.uses_fast_tokenizer, "the tiny model's tokenizer should take the fast path"
    texts = [
        describe_turn(make_request(4, instructions=i))
        for i in ("Answer briefly.", "Réponds vite !", "tabs\tand\nnewlines  ", "")
    ]
    for text in texts:
        ours = engine.render_prompt(text)
        (theirs,) = llm.renderer.render_cmpl([parse_model_prompt(llm.model_config, text)])
        assert list(ours["prompt_token_ids"]) == list(theirs["prompt_token_ids"]), text
