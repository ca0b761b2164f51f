"""Fences: which generation of work inside a session a command or an output belongs to.

A fence is ``(session_id, epoch, turn_id)``. ``epoch`` moves exactly when work is cancelled
(barge-in, response cancel, close); ``turn_id`` counts finished model turns and only moves
forward. Engine request ids are derived from the fence so that "abort everything of epoch e"
and "is this output stale?" are exact string/number checks, never guesses.
"""

from __future__ import annotations

import secrets

import attrs

from ..errors import EngineProtocolError


def new_session_id() -> str:
    # Server-allocated and unguessable: 96 random bits, never reused in practice.
    return "sess_" + secrets.token_hex(12)


@attrs.frozen(slots=True)
class Fence:
    """What a model turn belongs to: ``(session_id, epoch, turn_id)``. Output of an older epoch (a
    barge-in moved it on) is stale and never delivered.
    """

    session_id: str
    epoch: int
    turn_id: int

    def request_id(self, unit: int | None = None) -> str:
        """The engine request id for the model turn this fence names.

        ``unit`` distinguishes the per-unit requests of model-native (listen/speak) mode.
        """
        base = f"{self.session_id}/e{self.epoch}/t{self.turn_id}"
        return base if unit is None else f"{base}/u{unit}"

    def is_older_than(self, other: Fence) -> bool:
        return (self.epoch, self.turn_id) < (other.epoch, other.turn_id)


def parse_request_id(request_id: str) -> tuple[Fence, int | None]:
    """Inverse of :meth:`Fence.request_id`; raises EngineProtocolError on anything else."""
    parts = request_id.split("/")
    try:
        if len(parts) not in (3, 4) or parts[1][0] != "e" or parts[2][0] != "t":
            raise ValueError
        fence = Fence(parts[0], int(parts[1][1:]), int(parts[2][1:]))
        unit = int(parts[3][1:]) if len(parts) == 4 and parts[3][0] == "u" else None
        if len(parts) == 4 and unit is None:
            raise ValueError
    except (ValueError, IndexError):
        raise EngineProtocolError(f"not a duplex_actors request id: {request_id!r}") from None
    return fence, unit
