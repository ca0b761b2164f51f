"""Real-time pacing of a backend's audio: never run more than ``lead_ms`` ahead of playback.

A talker synthesises far faster than real time (Piper: ~0.04x). Left alone, a whole answer's
audio would be generated, and its request finished, long before the user has heard the first
second, so a barge-in would find nothing to stop and the client would hold seconds of audio
that may never be wanted. Speech-to-speech models produce audio at playback pace; this wrapper
gives any backend the same shape: audio packets are released as playback reaches them (plus a
small lead, the jitter buffer), text passes straight through, and the request stays active
while its audio is still to be played, so barge-in and cancel can stop it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable

import anyio

from ..core.engine_io import AudioPacket, EngineOutput, ModelTurnRequest
from .base import EngineBackend, delegated_sync_abort


class PacedEngine:
    def __init__(self, backend: EngineBackend, *, lead_ms: float = 300.0) -> None:
        if lead_ms < 0:
            raise ValueError("lead_ms must be >= 0")
        self.backend = backend
        self.lead_s = lead_ms / 1000.0
        self.name = f"{backend.name}+paced"
        self.capabilities = backend.capabilities

    async def start(self) -> None:
        await self.backend.start()

    async def aclose(self) -> None:
        await self.backend.aclose()

    async def abort(self, request_id: str) -> None:
        await self.backend.abort(request_id)

    @property
    def abort_nowait(self) -> Callable[[str], None]:
        return delegated_sync_abort(self.backend)

    async def generate(self, request: ModelTurnRequest) -> AsyncGenerator[EngineOutput, None]:
        playback_start: float | None = None
        scheduled_s = 0.0  # audio released so far
        stream = self.backend.generate(request)
        try:
            async for output in stream:
                if isinstance(output, AudioPacket):
                    now = time.perf_counter()
                    if playback_start is None:
                        playback_start = now
                    # Release this packet once playback is within lead_s of where it starts.
                    wait = playback_start + scheduled_s - self.lead_s - now
                    if wait > 0:
                        await anyio.sleep(wait)
                    scheduled_s += output.duration_s
                yield output
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()
