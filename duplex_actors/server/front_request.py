"""What the front of ``serve --workers`` reads of a request before it hands the connection over.

Everything is read with ``MSG_PEEK``: the worker still receives every byte and parses the
request itself. The request line is always read (it routes a resume to the worker that owns
its session). The rest of the head is read only when something the front counts over every
worker needs it: the API key a request presents (the per-key quota and connect rate, and
whether a worker would answer 401 before counting anything), and the client a trusted proxy
forwards (``X-Forwarded-For``): counted by its socket peer, every client behind one proxy was
one subject, so the front left them to each worker and a client held N times its limits.

The front must read a request as its worker will, or a client finds the difference and uses
it: the endpoint's path is compared as the worker compares it (a trailing slash is the same
endpoint; read strictly, ``/v1/realtime/`` opened sessions the front never counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

import attrs
from websockets.datastructures import Headers

from .client_address import forwarded_client, forwarded_for_in_head, peername_ip
from .guard import accepted_key, client_subject, key_digest
from .tls_relay import MAX_REQUEST_LINE, session_id_in

#: The most of a request's head the front reads (a websocket handshake's is a few hundred
#: bytes; nginx's default buffers take 32 KiB). A longer one that the front must read is
#: answered 431: read by its worker alone, it would escape the front's counts.
MAX_HEAD = 32 << 10


class HeadTooLong(ValueError):
    """A request head longer than MAX_HEAD that the front had to read (answered 431)."""


@attrs.frozen(slots=True)
class FrontRequest:
    """A request as the front knows it when it decides where it goes and what it counts for."""

    #: The request line, as received (what routes it).
    line: bytes
    #: Whether it asks for the realtime endpoint (a new session or a resume).
    realtime: bool
    #: The session id it resumes (``?session_id=``), if any.
    resumes: str | None
    #: Whom the per-address limits count it as (guard.client_subject): its socket's peer, or,
    #: from a trusted proxy whose head was read, the client that proxy forwards.
    client: str
    #: The client's address before client_subject (what the exempt networks are matched on).
    address: str
    #: Whether its head was read (else ``key`` is unknown, and ``client`` is the peer).
    head_read: bool = False
    #: The digest of the server's API key it presents (None: none presented, or unread).
    key: bytes | None = None

    @property
    def new_session(self) -> bool:
        return self.realtime and self.resumes is None


def targets(line: bytes, path: str) -> bool:
    """Whether a request line asks for ``path`` as a worker reads it (http_gate.py): the
    target's path, its trailing slashes dropped."""
    parts = line.split(b" ")
    if len(parts) < 2:
        return False
    target = urlsplit(parts[1].decode("latin-1")).path.rstrip("/") or "/"
    return target == (path.rstrip("/") or "/")


async def read_request(
    loop: asyncio.AbstractEventLoop,
    conn: socket.socket,
    line: bytes,
    *,
    path: str,
    wants_head: Callable[[bool, str], bool],
    keys: tuple[str, ...] = (),
    trusted: Callable[[str], bool] | None = None,
) -> FrontRequest:
    """``conn``'s request, from its ``line`` and, where ``wants_head(new_session, peer)`` says
    so for a realtime request, its head. Raises HeadTooLong, or ValueError when the client
    closes before the head's end."""
    peer = peername_ip(conn.getpeername())
    realtime = targets(line, path)
    resumes = session_id_in(line) if realtime else None
    plain = FrontRequest(line, realtime, resumes, client_subject(peer), peer)
    if not realtime or not wants_head(resumes is None, peer):
        return plain
    try:
        head = await _peek_until(loop, conn, b"\r\n\r\n", MAX_HEAD)
    except ValueError:
        raise HeadTooLong(f"the request's head is longer than {MAX_HEAD} bytes") from None
    if head is None:
        raise ValueError("the client closed before the end of its request's head")
    address = peer
    if trusted is not None:
        address = forwarded_client(peer, forwarded_for_in_head(head), trusted)
    key = accepted_key(head_fields(head), keys) if keys else None
    return attrs.evolve(
        plain, client=client_subject(address), address=address, head_read=True, key=key_digest(key)
    )


def head_fields(head: bytes) -> Headers:
    """A request head's header fields (the request line skipped), as the worker's websockets
    parses them for the key: a field per line, its name before the first colon."""
    fields = Headers()
    for raw in head.split(b"\r\n")[1:]:
        name, colon, value = raw.partition(b":")
        if colon:
            fields[name.decode("latin-1").strip()] = value.decode("latin-1").strip()
    return fields


async def peek_request_line(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes | None:
    """The HTTP request line, read with MSG_PEEK so the worker still receives every byte."""
    return await _peek_until(loop, conn, b"\r\n", MAX_REQUEST_LINE)


async def _peek_until(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, end_mark: bytes, limit: int
) -> bytes | None:
    """What the client sent up to ``end_mark`` (the request line's end, the head's), read with
    MSG_PEEK so the worker still receives every byte; None if it closed first; ValueError past
    ``limit`` bytes."""
    seen = -1  # bytes buffered at the last peek that waited for more
    try:
        while True:
            try:
                data = conn.recv(limit, socket.MSG_PEEK)
            except BlockingIOError:
                await wait_io(loop, conn, readable=True)
                continue
            if not data:
                return None  # closed before sending anything
            end = data.find(end_mark)
            if end >= 0:
                return data[:end]
            if len(data) >= limit:
                raise ValueError(f"no {end_mark!r} in the first {limit} bytes")
            if len(data) == seen:
                return None  # readable with nothing new: the client closed mid-line
            seen = len(data)
            # Part of a line is buffered, and a peek leaves it there: the socket stays readable,
            # and waiting for readability would spin. So the kernel is asked to call it readable
            # only once more bytes than these have come (or the client is gone). Re-peeking on
            # a timer instead costs the front CPU for every such connection held open (a
            # slow-loris client: a request line without its end).
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, seen + 1)
            await wait_io(loop, conn, readable=True)
    finally:
        if seen >= 0:
            with contextlib.suppress(OSError):
                # The worker gets the same socket: it must see each byte as it comes.
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)


async def wait_io(loop: asyncio.AbstractEventLoop, sock: socket.socket, *, readable: bool) -> None:
    """Wait until ``sock`` is readable (or writable)."""
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    add, remove = (loop.add_reader, loop.remove_reader) if readable else (loop.add_writer, loop.remove_writer)
    add(sock.fileno(), wake)
    try:
        await ready
    finally:
        remove(sock.fileno())
