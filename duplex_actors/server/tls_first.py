"""Count a TLS connection among those still opening before its TLS handshake starts.

The limits on connections still opening (``max_handshakes_per_address``, ``max_handshakes``;
guard.PendingHandshakes) were checked when the websocket connection was made. With TLS, an
event loop makes it only once the TLS handshake is done, so a connection in its TLS handshake
was not counted, and a client could hold as many as the server's descriptors allow, each with
its TLS state, by opening TCP connections and sending nothing. Measured on this host, 2,000 such
connections added 105 MiB to the server on uvloop and 602 MiB on asyncio's own loop (which
gives each a 256 KiB read buffer), for a few kilobytes of the client's.

Here the listener accepts plain TCP; the connection is counted by its client address first
(refused past either limit: closed at once, as there is no plaintext to answer in), and only
then does its TLS handshake start (``loop.start_tls``, within ``handshake_timeout_s``). Once it
is done the websocket connection is made on the encrypted transport and takes the count over,
until its request is read, as a connection without TLS is counted from its start.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Coroutine
from typing import Any, cast

import structlog
from websockets.asyncio.server import ServerConnection

from .client_address import peername_ip
from .connection import PacedConnection

log = structlog.get_logger("duplex_actors.server.tls_first")


class TlsAfterCounting(PacedConnection):
    """A listener's connection (:func:`tls_after_counting` configures it) that counts itself,
    then runs its TLS handshake, then is the websocket connection it extends."""

    tls_context: ssl.SSLContext | None = None
    tls_handshake_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is not registered as one
        address = peername_ip(transport.get_extra_info("peername"))
        if self.handshakes is not None and self.handshakes.admit(address) is not None:
            transport.abort()
            return
        # start_tls must take the transport over now, inside connection_made: uvloop starts
        # reading as soon as it returns (a pause asked for here is ignored), and a ClientHello
        # read before start_tls had run would reach this websocket connection as plaintext. So
        # its first step, which swaps in the TLS protocol, runs here; a task runs the rest.
        assert self.tls_context is not None
        loop = asyncio.get_running_loop()
        # The first decrypted bytes can come before the task resumes (the loop reads on as the
        # handshake ends): a holder takes them until the websocket connection is made.
        holder = _Holder()
        starting = loop.start_tls(
            transport,
            holder,
            self.tls_context,
            server_side=True,
            ssl_handshake_timeout=self.tls_handshake_timeout_s,
        )
        try:
            waiting_on = starting.send(None)
        except BaseException as exc:  # it failed (or ended) at once: nothing was made of it
            starting.close()
            self._tls_failed(transport, address, exc)
            return
        self._tls_handshake = loop.create_task(
            self._finish_tls(starting, waiting_on, transport, address, holder)
        )

    async def _finish_tls(
        self,
        starting: Coroutine[Any, Any, asyncio.Transport | None],
        waiting_on: asyncio.Future[Any],
        transport: asyncio.Transport,
        address: str,
        holder: _Holder,
    ) -> None:
        """Run the rest of ``starting`` (a start_tls begun in connection_made), as a task would
        have run it, then make the websocket connection on the encrypted transport."""
        encrypted = None
        try:
            while True:
                # What ``starting`` yielded is a future it awaits, marked so by that await; a
                # task clears the mark as it takes the future over, and so does this.
                waiting_on._asyncio_future_blocking = False
                try:
                    await waiting_on  # its outcome is read by ``starting`` itself
                except asyncio.CancelledError:
                    waiting_on = starting.throw(asyncio.CancelledError())
                    continue
                except BaseException:  # start_tls reads the future's outcome
                    pass
                waiting_on = starting.send(None)
        except StopIteration as done:
            encrypted = done.value
        except Exception as exc:  # a reset, a timeout, bad TLS (OSErrors mostly), or anything
            self._tls_failed(transport, address, exc)
            return
        if self.handshakes is not None:
            # The websocket connection's own count takes over: no await between the two.
            self.handshakes.leave(address)
        if encrypted is None:  # the loop lost the transport meanwhile
            transport.abort()
            return
        super().connection_made(encrypted)
        holder.hand_over(self, encrypted)
        # Last: uvloop passes what it holds to a new protocol as it is set.
        encrypted.set_protocol(self)

    def _tls_failed(self, transport: asyncio.Transport, address: str, exc: BaseException) -> None:
        # A client that left, never spoke TLS, or took too long: nothing was made of it.
        log.debug("tls.handshake_failed", address=address, error=repr(exc))
        if self.handshakes is not None:
            self.handshakes.leave(address)
        transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if not hasattr(self, "transport"):
            return  # lost during its TLS handshake: no websocket connection was made
        super().connection_lost(exc)


class _Holder(asyncio.Protocol):
    """The application side of a TLS handshake in progress: keeps what arrives between the
    handshake's end and the websocket connection's start, then hands it over in order."""

    def __init__(self) -> None:
        self._received: list[bytes] = []
        self._eof = False
        self._lost: tuple[Exception | None] | None = None

    def data_received(self, data: bytes) -> None:
        self._received.append(data)

    def eof_received(self) -> bool:
        self._eof = True
        return True  # keep the transport open: the connection it goes to decides

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = (exc,)

    def hand_over(self, connection: asyncio.Protocol, transport: asyncio.BaseTransport) -> None:
        if not transport.is_closing():  # not for a connection that refused itself as it was made
            for data in self._received:
                connection.data_received(data)
            if self._eof:
                connection.eof_received()
        self._received.clear()
        if self._lost is not None:
            connection.connection_lost(self._lost[0])


def tls_after_counting(
    connection_class: type[ServerConnection], context: ssl.SSLContext, handshake_timeout_s: float
) -> type[ServerConnection]:
    """``connection_class`` (an edge-limited :class:`PacedConnection`) for a listener that
    accepts plain TCP and runs TLS itself once the connection is counted."""
    return type(
        connection_class.__name__,
        (TlsAfterCounting, connection_class),
        {"tls_context": context, "tls_handshake_timeout_s": handshake_timeout_s},
    )


__all__ = ["TlsAfterCounting", "tls_after_counting"]
