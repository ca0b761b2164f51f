"""A bounded, multi-lane actor mailbox.

Lanes are drained in priority order (control, engine, data), so a barge-in or close is never
stuck behind seconds of queued audio, while order *within* a lane is preserved. Client lanes
are bounded: ``put`` either accepts the message (it will be processed exactly once) or raises
``MailboxFull`` having changed nothing, so backpressure is explicit and nothing accepted is
ever dropped. The engine lane is not bounded by the client's capacity: engine output must
never be refused (each request's output is finite, and the session's outbox bounds delivery).

``put``/``pop`` are synchronous; the actor waits for work elsewhere. A pop therefore either
returns a message or does not happen: there is no await between taking a message off a lane
and handing it to the consumer, which is what makes the mailbox atomic under cancellation.
Deques are created on first use so an idle session's mailbox costs a few dozen bytes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import attrs

from ..core.commands import Lane
from ..errors import MailboxFull

_LANES = (Lane.CONTROL, Lane.ENGINE, Lane.DATA)
_CONTROL, _ENGINE, _DATA = _LANES


@attrs.frozen(slots=True)
class MailboxStatistics:
    """A snapshot of one session's mailbox: messages waiting in each lane, the capacity, and how many
    were accepted, refused and the most ever waiting at once.
    """

    control: int
    engine: int
    data: int
    capacity: int
    accepted: int
    refused: int
    high_water: int

    @property
    def depth(self) -> int:
        return self.control + self.engine + self.data


class Mailbox:
    __slots__ = ("capacity", "_lanes", "accepted", "refused", "high_water")

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity  # per client lane
        self._lanes: list[deque[Any] | None] = [None, None, None]
        self.accepted = 0
        self.refused = 0
        self.high_water = 0

    def put(self, lane: Lane, message: Any, *, force: bool = False) -> None:
        """``force``: the runtime's own control messages (expiry, shutdown close) are never
        refused, or a client flooding its control lane could dodge expiry or crash the reaper."""
        q = self._lanes[lane]
        if q is None:
            q = self._lanes[lane] = deque()
        depth = len(q)
        # The capacity test first: it is false for nearly every put, so the rest is skipped.
        if depth >= self.capacity and not force and lane != _ENGINE:
            self.refused += 1
            raise MailboxFull(f"{lane.name.lower()} lane is full ({self.capacity} messages)")
        q.append(message)
        self.accepted += 1
        if depth >= self.high_water:
            self.high_water = depth + 1

    def pop(self) -> tuple[Lane, Any] | None:
        # Unrolled: this runs once per message the runtime processes.
        lanes = self._lanes
        q = lanes[0]
        if q:
            return _CONTROL, q.popleft()
        q = lanes[1]
        if q:
            return _ENGINE, q.popleft()
        q = lanes[2]
        if q:
            return _DATA, q.popleft()
        return None

    def __len__(self) -> int:
        return sum(len(q) for q in self._lanes if q)

    def __bool__(self) -> bool:
        return any(self._lanes)

    def holds(self, lane: Lane, predicate: Callable[[Any], object]) -> bool:
        """Whether a message queued on ``lane`` satisfies ``predicate`` (a linear scan)."""
        q = self._lanes[lane]
        return q is not None and any(predicate(message) for message in q)

    def depth(self) -> int:
        """Messages queued on all lanes (what a metrics scrape reads for every session)."""
        return sum(len(q) for q in self._lanes if q)

    def lane_depth(self, lane: Lane) -> int:
        q = self._lanes[lane]
        return len(q) if q else 0

    def drain(self) -> list[tuple[Lane, Any]]:
        """Take everything (used on close: each message is then refused exactly once)."""
        out = []
        while (item := self.pop()) is not None:
            out.append(item)
        return out

    def statistics(self) -> MailboxStatistics:
        return MailboxStatistics(
            self.lane_depth(Lane.CONTROL),
            self.lane_depth(Lane.ENGINE),
            self.lane_depth(Lane.DATA),
            self.capacity,
            self.accepted,
            self.refused,
            self.high_water,
        )
