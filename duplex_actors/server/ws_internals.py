"""The one place the server reaches past websockets' documented API, and why.

websockets keeps the exception that ended a connection's frame parser (``parser_exc``, named
in ``Protocol.parse``'s docstring but not part of the documented API) for as long as the
connection object lives, traceback included. The traceback's frames hold the parser's
locals: the last frame it parsed, up to ``max_size`` bytes after inflation, or the inflated
bytes of a decompression it refused. A connection object sits in reference cycles, which the
server's GcPolicy freezes while they are alive, so that input stayed until the next full
reclaim: a permessage-deflate bomb with connection churn held 4 MiB per dropped connection
(see docs/reliability.md). No public setting releases it; dropping the traceback does, and
keeps the exception (websockets chains it as the cause of ``ConnectionClosed``).

Two more reach-ins, for the same reason (what stays alive after a connection closes):

* the read queue's flow control (``recv_messages.pause`` / ``.resume``) goes through the
  server's own read gate (connection.py), and at close those callbacks are replaced by a no-op:
  they point back at the connection, a cycle that kept every closed connection for a reclaim;
* ``serve(select_subprotocol=...)`` binds a closure over the connection to its protocol as
  ``select_subprotocol``: another such cycle, dropped at close (the handshake is long over);
* the protocol's parser, a generator whose frame holds the protocol and which stays suspended
  after the connection ends: replaced at close by an idle one;
* and one reach into asyncio below websockets: its selector transport's read callback, a bound
  method it keeps on itself, dropped when the transport is lost.

And one for what each event costs to send: :func:`send_burst` writes the frames of many events
in one socket write, through the connection's ``send_context`` and its sans-I/O protocol (no
public API sends several messages at once; one write per event cost the loop about twice).
And :func:`abort`, which cuts a socket at once through the connection's transport: a client
that stopped reading (or was pushed out, or flooded) cannot take a close frame, and websockets'
``close()`` waits for the closing handshake.

And :func:`next_to_read`, for what a frame costs to reach its session: whether a message parsed
now would be the next one ``recv()`` returns (the read queue holds no frame and is open), which
decides whether connection.py may hand it to the session's reader as it is parsed.

And two for what a connection holds of messages already read or not yet read:

* the protocol's parser keeps the last frame it parsed (a local of its generator) until it has
  parsed a whole next one. A client that sent one large message and went quiet left its
  payload, up to ``max_size`` after inflation, in the server for as long as the connection
  lived. :func:`forget_payload` drops the payload of a frame whose message has been read
  (``Frame`` is a plain dataclass; nothing in websockets reads a frame's data after the read
  queue handed its message out);
* :func:`queued_bytes` adds up the payloads the read queue holds, and
  :func:`whole_message_queued` says whether a ``recv()`` would return without more of the
  client, so that connection.py can bound the queue in bytes as well as in frames.

Everything else the server's session code knows of a connection comes through the documented
API: how a client ended its side is read from the ``ConnectionClosed`` its reader got. The
other module that works below that API is :mod:`.connection`, the ``ServerConnection``
subclass that enforces the edge limits (request head, handshake slots, frame pacing) where
websockets reads the socket.

tests/server/test_ws_internals_contract.py checks each part named here on the installed
websockets, and the ``server`` extra keeps websockets below the next major version until it
has been checked there.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.frames import Frame

from . import frame_cost

#: Links of an exception's chain (cause or context) followed at most.
_CHAIN = 8


def drop_parser_traceback(protocol: Any) -> bool:
    """Forget the tracebacks of the exception that ended ``protocol``'s parser and of its
    handshake (and of what they chain to). True if there was one."""
    found = False
    for exc in (getattr(protocol, "parser_exc", None), getattr(protocol, "handshake_exc", None)):
        for _ in range(_CHAIN):
            if exc is None:
                break
            found = True
            exc.__traceback__ = None
            exc = exc.__cause__ or exc.__context__
    return found


def route_read_queue_flow(connection: Any, pause: Callable[[], None], resume: Callable[[], None]) -> None:
    """Send the read queue's pause and resume through ``pause`` and ``resume``."""
    connection.recv_messages.pause = pause
    connection.recv_messages.resume = resume


def next_to_read(connection: Any) -> bool:
    """Whether a message parsed now would be the next one ``connection.recv()`` returns."""
    queue = connection.recv_messages
    return not queue.frames and not queue.closed


def forget_payload(frame: Frame) -> None:
    """Let go of ``frame``'s payload: its message has been read (module doc)."""
    frame.data = b""


def queued_bytes(connection: Any) -> int:
    """The payload bytes of the frames ``connection``'s read queue holds, not yet read."""
    return sum(len(frame.data) for frame in connection.recv_messages.frames.queue)


def whole_message_queued(connection: Any) -> bool:
    """Whether ``connection``'s read queue holds the last frame of a message: a ``recv()``
    would return without waiting for more of the client."""
    return any(frame.fin for frame in connection.recv_messages.frames.queue)


def release_closed_connection(connection: Any) -> None:
    """Break the cycles through a closed connection, its protocol and its transport (module
    doc), so that reference counting frees them at once."""
    connection.recv_messages.pause = connection.recv_messages.resume = _nothing
    protocol = connection.protocol
    vars(protocol).pop("select_subprotocol", None)
    # The protocol's parser is a generator of its own (parse, then discard) whose frame holds
    # the protocol: it ends suspended at discard's last yield, so every closed protocol, with
    # its reader, extensions and the exception that ended it, sat in that cycle until a
    # reclaim. Nothing steps the parser once the connection is lost; an idle one in its place
    # keeps receive_data and receive_eof harmless should anything call them.
    protocol.parser = _idle_parser()
    # asyncio's selector transport keeps its read callback on itself as a bound method: a cycle
    # through every closed transport and its socket object, which waited for a reclaim too.
    # Called from inside the transport's connection_lost, when its socket is no longer read.
    # Other loops' transports (uvloop's are C objects, with no __dict__) keep no such cycle.
    transport = connection.transport
    if "_read_ready_cb" in getattr(transport, "__dict__", ()):
        transport._read_ready_cb = None


def _idle_parser() -> Generator[None, None, None]:
    while True:
        yield


def _nothing() -> None:
    pass


async def send_burst(ws: ServerConnection, frames: list[bytes]) -> float:
    """Send text frames (UTF-8 JSON) in one socket write, waiting while the client's buffer is full.

    websockets writes each message it sends on its own: a syscall per event, which on loopback
    also wakes the client. A response's opening events sent in one write take less time and
    less of the server's CPU per turn (docs/benchmarks.md). Here the frames are serialised by
    websockets' own sans-I/O protocol and the bytes go out together; ``send_context`` does what ``send`` does around that (state
    checks, flow control, closing on errors).

    Returns the CPU seconds the serialising and writing took (frame_cost), without the waits
    around it (for the socket to drain), which are other tasks' time: the client's bill."""
    async with ws.send_context():
        began = frame_cost.mark()
        protocol = ws.protocol
        for frame in frames:
            protocol.send_text(frame)
        # Only our text frames are pending: websockets flushes what it produces itself (pongs,
        # close frames, the end of the stream) before returning to the loop, and send_text
        # never ends the stream, so there is no end-of-stream marker to keep apart.
        ws.transport.write(b"".join(protocol.data_to_send()))
        return frame_cost.billed_since(began)


def abort(connection: ServerConnection) -> None:
    """Cut ``connection``'s socket now, without a closing handshake (module doc)."""
    transport = connection.transport
    if transport is not None:
        transport.abort()
