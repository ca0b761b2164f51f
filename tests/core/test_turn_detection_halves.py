"""The turn detector's two halves (cut, judge) are feed, and may_stop_within is exact.

The server's VAD batcher scores windows later than they are cut, and lets a window wait for a
batch only when the detector says it cannot end the user's turn: a wrong "cannot" would hold
the reply to that turn for the batching window (tests/server/test_vad_batch.py shows it)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from duplex_actors.audio.turn_detection import SpeechStopped, TurnDetectionConfig, TurnDetector

FRAME_SAMPLES = 64


class ScriptedVad:
    """Probabilities from a list, frame by frame."""

    sample_rate = 16000
    frame_samples = FRAME_SAMPLES

    def __init__(self, probabilities: list[float]) -> None:
        self.probabilities = list(probabilities)
        self.asked = 0

    def probability(self, frame: bytes) -> float:
        assert len(frame) == 2 * FRAME_SAMPLES
        p = self.probabilities[self.asked % len(self.probabilities)]
        self.asked += 1
        return p


configs = st.builds(
    TurnDetectionConfig,
    threshold=st.sampled_from([0.3, 0.5, 0.8]),
    prefix_padding_ms=st.integers(0, 300),
    silence_duration_ms=st.integers(1, 40),  # frames are 4 ms: stops within a few frames
    hysteresis=st.sampled_from([0.0, 0.15]),
)
chunks = st.lists(st.integers(0, 6 * FRAME_SAMPLES).map(lambda n: 2 * n), min_size=1, max_size=40)
probabilities = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=50)


@given(configs, chunks, probabilities)
def test_cut_then_judge_is_feed(config, sizes, script):
    fed = TurnDetector(config, ScriptedVad(script))
    halves_vad = ScriptedVad(script)
    halves = TurnDetector(config, halves_vad)
    for i, size in enumerate(sizes):
        pcm = bytes(size)
        frames = halves.cut(pcm)
        assert all(len(f) == 2 * FRAME_SAMPLES for f in frames)
        assert fed.feed(pcm, now_ms=i) == halves.judge([halves_vad.probability(f) for f in frames], now_ms=i)
        assert (fed.speaking, fed.audio_ms) == (halves.speaking, halves.audio_ms)


@given(configs, st.lists(st.floats(0.0, 1.0), max_size=60), st.integers(1, 12))
def test_may_stop_within_is_true_exactly_when_some_windows_would_end_a_speech(config, before, n):
    detector = TurnDetector(config, ScriptedVad([0.0]))
    detector.judge(before, now_ms=0)
    said = detector.may_stop_within(n)

    # The quickest ways to end a speech in n windows: silence from now on, or (when none is
    # open) a window of speech and silence after it. Tried on copies of the state.
    def stops(windows: list[float]) -> bool:
        trial = TurnDetector(config, ScriptedVad([0.0]))
        trial.judge(before, now_ms=0)
        return any(isinstance(s, SpeechStopped) for s in trial.judge(windows, now_ms=1))

    assert said == (stops([0.0] * n) or stops([1.0] + [0.0] * (n - 1)))


@given(
    configs,
    st.lists(st.floats(0.0, 1.0), max_size=60),
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12),
)
def test_no_windows_the_detector_calls_unable_to_stop_ever_stop(config, before, windows):
    detector = TurnDetector(config, ScriptedVad([0.0]))
    detector.judge(before, now_ms=0)
    if not detector.may_stop_within(len(windows)):
        assert not any(isinstance(s, SpeechStopped) for s in detector.judge(windows, now_ms=1))
