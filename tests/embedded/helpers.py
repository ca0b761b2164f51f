"""Shared helpers for the embedded engine tests: small real parts, no mocks of the model."""

from __future__ import annotations

import asyncio

from duplex_actors.core.engine_io import ModelTurnRequest, SamplingOverrides, TurnKind
from duplex_actors.core.fence import Fence


def small_engine(**options):
    """A text-only embedded engine at test size (builds in well under a second)."""
    from duplex_actors.engines.embedded import make_embedded_engine

    options.setdefault("talker", False)
    options.setdefault("d_model", 64)
    options.setdefault("n_layers", 2)
    options.setdefault("n_heads", 2)
    options.setdefault("d_ff", 128)
    options.setdefault("max_concurrency", 8)
    return make_embedded_engine(**options)


def request(
    session: str,
    *,
    turn: int = 0,
    kind: TurnKind = TurnKind.RESPONSE,
    audio: bytes | None = None,
    unit: int | None = None,
    sampling: SamplingOverrides = SamplingOverrides(),
    modalities: tuple[str, ...] = ("text",),
    tenant: str | None = None,
) -> ModelTurnRequest:
    fence = Fence(session, 0, turn)
    if audio is None:
        # 0.5 s of a quiet ramp: deterministic, non-silent input for the log-mel features.
        audio = b"".join(((i * 37) % 2000 - 1000).to_bytes(2, "little", signed=True) for i in range(8000))
    rid = fence.request_id(unit=unit if kind is TurnKind.UNIT else None)
    return ModelTurnRequest(rid, fence, kind, audio, sampling=sampling, modalities=modalities, tenant=tenant)


def run(coro, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))
