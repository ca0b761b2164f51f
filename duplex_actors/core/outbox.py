"""The per-session output buffer: events produced but not yet handed to the client.

Bounded, with a reserve that only terminal events (response.done, session.closed) may use, so
a slow consumer can never make a session lose its terminal events. When a non-terminal event
does not fit, ``push`` returns False and the session applies its declared slow-consumer policy
(close with reason ``slow_consumer``); memory never grows without bound.

``error`` events answer the client's own refused commands, so their number is the client's
choice: a client that floods bad frames and never reads could otherwise fill memory through
them. They may not use the reserve; past ``capacity - reserve`` they are counted
(``dropped_errors``) and dropped, never queued.

Audio of a cancelled response that is still here was never heard: barge-in purges it.
"""

from __future__ import annotations

from collections import deque

from .events import AudioDeltaEvent, ErrorEvent, ServerEvent, TranscriptDeltaEvent


class Outbox:
    __slots__ = ("capacity", "reserve", "_q", "overflowed", "dropped_errors")

    def __init__(self, capacity: int = 1024, reserve: int = 16) -> None:
        if reserve < 2 or capacity <= reserve:
            raise ValueError("need capacity > reserve >= 2")
        self.capacity = capacity
        self.reserve = reserve
        self._q: deque[ServerEvent] = deque()
        self.overflowed = False
        self.dropped_errors = 0

    def push(self, event: ServerEvent) -> bool:
        if type(event) is ErrorEvent:
            if len(self._q) >= self.capacity - self.reserve:
                self.dropped_errors += 1  # count-and-drop: the reserve is for response ends
            else:
                self._q.append(event)
            return True
        limit = self.capacity if event.TERMINAL else self.capacity - self.reserve
        if len(self._q) >= limit:
            if not event.TERMINAL:
                self.overflowed = True
                return False
            # The reserve is sized for a session's terminal events; past it something is badly
            # wrong, and keeping the terminal beats keeping an older delta.
            self._drop_oldest_nonterminal()
        self._q.append(event)
        return True

    def _drop_oldest_nonterminal(self) -> None:
        for i, ev in enumerate(self._q):
            if not ev.TERMINAL:
                del self._q[i]
                return

    def purge_audio(self, response_id: str) -> int:
        """Drop undelivered audio (and its transcript deltas) of one response."""
        before = len(self._q)
        self._q = deque(
            ev
            for ev in self._q
            if not (isinstance(ev, (AudioDeltaEvent, TranscriptDeltaEvent)) and ev.response_id == response_id)
        )
        return before - len(self._q)

    def popleft(self) -> ServerEvent:
        return self._q.popleft()

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)
