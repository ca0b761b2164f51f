"""Server VAD in front of a session: hears the user's audio and says what it heard.

The session's statechart decides what speech means (with ``server_vad`` on, speech_stopped
commits the user's turn; over a response, speech longer than the overlap policy's minimum
barges in). This module only turns audio into ``speech_started`` / ``speech_stopped``
signals with a real VAD model, in the order the audio arrived. :meth:`ServerVad.hear` returns
them as commands for the caller to send (sans-IO, like the core); :meth:`ServerVad.append` is
the convenience that tells them to the session it was given.

The VAD model costs ~0.1 ms per 32 ms frame; for a handful of sessions running it on the event
loop is fine, for thousands run it on the client or in a worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from ..core.clock import MONOTONIC, Clock
from ..core.commands import AppendAudio, Command, SpeechStartedSignal, SpeechStoppedSignal
from .turn_detection import SpeechStarted, TurnDetectionConfig, TurnDetector
from .vad import SileroVad, VoiceActivityModel

if TYPE_CHECKING:
    from ..actors.runtime import SessionHandle


class _RecordingVad:
    """Remembers the last frame's speech probability, so each chunk can carry a verdict."""

    def __init__(self, model: VoiceActivityModel) -> None:
        self.model = model
        self.sample_rate = model.sample_rate
        self.frame_samples = model.frame_samples
        self.last = 0.0

    def probability(self, frame: bytes) -> float:
        self.last = self.model.probability(frame)
        return self.last

    def reset(self) -> None:
        self.model.reset()
        self.last = 0.0


class ServerVad:
    def __init__(
        self,
        session: SessionHandle | None = None,
        *,
        config: TurnDetectionConfig = TurnDetectionConfig(),
        vad: VoiceActivityModel | None = None,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.session = session
        self._vad = _RecordingVad(vad or SileroVad())
        self.detector = TurnDetector(config, self._vad)
        self.clock = clock
        self.speech_started = 0
        self.speech_stopped = 0

    @property
    def speaking(self) -> bool:
        return self.detector.speaking

    def hear(self, audio: bytes | AppendAudio) -> list[Command]:
        """The commands this audio amounts to, in the order the session must get them: any
        speech boundary it reveals, then the audio itself carrying the VAD's verdict.

        ``audio`` may be the client's own AppendAudio command, so its event_id and fence stay
        with it (an error about it then names the client's event)."""
        command = audio if isinstance(audio, AppendAudio) else AppendAudio(pcm=audio)
        signals = self.detector.feed(command.pcm, self.clock.now() * 1000.0)
        cfg = self.detector.config
        speech = self.detector.speaking and self._vad.last >= cfg.threshold - cfg.hysteresis
        # Signals first: speech_started must open the overlap before its audio is counted.
        out: list[Command] = []
        for signal in signals:
            if isinstance(signal, SpeechStarted):
                self.speech_started += 1
                out.append(SpeechStartedSignal(audio_ms=signal.audio_start_ms))
            else:
                self.speech_stopped += 1
                out.append(SpeechStoppedSignal(audio_ms=signal.audio_end_ms))
        out.append(attrs.evolve(command, speech=speech))
        return out

    def append(self, audio: bytes | AppendAudio) -> None:
        """:meth:`hear` ``audio`` and tell the results to the session given at construction."""
        if self.session is None:
            raise TypeError("this ServerVad has no session to tell; use hear() and send the commands")
        for command in self.hear(audio):
            self.session.tell(command)
