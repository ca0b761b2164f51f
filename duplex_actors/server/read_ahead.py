"""What each client has sent that the server has parsed and not handled yet, bounded per client.

Why: a message is held from the moment websockets' parser hands it over (inflated: a kilobyte
on the wire can be a megabyte here) until the session's reader has handled it. Each connection
bounds its own read queue (connection.py, ``READ_QUEUE_BYTES`` past a whole message), and a
reader keeps the message it is about to handle while it waits out a pacer. Both are per
connection, so a client holds as many of them as it has connections: one address may hold
hundreds of sessions, each with a message of its own waiting for its reader
(docs/reliability.md has the measurement).

So the server adds up, per client, the payload bytes its connections hold parsed and not yet
handled: in their read queues, and the message each reader has taken and not yet handled. Past
``limit``, none of that client's connections feeds its parser more until the client's count is
back under it: the client's next bytes wait in the kernel (TCP pushes back), nothing is refused
or lost. Other clients are not affected. The messages held get handled as their readers go on,
which brings the count down; a client whose only holdings are messages it has not finished
sending waits until the keepalive drops one of those connections (an honest client does not
leave megabytes of fragments unfinished).

A client is what the per-address quotas count (guard.client_subject of its address, or the one
a trusted proxy forwarded). Under ``serve --workers`` each worker bounds its own connections.

Sans-IO: counts, and the callbacks of the connections waiting for their client to go under.
"""

from __future__ import annotations

from collections.abc import Callable

#: The default bound: what one client may hold parsed and unhandled over all its connections.
#: Eight messages at the transport cap; real-time audio frames are 1-3 KB and are handled as
#: they are parsed.
READ_AHEAD_BYTES_PER_CLIENT = 8 << 20


class ReadAheadLedger:
    """Payload bytes held parsed and unhandled, by client, and the connections waiting for
    their client to go back under ``limit``."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        #: Everything held, all clients together (the gauge's figure).
        self.total = 0
        #: Connections held back by their client's count, ever (a counter's figure).
        self.holds = 0
        self._held: dict[str, int] = {}
        self._waiting: dict[str, dict[object, Callable[[], None]]] = {}

    def held(self, client: str) -> int:
        return self._held.get(client, 0)

    def over(self, client: str) -> bool:
        """Whether ``client`` holds its limit or more: its connections feed no more."""
        return self._held.get(client, 0) >= self.limit

    def change(self, client: str, delta: int) -> None:
        """``client`` holds ``delta`` bytes more (less, when negative). Going back under the
        limit wakes every connection of the client that waits (each asks :meth:`over` again
        before it feeds its parser, so the first to cross the limit again holds the rest)."""
        if not delta:
            return
        held = self._held.get(client, 0) + delta
        if held < 0:
            raise ValueError(f"{client} would hold {held} bytes")
        if held:
            self._held[client] = held
        else:
            del self._held[client]
        self.total += delta
        if delta < 0 and held < self.limit:
            waiting = self._waiting.pop(client, None)
            if waiting:
                for wake in waiting.values():
                    wake()

    def wait(self, client: str, waiter: object, wake: Callable[[], None]) -> None:
        """Call ``wake`` once ``client`` is back under the limit (once per :meth:`wait`)."""
        if waiter not in self._waiting.setdefault(client, {}):
            self.holds += 1
        self._waiting[client][waiter] = wake

    def forget(self, client: str, waiter: object) -> None:
        """``waiter`` no longer waits (its connection closed)."""
        waiting = self._waiting.get(client)
        if waiting is not None:
            waiting.pop(waiter, None)
            if not waiting:
                del self._waiting[client]

    def waiting(self, client: str) -> int:
        return len(self._waiting.get(client, ()))


__all__ = ["READ_AHEAD_BYTES_PER_CLIENT", "ReadAheadLedger"]
