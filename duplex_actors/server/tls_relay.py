"""TLS with ``serve --workers N``: a resume that reached the wrong worker is relayed to its owner.

Without TLS the front reads each connection's request line and hands a resume to the worker
that holds its session (:mod:`.front_door`). Under TLS the request line is encrypted, and the
TLS session cannot move between processes once its handshake is done, so the front hands every
connection to the next worker in turn and that worker terminates its TLS. It then reads the
request line (:class:`RequestLineSniffer`):

* a new session, ``/health``, a resume of its own session, or a session of a worker that is gone
  (the connection to its relay socket fails): served here, exactly as an accepted connection;
* a resume of a session another living worker minted: relayed, in clear over that worker's
  Unix relay socket (in the server's 0700 folder), to the owner, which serves it as its own.
  The relayed stream starts with a preamble naming the client's address (:func:`preamble`), so
  the owner's per-address quotas, shares and logs count the real client, not the relay.

A relayed connection costs the relaying worker its TLS and a copy each way; only resumes that
land on another worker pay it (with N workers, about (N-1)/N of the resumes). Should the owner
die, the relay closes the client's connection: under TLS neither the front nor the relay can
write the farewell frames of a dead worker's session for it (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

import structlog

from . import raw_http
from .client_address import peername_ip
from .guard import PendingHandshakes

log = structlog.get_logger("duplex_actors.server.tls_relay")

#: A longer request line is not a websocket upgrade we serve (the front's plain peek and a
#: worker reading a decrypted one alike).
MAX_REQUEST_LINE = 8192
#: The request line must arrive within this long: after accept (the front, a slowloris guard)
#: or after the TLS handshake (a worker under TLS).
REQUEST_LINE_TIMEOUT_S = 10.0
_LENGTH = struct.Struct(">H")


def session_id_in(request_line: bytes) -> str | None:
    """The ``session_id`` query parameter of an HTTP request line, if it has one."""
    parts = request_line.split(b" ")
    target = parts[1].decode("latin-1") if len(parts) >= 2 else ""
    found = parse_qs(urlsplit(target).query).get("session_id")
    return found[0] if found else None


def preamble(peer: tuple[Any, ...]) -> bytes:
    """What a relayed stream starts with: the client's (host, port), length-prefixed."""
    text = f"{peer[0]} {peer[1]}".encode()
    return _LENGTH.pack(len(text)) + text


def read_preamble(buffer: bytearray) -> tuple[tuple[str, int], int] | None:
    """The peer a relayed stream names and the bytes its preamble took, once ``buffer`` holds
    all of it; None until then. Raises ValueError for one that is not ours."""
    if len(buffer) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack_from(buffer)
    end = _LENGTH.size + length
    if len(buffer) < end:
        return None
    host, _, port = bytes(buffer[_LENGTH.size : end]).decode().rpartition(" ")
    if not host:
        raise ValueError("a relay preamble without a peer")
    return (host, int(port)), end


