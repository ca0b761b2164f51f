"""What closed connections leave behind for the cyclic collector: a census.

Why: serve's GcPolicy freezes what survives, so cyclic garbage is freed only by a full reclaim,
a stall of the whole loop that grows with every live session. Resident memory is a poor
reason to pay it: a resume storm grows memory with *live* connections, which a reclaim cannot
free. Reference counting frees a closed connection at once
(tests/server/test_connection_garbage.py), so a closed connection or transport still alive is
waiting for a collection: that is what the census counts.
"""

from __future__ import annotations

import weakref

#: What one closed connection left in cycles, shallow, as gc.DEBUG_SAVEALL showed it: asyncio's
#: transport with its bound read callback, and a whole connection graph when a cycle held one
#: (CHANGELOG, issue 29 item 4). Both cycles are broken at close now (ws_internals); these
#: estimate what one left alive by something unforeseen still holds.
TRANSPORT_BYTES = 1024
CONNECTION_BYTES = 48 * 1024


class Lingering:
    """Closed connections and transports not yet freed, as an estimate of frozen garbage.

    A connection is counted once it has stayed alive a whole estimate period after its close
    (the policy asks every reclaim interval): for a moment after its socket closes a connection
    is still legitimately held (its handler finishing, a takeover handing its session on), and
    in a resume storm thousands are, which are not garbage."""

    def __init__(self) -> None:
        self._recent: tuple[weakref.WeakSet[object], weakref.WeakSet[object]] = _pair()
        self._aged: tuple[weakref.WeakSet[object], weakref.WeakSet[object]] = _pair()

    def closed(self, connection: object, transport: object | None) -> None:
        """``connection`` (and its ``transport``) lost its socket: it should be freed soon."""
        self._recent[0].add(connection)
        if transport is not None:
            try:
                self._recent[1].add(transport)
            except TypeError:  # no weak references to it (uvloop's TLS transport): not counted
                pass

    @property
    def connections(self) -> int:
        """Closed connections still alive (lately closed ones included)."""
        return len(self._recent[0]) + len(self._aged[0])

    @property
    def transports(self) -> int:
        """Closed transports still alive (lately closed ones included)."""
        return len(self._recent[1]) + len(self._aged[1])

    def estimate_bytes(self) -> int:
        """Garbage a full reclaim would find, as far as connections go (bytes): what was closed
        before the previous call and is still alive. Each call starts a new period."""
        aged_connections, aged_transports = self._aged
        estimate = len(aged_transports) * TRANSPORT_BYTES + len(aged_connections) * CONNECTION_BYTES
        for aged, recent in zip(self._aged, self._recent, strict=True):
            aged.update(recent)
        self._recent = _pair()
        return estimate


def _pair() -> tuple[weakref.WeakSet[object], weakref.WeakSet[object]]:
    return weakref.WeakSet(), weakref.WeakSet()


#: The process's census (the collector is process-wide too).
LINGERING = Lingering()
