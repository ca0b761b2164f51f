"""The talker: speech for any text-producing engine backend.

:class:`SpeakingEngine` wraps an ``EngineBackend`` that produces text (the embedded thinker,
the vLLM backend, anything) and is itself an ``EngineBackend``. It passes every output
through unchanged and, as the text forms phrases (a punctuation mark, or ``max_phrase_words``
words without one), synthesizes each phrase on a worker thread and yields its audio as
``AudioPacket``s of ``packet_ms`` each, pcm16 mono at 16 kHz. The worker threads are shared by
every response, tenant first (engines/fair_pool.py). The first packet of a phrase
carries the phrase's text in ``transcript`` (for response.output_audio_transcript.delta);
later packets carry "". All audio of a response is yielded before its ``TurnDone``.

Cancellation: when the consumer cancels or closes the stream, the wrapped stream is closed at
once (so its engine slot frees) and no further phrase is synthesized; a phrase already
running on the worker finishes there (Piper cannot be interrupted mid-call; a phrase is well
under 100 ms of compute) and its audio is dropped.

Requests whose ``modalities`` lack "audio" pass straight through.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Hashable
from typing import Any

import attrs
import structlog

from ..core.engine_io import AudioPacket, EngineOutput, ModelTurnRequest, TextDelta, TurnDone
from .base import EngineBackend, EngineCapabilities, delegated_sync_abort
from .fair_pool import FairPool

log = structlog.get_logger("duplex_actors.engines.talker")

_PHRASE_END = (".", ",", "?", "!", ";", ":")


@attrs.frozen(slots=True)
class TalkerConfig:
    packet_ms: int = 160
    #: The first phrase is cut short so the first packet (TTFP) comes early; later phrases
    #: can be longer, which sounds more natural and costs less per word.
    first_phrase_words: int = 4
    max_phrase_words: int = 8
    #: The rate of direct ``Talker`` calls that name none, and of the warm-up. A
    #: ``SpeakingEngine`` speaks at each request's ``audio_out_rate`` instead.
    sample_rate: int = 16000
    #: Worker threads for synthesis, shared by all sessions (bounds TTS's share of the CPU);
    #: phrases are handed to them in fair-share order (engines/fair_pool.py).
    workers: int = 2
    #: Piper samples its phoneme durations, so the same phrase runs a few per cent longer or
    #: shorter each time; False turns that off (same text, same samples): for tests and
    #: benches whose figures must not depend on one synthesis's luck.
    varied: bool = True


class PhraseSplitter:
    """Accumulates streamed text and hands out complete phrases."""

    def __init__(self, max_words: int, first_words: int | None = None) -> None:
        self._max_words = max_words
        self._limit = first_words or max_words
        self._buffer = ""

    def feed(self, text: str) -> list[str]:
        self._buffer += text
        stripped = self._buffer.rstrip()
        if stripped.endswith(_PHRASE_END) or len(stripped.split()) >= self._limit:
            return self._take()
        return []

    def flush(self) -> list[str]:
        return self._take()

    def _take(self) -> list[str]:
        phrase, self._buffer = self._buffer.strip(), ""
        # A phrase of bare punctuation has nothing to say.
        if not any(ch.isalnum() for ch in phrase):
            return []
        self._limit = self._max_words
        return [phrase]


class Talker:
    """Phrase -> pcm16 packets, with Piper. Load once, share across sessions."""

    # ``tts``: any voice with PiperTTS's synthesize_pcm16 (duck-typed; see synthesize_packets).
    def __init__(self, tts: Any = None, config: TalkerConfig = TalkerConfig()) -> None:
        self.config = config
        self._tts = tts
        self._pool = FairPool(config.workers, thread_name_prefix="talker")

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    def load(self) -> None:
        """Load the voice now (blocking, ~1 s) instead of on the first phrase."""
        if self._tts is None:
            from ..audio.tts import default_tts

            self._tts = default_tts()
            # onnxruntime's first run is several times slower than the rest: pay it here,
            # not in the first response's TTFP.
            self._tts.synthesize_pcm16("Okay.", self.config.sample_rate)

    def synthesize_packets(self, phrase: str, rate: int | None = None, speed: float = 1.0) -> list[bytes]:
        """Blocking: the phrase's speech at ``rate`` (default: the config's) and ``speed`` (1.0:
        the voice's own pace), cut into ``packet_ms`` pieces (the last may be shorter). The
        voice's own rate is converted once, straight to ``rate``."""
        self.load()
        rate = rate or self.config.sample_rate
        if self.config.varied:
            # A voice of one's own (Talker(tts=...)) need only take these three.
            pcm = self._tts.synthesize_pcm16(phrase, rate, speed)
        else:
            pcm = self._tts.synthesize_pcm16(phrase, rate, speed, varied=False)
        step = 2 * rate * self.config.packet_ms // 1000
        return [pcm[i : i + step] for i in range(0, len(pcm), step)]

    async def speak(
        self,
        phrase: str,
        rate: int | None = None,
        speed: float = 1.0,
        *,
        flow: Hashable | None = None,
        tenant: Hashable | None = None,
    ) -> list[bytes]:
        """:meth:`synthesize_packets` on the talker's threads, shared fairly: by ``tenant``
        first, then by ``flow`` (a response; call :meth:`finished` when it ends). Neither
        given: a flow and tenant of its own."""
        if flow is None:
            flow = object()
            try:
                return await self._pool.run(flow, None, self.synthesize_packets, phrase, rate, speed)
            finally:
                self._pool.end(flow)
        return await self._pool.run(flow, tenant, self.synthesize_packets, phrase, rate, speed)

    def finished(self, flow: Hashable) -> None:
        """``flow`` (a response) speaks no more: forget its place in the talker's line."""
        self._pool.end(flow)

    def close(self) -> None:
        self._pool.shutdown()


class SpeakingEngine:
    """EngineBackend = a text backend + a talker."""

    def __init__(self, thinker: EngineBackend, talker: Talker) -> None:
        self.thinker = thinker
        self.talker = talker
        self.name = f"{thinker.name}+talker"
        self.capabilities: EngineCapabilities = attrs.evolve(thinker.capabilities, produces_audio=True)

    async def start(self) -> None:
        await self.thinker.start()
        await asyncio.to_thread(self.talker.load)

    async def aclose(self) -> None:
        try:
            await self.thinker.aclose()
        finally:
            self.talker.close()

    async def abort(self, request_id: str) -> None:
        await self.thinker.abort(request_id)

    @property
    def abort_nowait(self) -> Callable[[str], None]:
        return delegated_sync_abort(self.thinker)

    async def generate(self, request: ModelTurnRequest) -> AsyncGenerator[EngineOutput, None]:
        inner = self.thinker.generate(request)
        if "audio" not in request.modalities:
            async with contextlib.aclosing(inner):
                async for output in inner:
                    yield output
            return
        splitter = PhraseSplitter(self.talker.config.max_phrase_words, self.talker.config.first_phrase_words)
        try:
            async with contextlib.aclosing(inner):
                async for output in inner:
                    if isinstance(output, TurnDone):
                        for phrase in splitter.flush():
                            async for packet in self._packets(request, phrase):
                                yield packet
                        yield output
                        return
                    yield output
                    if isinstance(output, TextDelta):
                        for phrase in splitter.feed(output.text):
                            async for packet in self._packets(request, phrase):
                                yield packet
        finally:
            self.talker.finished(request.request_id)

    async def _packets(self, request: ModelTurnRequest, phrase: str) -> AsyncIterator[AudioPacket]:
        rid = request.request_id
        # The listener's rate: piper's 22.05 kHz is resampled once, straight to it.
        rate = request.audio_out_rate
        began = time.perf_counter()
        # The synthesiser is shared by tenant, then by response: one client's many responses
        # get one client's share of it (engines/fair_pool.py).
        chunks = await self.talker.speak(phrase, rate, request.speed, flow=rid, tenant=request.share_tenant)
        now = time.perf_counter()
        log.debug("talker.phrase", request_id=rid, words=len(phrase.split()), synth_s=round(now - began, 4))
        for n, chunk in enumerate(chunks):
            yield AudioPacket(rid, chunk, rate, transcript=phrase if n == 0 else "", produced_at=now)