class RequestLineSniffer(asyncio.Protocol):
    """The first protocol of a TLS connection a worker adopted: it reads (decrypted) up to the
    end of the request line, then either hands the transport and every byte read to a websocket
    connection (``serve_here``) or relays it to the owner's socket (``relay_path``)."""

    def __init__(
        self,
        relay_path: Callable[[str | None], str | None],
        serve_here: Callable[[asyncio.Transport, bytes], None],
        on_end: Callable[[], None],
        on_relay: Callable[[], object] = lambda: None,
        handshakes: PendingHandshakes | None = None,
        counted: str | None = None,
    ) -> None:
        self._relay_path = relay_path
        self._serve_here = serve_here
        #: Called once this connection has ended while still this protocol's (relayed, or never
        #: served: a timeout, a client gone before its request line). One handed to a websocket
        #: connection is that connection's to end, and this protocol hears nothing more of it.
        self._on_end = on_end
        self._on_relay = on_relay  # told once the relay to the owner is up
        #: The server's count of connections still opening, per address: a connection reading
        #: its request line here is one, as it is in a websocket connection (connection.py);
        #: counted until it goes on (there, or relayed: the owner counts it) or ends.
        self._handshakes = handshakes
        #: The address the server counted this connection under before its TLS handshake, a
        #: count this protocol takes over once made (``took_count``) instead of counting again.
        self._precounted = counted
        self.took_count = False
        self._counted: str | None = None
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._pipe: asyncio.Transport | None = None  # the relay socket, once connected
        self._relaying = False
        self._connecting: asyncio.Task[None] | None = None  # held: the loop keeps only a weak one

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream's protocol: its transport is a Transport (typed as the base, as for any protocol).
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(REQUEST_LINE_TIMEOUT_S, transport.abort)
        if self._handshakes is not None and self._precounted is not None:
            self._counted, self.took_count = self._precounted, True
        elif self._handshakes is not None:
            address = peername_ip(transport.get_extra_info("peername"))
            refusal = self._handshakes.enter(address)
            if refusal is not None:
                transport.write(raw_http.refusal(503, "Service Unavailable", refusal, retry_after=1))
                transport.close()
                return
            self._counted = address

    def _uncount(self) -> None:
        if self._counted is not None and self._handshakes is not None:
            self._handshakes.leave(self._counted)
        self._counted = None

    def data_received(self, data: bytes) -> None:
        if self._pipe is not None:
            if not self._pipe.is_closing():
                self._pipe.write(data)
            return
        self._buffer += data
        if self._relaying:
            return  # the relay socket is connecting: kept for it, in order
        end = self._buffer.find(b"\r\n")
        if end < 0:
            if len(self._buffer) >= MAX_REQUEST_LINE:
                assert self._transport is not None
                self._transport.abort()
            return
        self._decide(bytes(self._buffer[:end]))

    def _decide(self, request_line: bytes) -> None:
        transport = self._transport
        assert transport is not None
        self._uncount()  # where it goes next counts it (the websocket connection, the owner)
        path = self._relay_path(session_id_in(request_line))
        if path is None:
            self._here()
            return
        self._relaying = True
        transport.pause_reading()  # what comes meanwhile waits in the kernel, not here
        self._connecting = asyncio.get_running_loop().create_task(self._connect(path))

    def _here(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        transport, buffered = self._transport, bytes(self._buffer)
        assert transport is not None
        self._buffer = bytearray()
        self._serve_here(transport, buffered)  # the transport's protocol is the connection's now

    async def _connect(self, path: str) -> None:
        transport = self._transport
        assert transport is not None
        loop = asyncio.get_running_loop()
        pipe: asyncio.Transport | None
        try:
            pipe, _ = await loop.create_unix_connection(lambda: _OwnerSide(transport), path)
        except OSError:
            pipe = None
        if transport.is_closing():  # the client left meanwhile (connection_lost ended it)
            if pipe is not None:
                pipe.close()
            return
        if pipe is None:
            # No owner listening: its process is gone, and its sessions with it. Served here,
            # where the resume is refused at once as lost (RealtimeServer.lost_session).
            self._relaying = False
            transport.resume_reading()
            self._here()
            return
        if self._timer is not None:
            self._timer.cancel()
        peer = transport.get_extra_info("peername")
        pipe.write(preamble(peer if isinstance(peer, tuple) else ("?", 0)) + bytes(self._buffer))
        self._buffer = bytearray()
        self._pipe = pipe
        transport.resume_reading()
        self._on_relay()

    def abort(self) -> None:
        """End the connection now (the server is closing)."""
        if self._transport is not None:
            self._transport.abort()

    # flow control: the client's TLS transport is full, so the owner's side waits
    def pause_writing(self) -> None:
        if self._pipe is not None:
            self._pipe.pause_reading()

    def resume_writing(self) -> None:
        if self._pipe is not None:
            self._pipe.resume_reading()

    def eof_received(self) -> bool:
        return False  # TLS has no half-close: the connection ends

    def connection_lost(self, exc: Exception | None) -> None:
        self._uncount()
        if self._timer is not None:
            self._timer.cancel()
        if self._pipe is not None:
            self._pipe.close()
        self._relaying = False
        self._on_end()


class _OwnerSide(asyncio.Protocol):
    """The relay socket's end in the relaying worker: what the owner sends goes to the client."""

    def __init__(self, client: asyncio.Transport) -> None:
        self._client = client

    def data_received(self, data: bytes) -> None:
        if not self._client.is_closing():
            self._client.write(data)

    # flow control: the owner's socket is full, so the client's reading waits
    def pause_writing(self) -> None:
        self._client.pause_reading()

    def resume_writing(self) -> None:
        self._client.resume_reading()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        # The owner closed the connection (or died): the client's ends too, once what the
        # owner sent has been written (close flushes; it sends TLS's close_notify).
        with contextlib.suppress(Exception):
            self._client.close()


class RelayedStream(asyncio.Protocol):
    """The relay socket's end in the owner: reads the preamble, then hands the transport to a
    websocket connection that counts the client the preamble names (``serve_here``)."""

    def __init__(self, serve_here: Callable[[asyncio.Transport, bytes, tuple[str, int]], None]) -> None:
        self._serve_here = serve_here
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # a stream's protocol: a Transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        transport = self._transport
        assert transport is not None
        try:
            found = read_preamble(self._buffer)
        except (ValueError, UnicodeDecodeError) as exc:
            log.error("relay.bad_preamble", error=repr(exc))
            transport.abort()
            return
        if found is None:
            return
        peer, used = found
        rest, self._buffer = bytes(self._buffer[used:]), bytearray()
        self._serve_here(transport, rest, peer)


__all__ = ["RequestLineSniffer", "RelayedStream", "preamble", "read_preamble", "session_id_in"]
