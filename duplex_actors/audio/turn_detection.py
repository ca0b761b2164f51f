"""Server turn detection, sans-IO: pcm16 in, speech_started / speech_stopped out.

The detector never reads a clock or a socket. ``feed(pcm, now_ms)`` takes the next piece of
the session's input audio plus the caller's clock reading, cuts it into VAD frames (keeping
any remainder for the next call) and returns the signals those frames caused. Positions in
the signals are *audio* time: milliseconds of input audio since the stream began, as in the
OpenAI Realtime events; ``detected_at_ms`` is the caller's clock when the signal was seen.

Rules (the usual server-VAD knobs):

* speech starts on the first frame whose probability reaches ``threshold``;
  ``audio_start_ms`` reaches back ``prefix_padding_ms`` before that frame (not before 0), so
  the committed turn keeps the soft onset the VAD needed time to notice;
* once speaking, a frame counts as silence only below ``threshold - hysteresis`` (a dip in
  the middle of a word does not count), and speech stops after ``silence_duration_ms`` of
  consecutive silence; ``audio_end_ms`` is the end of the last speech frame.
"""

from __future__ import annotations

from typing import Union

import attrs

from .vad import VoiceActivityModel


@attrs.frozen(slots=True)
class TurnDetectionConfig:
    threshold: float = attrs.field(default=0.5)
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    #: Speaking continues while the probability stays above threshold - hysteresis.
    hysteresis: float = 0.15

    @threshold.validator
    def _check_threshold(self, _attribute: attrs.Attribute[float], value: float) -> None:
        if not 0.0 < value < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {value}")


@attrs.frozen(slots=True)
class SpeechStarted:
    audio_start_ms: int
    detected_at_ms: float = 0.0


@attrs.frozen(slots=True)
class SpeechStopped:
    audio_end_ms: int
    detected_at_ms: float = 0.0


TurnSignal = Union[SpeechStarted, SpeechStopped]


class TurnDetector:
    def __init__(self, config: TurnDetectionConfig, vad: VoiceActivityModel) -> None:
        self.config = config
        self._vad = vad
        self._frame_bytes = 2 * vad.frame_samples
        self._frame_ms = 1000.0 * vad.frame_samples / vad.sample_rate
        self._pending = bytearray()
        self._frames = 0  # frames consumed since the stream began
        self._speaking = False
        self._last_speech_end_ms = 0.0
        self._silence_ms = 0.0

    @property
    def speaking(self) -> bool:
        return self._speaking

    @property
    def audio_ms(self) -> float:
        """Audio time consumed so far (whole frames only)."""
        return self._frames * self._frame_ms

    def reset(self) -> None:
        """Start a new, unrelated stream (e.g. after input_audio_buffer.clear)."""
        self._vad.reset()
        self._pending.clear()
        self._frames = 0
        self._speaking = False
        self._last_speech_end_ms = 0.0
        self._silence_ms = 0.0

    def feed(self, pcm: bytes, now_ms: float) -> list[TurnSignal]:
        """The signals ``pcm`` causes, asking the VAD about each whole frame in turn."""
        vad = self._vad
        return self.judge([vad.probability(frame) for frame in self.cut(pcm)], now_ms)

    def may_stop_within(self, frames: int) -> bool:
        """Whether the next ``frames`` frames could end a speech: while speaking, when that
        many silent frames complete ``silence_duration_ms``; otherwise when the first could
        start one and the rest complete it (one append of more than the silence)."""
        needed = self.config.silence_duration_ms
        if self._speaking:
            return self._silence_ms + frames * self._frame_ms >= needed
        return frames > 1 and (frames - 1) * self._frame_ms >= needed

    def cut(self, pcm: bytes) -> list[bytes]:
        """The whole VAD frames ``pcm`` completes, in order (a remainder waits for the next
        call). With :meth:`judge`, the two halves of :meth:`feed` for a caller that asks the
        VAD itself, e.g. for many streams' frames in one batch."""
        if len(pcm) % 2:
            raise ValueError("pcm16 audio must have an even number of bytes")
        self._pending += pcm
        size = self._frame_bytes
        if len(self._pending) < size:
            return []
        pending = self._pending
        whole = len(pending) - len(pending) % size
        frames = [bytes(pending[i : i + size]) for i in range(0, whole, size)]
        del pending[:whole]
        return frames

    def judge(self, probabilities: list[float], now_ms: float) -> list[TurnSignal]:
        """The signals caused by the next frames, given the VAD's speech probability of each
        (the frames :meth:`cut` returned, in that order)."""
        signals: list[TurnSignal] = []
        cfg = self.config
        release = cfg.threshold - cfg.hysteresis
        for p in probabilities:
            start_ms = self._frames * self._frame_ms
            self._frames += 1
            end_ms = self._frames * self._frame_ms
            if not self._speaking:
                if p >= cfg.threshold:
                    self._speaking = True
                    self._silence_ms = 0.0
                    self._last_speech_end_ms = end_ms
                    signals.append(SpeechStarted(int(max(0.0, start_ms - cfg.prefix_padding_ms)), now_ms))
                continue
            if p >= release:
                self._silence_ms = 0.0
                self._last_speech_end_ms = end_ms
                continue
            self._silence_ms += self._frame_ms
            if self._silence_ms >= cfg.silence_duration_ms:
                self._speaking = False
                self._silence_ms = 0.0
                signals.append(SpeechStopped(int(round(self._last_speech_end_ms)), now_ms))
        return signals
