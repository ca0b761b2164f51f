"""ServerVad says what it heard as commands and sends nothing itself (sans-IO, like the core)."""

from __future__ import annotations

from duplex_actors.audio.server_vad import ServerVad
from duplex_actors.audio.turn_detection import TurnDetectionConfig
from duplex_actors.core import commands as cmd
from duplex_actors.core.clock import ManualClock


class LoudnessVad:
    """A frame is speech when it is loud."""

    sample_rate = 16000
    frame_samples = 320

    def probability(self, frame: bytes) -> float:
        samples = memoryview(frame).cast("h")
        return 0.95 if sum(abs(x) for x in samples) / len(samples) > 1000 else 0.02

    def reset(self) -> None:
        pass


LOUD = (3000).to_bytes(2, "little", signed=True) * 3200  # 200 ms
QUIET = bytes(2 * 3200)


def test_hear_returns_signals_before_the_audio_and_needs_no_session():
    clock = ManualClock(0.0)
    vad = ServerVad(
        config=TurnDetectionConfig(prefix_padding_ms=0, silence_duration_ms=200),
        vad=LoudnessVad(),
        clock=clock,
    )
    heard = []
    client_append = cmd.AppendAudio(pcm=LOUD, event_id="evt_1", epoch=0)
    for chunk in (client_append, QUIET, QUIET, QUIET):
        heard.append(vad.hear(chunk))
        clock.advance(0.2)
    kinds = [[type(c).__name__ for c in step] for step in heard]
    assert kinds[0] == ["SpeechStartedSignal", "AppendAudio"]
    assert heard[0][-1].speech is True and heard[0][-1].event_id == "evt_1" and heard[0][-1].epoch == 0
    assert ["SpeechStoppedSignal", "AppendAudio"] in kinds[1:]
    assert all(step[-1].speech is False for step in heard[1:])
    assert (vad.speech_started, vad.speech_stopped) == (1, 1)
