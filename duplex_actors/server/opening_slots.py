"""How many connections may be opening at once: from a complete request head to the end of
the handshake.

Why: asyncio runs every ready task once per loop pass. In a mass resume thousands of
handshakes share each pass, and a session already talking waits a whole pass at each of its
own steps. Opening a connection is CPU work done at the same rate however many wait, so
running only ``limit`` at once costs the storm no throughput; the others wait unread in the
kernel's buffers (TCP pushes back; nothing is refused), first come first served.

A slot is taken once the request head is in, not at accept: a client that connects and sends
nothing costs no CPU and must not hold one. It is given back when the handshake is done: what
a resume does next is mostly waiting. Figures: docs/reliability.md, "Stalls at scale".
Sans-IO: the connection passes in how to wake it up.
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
