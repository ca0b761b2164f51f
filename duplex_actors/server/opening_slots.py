"""How many connections may be opening at once: from a complete request head to the end of
the handshake.

Why: asyncio runs every ready task once per loop pass, in arrival order. In a mass resume
thousands of connections are in their handshake and resume at the same moment, so one pass
held thousands of steps (the loop lagged 1.5 s at 3,000 resumes) and a neighbour already in
conversation waited a whole pass at each of its own steps: its turn took 7-15 s against
0.5 s. Opening a connection is CPU work the server does at the same rate however many wait,
so letting only ``limit`` of them run at once costs the storm nothing in throughput, and the
others wait unread in the kernel's socket buffers (TCP pushes back; nothing is refused or
lost), first come first served. A slot is taken once the request head is in, not at accept:
a client that connects and sends nothing costs no CPU, and holding slots it would hold every
handshake (a slow client's attack). The slot is given back when the handshake is done: what a
resume does after it is mostly waiting (for the session's old connection to close), and
held until then the 3,000 sessions took twice as long to come back. Sans-IO: the connection
passes in how to wake it up.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class OpeningSlots:
    """At most ``limit`` connections opening at once; the rest queue, first come first served."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        self.active = 0
        self._waiting: deque[Callable[[], bool]] = deque()

    @property
    def waiting(self) -> int:
        """Connections queued for a slot (some may have closed since)."""
        return len(self._waiting)

    def enter(self, wake: Callable[[], bool]) -> bool:
        """A slot now (True), or a place in the queue (False): ``wake`` is called when a slot
        is handed over, and returns whether the connection took it (False once closed)."""
        if self.active < self.limit:
            self.active += 1
            return True
        self._waiting.append(wake)
        return False

    def leave(self) -> None:
        """A connection that held a slot is open (or closed): hand the slot on."""
        while self._waiting:
            if self._waiting.popleft()():
                return  # the slot passed to the next in line
        self.active -= 1
