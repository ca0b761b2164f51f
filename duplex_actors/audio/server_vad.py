"""Server VAD in front of a session: hears the user's audio and says what it heard.

The session's statechart decides what speech means (with ``server_vad`` on, speech_stopped
commits the user's turn; over a response, speech longer than the overlap policy's minimum
barges in). This module only turns audio into ``speech_started`` / ``speech_stopped``
signals with a real VAD model, in the order the audio arrived. :meth:`ServerVad.hear` returns
them as commands for the caller to send (sans-IO, like the core); :meth:`ServerVad.append` is
the convenience that tells them to the session it was given.

:meth:`ServerVad.hear` asks the model itself, window by window. A caller serving many sessions
splits it: :meth:`ServerVad.frames_of` cuts the windows, the caller scores many sessions'
windows in one batch, and :meth:`ServerVad.heard` turns the answers into the same commands
(the server does, server/vad_batch.py: the model costs 0.12-0.35 ms a window alone, a
fraction of that in a batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.clock import MONOTONIC, Clock
from ..core.commands import AppendAudio, Command, SpeechStartedSignal, SpeechStoppedSignal
from .turn_detection import SpeechStarted, TurnDetectionConfig, TurnDetector
from .vad import SileroVad, VoiceActivityModel

if TYPE_CHECKING:
    from ..actors.session_handle import SessionHandle


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
        self.model = vad or SileroVad()
        self.detector = TurnDetector(config, self.model)
        self.clock = clock
        self.speech_started = 0
        self.speech_stopped = 0
        self._last = 0.0  # the last frame's speech probability: each chunk carries a verdict
        #: Told each chunk's commands and whether any of its frames was speech: the session's
        #: InputSpeculator (actors/transcription_queue.py), which starts the turn's
        #: transcription once the user is quiet, before the commit; None: nobody listens.
        make_listener = getattr(session, "input_speculator", None)
        self.listener = make_listener() if make_listener is not None else None

    @property
    def speaking(self) -> bool:
        return self.detector.speaking

    def hear(self, audio: bytes | AppendAudio) -> list[Command]:
        """The commands this audio amounts to, in the order the session must get them: any
        speech boundary it reveals, then the audio itself carrying the VAD's verdict.

        ``audio`` may be the client's own AppendAudio command, so its event_id and fence stay
        with it (an error about it then names the client's event)."""
        command = self.command_of(audio)
        model = self.model
        return self.heard(command, [model.probability(frame) for frame in self.frames_of(command)])

    # The two halves of hear, for a caller that asks the model itself (the server asks it for
    # many sessions' frames in one batch: vad_batch.VadBatcher).
    @staticmethod
    def command_of(audio: bytes | AppendAudio) -> AppendAudio:
        return audio if isinstance(audio, AppendAudio) else AppendAudio(pcm=audio)

    def frames_of(self, command: AppendAudio) -> list[bytes]:
        """The whole VAD frames this audio completes: ask :attr:`model` about each, in order,
        then pass the answers to :meth:`heard`, before this stream's next audio."""
        return self.detector.cut(command.pcm)

    def heard(self, command: AppendAudio, probabilities: list[float]) -> list[Command]:
        """:meth:`hear`'s commands, given the model's answers for :meth:`frames_of`."""
        signals = self.detector.judge(probabilities, self.clock.now() * 1000.0)
        if probabilities:
            self._last = probabilities[-1]
        cfg = self.detector.config
        speech = self.detector.speaking and self._last >= cfg.threshold - cfg.hysteresis
        # Signals first: speech_started must open the overlap before its audio is counted.
        out: list[Command] = []
        for signal in signals:
            if isinstance(signal, SpeechStarted):
                self.speech_started += 1
                out.append(SpeechStartedSignal(audio_ms=signal.audio_start_ms))
            else:
                self.speech_stopped += 1
                out.append(SpeechStoppedSignal(audio_ms=signal.audio_end_ms))
        # AppendAudio.of, not attrs.evolve: the same command with the verdict, built by the
        # appends' own fast path (evolve re-runs every field's validator, on every chunk).
        out.append(
            AppendAudio.of(
                command.pcm,
                command.sample_rate,
                event_id=command.event_id,
                epoch=command.epoch,
                speech=speech,
            )
        )
        if self.listener is not None:
            release = cfg.threshold - cfg.hysteresis
            self.listener.heard(out, any(p >= release for p in probabilities))
        return out

    def append(self, audio: bytes | AppendAudio) -> None:
        """:meth:`hear` ``audio`` and tell the results to the session given at construction."""
        if self.session is None:
            raise TypeError("this ServerVad has no session to tell; use hear() and send the commands")
        for command in self.hear(audio):
            self.session.tell(command)
