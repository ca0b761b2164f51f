"""Small helpers shared by the vLLM tests."""

from __future__ import annotations

import asyncio
import itertools

from duplex_actors.core.engine_io import (
    Aborted,
    Decision,
    EngineFailure,
    ModelTurnRequest,
    SamplingOverrides,
    TextDelta,
    TurnDone,
    TurnKind,
    is_terminal,
)
from duplex_actors.core.fence import Fence, new_session_id

_turns = itertools.count()


def make_request(
    max_tokens: int | None = None,
    *,
    seconds: float = 0.5,
    instructions: str = "Answer briefly.",
    tenant: str | None = None,
    **sampling,
) -> ModelTurnRequest:
    fence = Fence(new_session_id(), 0, next(_turns))
    audio = bytes(range(256)) * int(seconds * 16000 * 2 / 256)
    return ModelTurnRequest(
        request_id=fence.request_id(),
        fence=fence,
        kind=TurnKind.RESPONSE,
        audio=audio,
        instructions=instructions,
        sampling=SamplingOverrides(max_tokens=max_tokens, **sampling),
        modalities=("text",),
        tenant=tenant,
    )


async def collect(engine, request: ModelTurnRequest) -> list:
    return [out async for out in engine.generate(request)]


def check_protocol(outputs: list, request_id: str, kind: TurnKind = TurnKind.RESPONSE) -> None:
    """Decision first, then text, then exactly one terminal, last; all for this request."""
    assert outputs, "the stream produced nothing"
    assert all(o.request_id == request_id for o in outputs)
    terminals = [o for o in outputs if is_terminal(o, kind)]
    assert len(terminals) == 1 and outputs[-1] is terminals[0], outputs[-3:]
    if any(isinstance(o, TextDelta) for o in outputs):
        assert isinstance(outputs[0], Decision) and outputs[0].speak
        assert sum(isinstance(o, Decision) for o in outputs) == 1
    stamps = [o.produced_at for o in outputs]
    assert stamps == sorted(stamps)


async def wait_until(predicate, timeout: float = 5.0, step: float = 0.01) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(step)
    return predicate()


async def probe_running(engine, max_tokens: int = 24) -> int:
    """Run one short request alone and return the most requests vLLM's scheduler reported as
    running meanwhile: 1 means nothing else (e.g. an aborted request) is still being decoded."""
    peak = 0
    async for out in engine.generate(make_request(max_tokens)):
        if isinstance(out, TextDelta):
            peak = max(peak, engine.scheduler_load.running)
    return peak


__all__ = [
    "Aborted",
    "Decision",
    "EngineFailure",
    "TextDelta",
    "TurnDone",
    "make_request",
    "collect",
    "check_protocol",
    "wait_until",
    "probe_running",
]
