"""How many connections may be opening at once: from a complete request head to the end of
the handshake.

Why: asyncio runs every ready task once per loop pass. In a mass resume thousands of
handshakes share each pass, and a session already talking waits a whole pass at each of its
own steps. Opening a connection is CPU work done at the same rate however many wait, so
running only ``limit`` at once costs the storm no throughput; the others wait unread in the
kernel's buffers (TCP pushes back; nothing is refused).

Who goes next: clients share the slots (core/fair_share.py: the client served least recently
first, each client's connections in the order they came). First come, first served, a client
connecting during a mass resume waited behind every connection of the storm queued before it:
seconds, for one handshake. Now it waits for the handshakes in progress and about one of each
client waiting before it. A connection entered without a client is a client of its own.

A slot is taken once the request head is in, not at accept: a client that connects and sends
nothing costs no CPU and must not hold one. It is given back when the handshake is done: what
a resume does next is mostly waiting. Figures: docs/reliability.md, "Stalls at scale".
Sans-IO: the connection passes in how to wake it up.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable

from ..core.fair_share import FairShare


class OpeningSlots:
    """At most ``limit`` connections opening at once; the rest queue, clients taking turns."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self.active = 0
        #: Queued connections (a ticket each) and how to wake each one; and each one's ticket by
        #: its wake-up, for :meth:`withdraw`.
        self._waiting: dict[int, Callable[[], bool]] = {}
        self._ticket_of: dict[Callable[[], bool], int] = {}
        self._line: FairShare[int] = FairShare()
        self._tickets = itertools.count()

    @property
    def waiting(self) -> int:
        """Connections queued for a slot (some may have closed since)."""
        return len(self._waiting)

    def enter(self, wake: Callable[[], bool], client: Hashable = None) -> bool:
        """A slot now (True), or a place in the queue (False): ``wake`` is called when a slot
        is handed over, and returns whether the connection took it (False once closed).
        ``client``: whom the connection counts as (its address); None, a client of its own."""
        ticket = next(self._tickets)
        if self.active < self.limit:
            self.active += 1
            if client is not None:  # served now: the client's turn is stamped as taken
                self._line.wait(ticket, client)
                self._line.next()
                self._line.forget(ticket)
            return True
        self._waiting[ticket] = wake
        self._ticket_of[wake] = ticket
        self._line.wait(ticket, client)
        return False

    def withdraw(self, wake: Callable[[], bool]) -> None:
        """A queued connection closed: it leaves the queue now, so it neither uses its client's
        turn when reached nor stays held until then. Not queued (any more): no-op."""
        ticket = self._ticket_of.pop(wake, None)
        if ticket is not None:
            del self._waiting[ticket]
            self._line.forget(ticket)

    def leave(self) -> None:
        """A connection that held a slot is open (or closed): hand the slot on."""
        while (ticket := self._line.next()) is not None:
            self._line.forget(ticket)
            wake = self._waiting.pop(ticket)
            del self._ticket_of[wake]
            if wake():
                return  # the slot passed to the next in line
        self.active -= 1
