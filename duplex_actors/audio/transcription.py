"""Input transcription: what the user said in a committed turn, from an offline recogniser.

The recogniser is PocketSphinx (package ``pocketsphinx``, extra ``transcription``), which ships
its US English acoustic model, dictionary and language model inside the wheel: nothing is
downloaded at run time. (vosk and sherpa-onnx need models fetched separately.) On the packaged
demo sentences spoken by piper it gets nearly every word right (tests/audio/
test_transcription.py reports the word error rate); it is a small, old recogniser, so real
microphones and accents will do worse.

Decoding is blocking CPU work, and PocketSphinx's binding holds the GIL while it decodes, so
another thread barely runs meanwhile. A worker *thread* would therefore still stall every
session's event loop, so :meth:`PocketsphinxTranscriber.transcribe` runs the decoder in a
worker *process*; each worker loads the model once and keeps it.

The workers are a standard-library process pool with the ``spawn`` start method, not anyio's
``to_process``: that one re-runs the parent's main module *by file path* in each worker, so an
application started as ``python -m app.server`` whose module has a relative import got
``BrokenWorkerProcess`` for every turn (our own flood bench did). ``multiprocessing`` imports a
``-m`` main module by name, as Python itself did. A pool broken by a dead worker is replaced
for the next turn.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import weakref
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import structlog

from ..parent_death import end_with_parent
from .idle_release import IdleRelease, ReleasedWhenIdle

if TYPE_CHECKING:  # onnxruntime is imported only when the ONNX backend loads
    import numpy as np
    import numpy.typing as npt
    from pocketsphinx import Decoder

    from .moonshine_onnx import MoonshineOnnx

log = structlog.get_logger("duplex_actors.transcription")

#: The rate PocketSphinx's packaged model was trained on.
RECOGNISER_RATE = 16000


@runtime_checkable
class Transcriber(Protocol):
    """Turns one committed turn of pcm16 mono audio into text, off the event loop."""

    name: str

    async def transcribe(self, pcm: bytes, sample_rate: int) -> str: ...


# One decoder per process (the serving process for blocking use, each pool worker for its own).
_decoder: Decoder | None = None
_decoder_lock = threading.Lock()


def _load_decoder() -> Decoder:
    # Slow, but once per process; in a pool worker the event loop never waits for it.
    global _decoder
    if _decoder is None:
        from pocketsphinx import Decoder

        _decoder = Decoder(samprate=RECOGNISER_RATE, loglevel="FATAL")
    return _decoder


def transcribe_pcm16(pcm: bytes, sample_rate: int) -> str:
    """Blocking: the transcript of one turn of pcm16 mono audio (resampled to 16 kHz)."""
    if len(pcm) < 2:
        # Nothing to hear (server VAD's idle timeout commits what the input holds, which may
        # be nothing), and PocketSphinx raises on an empty buffer.
        return ""
    if sample_rate != RECOGNISER_RATE:
        from .resample import float_to_pcm16, pcm16_to_float, resample

        pcm = float_to_pcm16(resample(pcm16_to_float(pcm), sample_rate, RECOGNISER_RATE))
    with _decoder_lock:  # a decoder is not thread-safe
        decoder = _load_decoder()
        decoder.start_utt()
        try:
            decoder.process_raw(pcm, full_utt=True)
        finally:
            # Always closed: an utterance left open makes every later start_utt fail, so one
            # turn the decoder refused failed every later turn of this worker process (every
            # session's: the worker is shared).
            decoder.end_utt()
        hyp = decoder.hyp()
    return "" if hyp is None else hyp.hypstr


#: Worker pools that may break one after another before the recogniser gives up: a worker
#: killed from outside is replaced, one that cannot even start would be started for every turn.
MAX_BROKEN_POOLS = 3

#: How long a loaded recogniser (Moonshine's model, PocketSphinx's worker processes) may go
#: unused before it is let go; ``serve --transcription-idle-s``.
IDLE_UNLOAD_S = 600.0


class RecogniserUnavailable(RuntimeError):
    """The recogniser's worker processes died MAX_BROKEN_POOLS times in a row (their stderr
    says why: typically a main module a ``spawn`` worker cannot import, as ``python -`` run
    from stdin has): turns fail at once instead of each starting a process that dies."""


class PocketsphinxTranscriber(ReleasedWhenIdle):
    """Offline English transcription with PocketSphinx's packaged model, in worker processes
    (``max_concurrent`` of them, each holding its own copy of the model, started on the first
    turn and stopped once no turn has used them for ``idle_unload_s``; :meth:`close` stops
    them)."""

    name = "pocketsphinx"

    def __init__(self, *, max_concurrent: int = 1, idle_unload_s: float | None = IDLE_UNLOAD_S) -> None:
        import pocketsphinx  # noqa: F401  (fail at construction, not at the first turn)

        self.max_concurrent = max_concurrent
        self._pool: ProcessPoolExecutor | None = None
        self._stop_pool: weakref.finalize[..., PocketsphinxTranscriber] | None = None
        self._broken_in_a_row = 0
        self._idle = IdleRelease(idle_unload_s, self._shut_pool, name=self.name)
        self.loads = 0  # times worker processes were started

    def supports_language(self, language: str | None) -> bool:
        return english(language)  # its packaged model is US English

    def transcribe_blocking(self, pcm: bytes, sample_rate: int) -> str:
        """In this process (tests, offline use); never call it from the event loop."""
        return transcribe_pcm16(pcm, sample_rate)

    async def transcribe(self, pcm: bytes, sample_rate: int) -> str:
        if self._broken_in_a_row >= MAX_BROKEN_POOLS:
            raise RecogniserUnavailable(
                f"the recogniser's worker processes died {self._broken_in_a_row} times in a row"
            )
        with self._idle.using():  # the pool is not stopped for being idle while a turn uses it
            pool = self._pool or self._start_pool()
            try:
                text = await asyncio.get_running_loop().run_in_executor(
                    pool, transcribe_pcm16, pcm, sample_rate
                )
            except BrokenProcessPool:
                self._broken(pool)
                raise
        self._broken_in_a_row = 0
        return text

    def _start_pool(self) -> ProcessPoolExecutor:
        pool = self._pool = ProcessPoolExecutor(
            self.max_concurrent,
            mp_context=multiprocessing.get_context("spawn"),
            # This process killed (SIGKILL: the OOM killer, a worker of serve stopped
            # by its pid) runs no close(): its recogniser's process, ~140 MB, lived on
            # as an orphan, one more for every such death.
            initializer=end_with_parent,
            initargs=(signal.SIGKILL, os.getpid()),
        )
        # Dropped without close(): the workers still go.
        self._stop_pool = weakref.finalize(self, pool.shutdown, wait=False, cancel_futures=True)
        self.loads += 1
        return pool

    def _broken(self, pool: ProcessPoolExecutor) -> None:
        # A worker died (killed, or the decoder crashed): this turn fails, the next one gets a
        # fresh pool instead of the same error for ever.
        if self._pool is pool:
            self._broken_in_a_row += 1
            log.warning("transcription.pool_broken", in_a_row=self._broken_in_a_row)
            self._shut_pool()

    def close(self, *, wait: bool = False) -> None:
        """Stop the worker processes (the next turn would start new ones). ``wait``: until
        they have exited (a turn being decoded first finishes; waiting ones are cancelled).

        A process that ends with ``os._exit``, as every ``multiprocessing`` child does (serve's
        workers), runs no exit hooks: without ``close(wait=True)`` its recogniser's worker
        process outlived it (an orphan holding a model per ``serve --workers`` run that
        transcribed).
        """
        self._idle.close()
        self._shut_pool(wait=wait)

    def _shut_pool(self, *, wait: bool = False) -> bool:
        """Stop the worker processes, if any (also IdleRelease's release): whether there were."""
        pool, stop = self._pool, self._stop_pool
        self._pool = self._stop_pool = None
        if stop is None or pool is None:
            return False
        if wait:
            stop.detach()
            pool.shutdown(wait=True, cancel_futures=True)
        else:
            stop()
        return True


class UnsupportedLanguage(ValueError):
    """The session asked for a transcription language the recogniser cannot hear."""


def english(language: str | None) -> bool:
    """Whether ``language`` (ISO-639-1, maybe with a region) asks for English, or for nothing."""
    return language in (None, "", "en") or language.lower().startswith("en-")


def trim_quiet(
    audio: npt.NDArray[np.float32], rate: int, *, margin_s: float = 0.15, share: float = 0.1
) -> npt.NDArray[np.float32]:
    """``audio`` (float32) without the quiet before and after its sound, keeping ``margin_s``
    on each side. A server VAD turn carries ~0.3 s of prefix and ~0.5 s of the silence that
    ended it; a recogniser whose cost grows with the audio's length (Moonshine's encoder)
    need not decode them. Sound: 20 ms frames louder than ``share`` of the loud frames' level
    (95th percentile), so steady noise under the speech keeps everything (nothing lost)."""
    import numpy as np

    frame = max(1, rate // 50)
    n = len(audio) // frame
    if n < 3:
        return audio
    rms = np.sqrt(np.mean(audio[: n * frame].reshape(n, frame) ** 2, axis=1))
    loud = np.flatnonzero(rms >= share * float(np.percentile(rms, 95)))
    if not len(loud):
        return audio
    margin = int(margin_s * rate)
    start = max(int(loud[0]) * frame - margin, 0)
    end = min((int(loud[-1]) + 1) * frame + margin, len(audio))
    return audio[start:end]


class MoonshineTranscriber(ReleasedWhenIdle):
    """Moonshine base (English, 61 M parameters) from the ``moonshine-cpp`` wheel (extra
    ``moonshine``, MIT): its encoder, decoder and tokenizer are files inside the wheel
    (``moonshine_cpp/models/base-en``, 63 MB) and are loaded from there by path; the package's
    code that fetches other languages' models from a hub is never called.

    Far more accurate than PocketSphinx on the same speech (docs/benchmarks.md). Two ways to run
    the same model files:

    * ``backend="onnx"`` (the default): ONNX Runtime's Python API on the graphs converted to
      ONNX, so their 8-bit weights are dequantised once at load instead of at every decoder
      step (audio/moonshine_onnx.py says why): the same transcripts, a faster decode.
      ``threads``: ONNX Runtime's intra-op threads (default 1: on a small shared host more
      were slower; $DUPLEX_MOONSHINE_THREADS overrides).
    * ``backend="cpp"``: the wheel's own C library through ctypes (the previous path, kept as
      the baseline the benchmark compares against).

    Both release the GIL while they compute (ONNX Runtime's ``run``, the C library's call), so
    a worker *thread* decodes without stalling the event loop (measured:
    tests/runtime/test_moonshine.py). One model, one decode at a time (``max_concurrent``
    threads queue on its lock).

    The onnx backend is ``speculative``: a decode can be stopped between two tokens
    (``transcribe(..., cancelled=event)``), so the runtime may start a turn's decode when the
    user goes quiet, before server VAD commits it, and drop it if they speak again
    (actors/transcription_queue.py, InputSpeculator)."""

    name = "moonshine"

    def __init__(
        self,
        *,
        max_concurrent: int = 1,
        trim: bool = True,
        backend: str = "onnx",
        threads: int | None = None,
        idle_unload_s: float | None = IDLE_UNLOAD_S,
    ) -> None:
        if backend not in ("onnx", "cpp"):
            raise ValueError(f"backend must be 'onnx' or 'cpp', not {backend!r}")
        self.backend = backend
        #: Whether the runtime may start a turn's decode before its commit (onnx backend only:
        #: the C library cannot stop a decode). $DUPLEX_TRANSCRIBER_SPECULATE=0 turns it off.
        self.speculative = backend == "onnx" and os.environ.get("DUPLEX_TRANSCRIBER_SPECULATE", "1") != "0"
        if backend == "cpp":
            import moonshine_cpp.moonshine_cpp as lib  # fail at construction, not at the first turn

            self._lib = lib
            self._model_dir = Path(lib.__file__).parent / "models" / "base-en"
        else:
            import onnxruntime  # noqa: F401

            from .moonshine_onnx import packaged_model_dir

            self._model_dir = packaged_model_dir()
        self.max_concurrent = max_concurrent
        self.threads = threads or int(os.environ.get("DUPLEX_MOONSHINE_THREADS", "1"))
        #: Decode without the turn's leading and trailing quiet (trim_quiet; measured faster
        #: at the same words, docs/benchmarks.md).
        self.trim = trim
        for name in ("encoder_model.ort", "decoder_model_merged.ort", "tokenizer.bin"):
            if not (self._model_dir / name).is_file():
                raise FileNotFoundError(f"moonshine-cpp's packaged model lacks {name} in {self._model_dir}")
        self._handle: int | None = None
        self._model: MoonshineOnnx | None = None  # once loaded
        self._lock = threading.Lock()
        #: The model is let go once no decode has used it for ``idle_unload_s`` (None: kept
        #: for good). Loaded, it holds about 650 MiB; one client's one transcribed turn kept
        #: that in the process for its life. The next turn after an unload waits for a load.
        self._idle = IdleRelease(idle_unload_s, self._unload_when_idle, name=self.name)
        #: Times the model was loaded.
        self.loads = 0

    def supports_language(self, language: str | None) -> bool:
        return english(language)

    def _load(self) -> MoonshineOnnx | int:
        # Under the lock; by path, so nothing is ever downloaded.
        if self.backend == "onnx":
            if self._model is None:
                from .moonshine_onnx import MoonshineOnnx

                self._model = MoonshineOnnx(self._model_dir, threads=self.threads)
                self.loads += 1
            return self._model
        if self._handle is None:
            d = self._model_dir
            handle = self._lib.moonshine_lib.moonshine_load_model(
                str(d / "encoder_model.ort").encode(),
                str(d / "decoder_model_merged.ort").encode(),
                str(d / "tokenizer.bin").encode(),
                self._lib.MOONSHINE_MODEL_TYPE_BASE,
            )
            if handle < 0:
                raise RuntimeError(f"moonshine could not load its packaged model from {d}")
            self._handle = handle
            self.loads += 1
        return self._handle

    def _unload_when_idle(self) -> bool:
        """IdleRelease's release (no decode in progress): whether a model was loaded."""
        with self._lock:
            return self._drop_model()

    def _drop_model(self) -> bool:
        """Let the model go (under the lock); whether one was loaded."""
        loaded = self._model is not None or self._handle is not None
        self._model = None
        if self._handle is not None:
            self._lib.moonshine_lib.moonshine_free_model(self._handle)
            self._handle = None
        return loaded

    def prepare(self, pcm: bytes, sample_rate: int) -> npt.NDArray[np.float32] | None:
        """The float32 16 kHz audio the model hears for this pcm16 turn (trimmed), or None
        when under 100 ms are left: nothing a word fits in (and the model's minimum input)."""
        import numpy as np

        if len(pcm) < 2:
            return None
        from .resample import pcm16_to_float, resample

        audio = pcm16_to_float(pcm)
        if sample_rate != RECOGNISER_RATE:
            audio = resample(audio, sample_rate, RECOGNISER_RATE)
        if self.trim:
            audio = trim_quiet(audio, RECOGNISER_RATE)
        if len(audio) < RECOGNISER_RATE // 10:
            return None
        return np.ascontiguousarray(audio, dtype=np.float32)

    def transcribe_blocking(
        self, pcm: bytes, sample_rate: int, cancelled: threading.Event | None = None
    ) -> str:
        """In the calling thread (never the event loop's). ``cancelled`` set: the decode stops
        at its next token and raises DecodeStopped (onnx backend; the C library cannot stop)."""
        audio = self.prepare(pcm, sample_rate)
        if audio is None:
            return ""
        # Not let go while in use; one decode per model at a time.
        with self._idle.using(), self._lock:
            model = self._load()
            if self.backend == "onnx":
                return cast("MoonshineOnnx", model).transcribe(
                    audio, None if cancelled is None else cancelled.is_set
                )
            return self._transcribe_cpp(cast(int, model), audio)

    def _transcribe_cpp(self, handle: int, audio: npt.NDArray[np.float32]) -> str:
        import ctypes

        text = ctypes.c_char_p()
        lib = self._lib.moonshine_lib
        pointer = audio.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        error = lib.moonshine_transcribe(handle, pointer, len(audio), ctypes.byref(text))
        if error != 0:
            raise RuntimeError(f"moonshine failed to transcribe (error {error})")
        return (text.value or b"").decode("utf-8", "replace").strip()

    async def transcribe(
        self, pcm: bytes, sample_rate: int, *, cancelled: threading.Event | None = None
    ) -> str:
        import anyio.to_thread

        return await anyio.to_thread.run_sync(self.transcribe_blocking, pcm, sample_rate, cancelled)

    def close(self, *, wait: bool = False) -> None:
        self._idle.close()
        with self._lock:
            self._drop_model()


#: Which recogniser default_transcriber builds: "moonshine", "pocketsphinx", or "auto"
#: (Moonshine where its extra is installed, else PocketSphinx); "moonshine-cpp" is Moonshine
#: through the wheel's own C library (the slower previous path, for comparison).
TRANSCRIBER_ENV = "DUPLEX_TRANSCRIBER"


def default_transcriber(
    workers: int = 1, prefer: str | None = None, *, idle_unload_s: float | None = IDLE_UNLOAD_S
) -> MoonshineTranscriber | PocketsphinxTranscriber | None:
    """The recogniser ``prefer`` names (default: $DUPLEX_TRANSCRIBER, else "auto": Moonshine
    when the ``moonshine`` extra is installed, else PocketSphinx in ``workers`` processes when
    ``transcription`` is), or None when none is installed or ``workers`` is 0 (requests for
    transcription then get ``conversation.item.input_audio_transcription.failed``). Either
    recogniser is let go once unused for ``idle_unload_s`` (None: kept for good)."""
    choice = (prefer or os.environ.get(TRANSCRIBER_ENV) or "auto").lower()
    if choice not in ("auto", "moonshine", "moonshine-cpp", "pocketsphinx"):
        raise ValueError(
            f"{TRANSCRIBER_ENV} must be auto, moonshine, moonshine-cpp or pocketsphinx, not {choice!r}"
        )
    if workers <= 0:
        return None
    if choice in ("auto", "moonshine", "moonshine-cpp"):
        try:
            return MoonshineTranscriber(
                max_concurrent=workers,
                backend="cpp" if choice == "moonshine-cpp" else "onnx",
                idle_unload_s=idle_unload_s,
            )
        except ImportError:
            if choice != "auto":
                raise
    try:
        return PocketsphinxTranscriber(max_concurrent=workers, idle_unload_s=idle_unload_s)
    except ImportError:
        return None


def word_error_rate(reference: str, hypothesis: str) -> float:
    """(substitutions + deletions + insertions) / reference words, on lowercased words without
    punctuation: the usual WER, by edit distance over words."""

    def words(text: str) -> list[str]:
        cleaned = "".join(c.lower() if c.isalnum() or c in " '" else " " for c in text)
        return cleaned.split()

    ref, hyp = words(reference), words(hypothesis)
    if not ref:
        return 0.0 if not hyp else 1.0
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1] / len(ref)
