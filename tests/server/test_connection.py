"""The server connection (server/connection.py) without a socket: a transport that records what
it is asked, a real websockets protocol parsing real frames.

What it must hold: reading resumes only when neither websockets' read queue nor a budget holds
it; what a read returned is fed in pieces, the rest kept while a budget holds reading and fed,
in order, once it lets go; every frame is counted, pings and pongs twice; a message of too many
fragments fails the connection with 1009; the read queue is bounded in bytes, a whole message
always gets in, and a message's payload is let go once it is read."""

from __future__ import annotations

import struct
import zlib

import anyio
import anyio.lowlevel
import pytest
from websockets.extensions.permessage_deflate import PerMessageDeflate
from websockets.frames import CloseCode, Frame, Opcode
from websockets.protocol import State
from websockets.server import ServerProtocol

from duplex_actors.server import connection as connection_module
from duplex_actors.server.connection import (
    FEED_BYTES,
    MAX_FRAGMENTS,
    PIECE_INFLATION_BYTES,
    READ_QUEUE_BYTES,
    paced_connection,
)

pytestmark = pytest.mark.anyio


class _Transport:
    """What the connection asks of its transport, with the reading state kept."""

    def __init__(self) -> None:
        self.reading = True
        self.pauses = 0
        self.written = bytearray()
        self.aborted = False

    def pause_reading(self) -> None:
        self.pauses += self.reading
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def get_extra_info(self, name, default=None):
        return default

    def write(self, data) -> None:
        self.written += data

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def abort(self) -> None:
        self.aborted = True


class _Server:
    def __init__(self) -> None:
        self.handler_tasks: set = set()

    async def handler(self, connection) -> None:
        pass


def _open(**budgets):
    """A connection past its handshake, as the server configures it, and its transport."""
    waits: list[tuple[str, float]] = []
    cls = paced_connection(on_paced=lambda what, wait: waits.append((what, wait)), **budgets)
    protocol = ServerProtocol()
    protocol.state = State.OPEN  # past the handshake: the parser reads frames
    protocol.parser = protocol.parse()
    next(protocol.parser)
    # No read-queue limit: tests take frames off the queue themselves (and call its pause and
    # resume directly where the gate is the point).
    conn = cls(protocol, _Server(), max_queue=None)
    transport = _Transport()
    conn.connection_made(transport)
    conn.request = object()  # later events are frames
    return conn, transport, waits


def _frame(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    """One masked client frame (payload under 126 bytes)."""
    return struct.pack("!BB", (0x80 if fin else 0) | opcode, 0x80 | len(payload)) + b"\0\0\0\0" + payload


def _messages(conn) -> list[bytes]:
    return [bytes(frame.data) for frame in conn.recv_messages.frames.queue]


async def test_reading_resumes_only_when_the_queue_and_the_control_debt_both_let_go():
    conn, transport, waits = _open(control_frames_per_s=100.0, control_frames_burst=5)
    conn.recv_messages.pause()  # the read queue is full
    for _ in range(5):  # within the burst
        conn.process_event(Frame(Opcode.PING, b""))
    assert waits == []
    # 3 over, 30 ms owed: the first asks for a 10 ms wait, the others add to it as it runs
    began = conn.loop.time()
    for _ in range(3):
        conn.process_event(Frame(Opcode.PONG, b""))
    # 10 ms less what the bucket refilled meanwhile (on the loop's clock: a pause of this
    # process between the pongs shortens it, never lengthens it).
    assert [what for what, _ in waits] == ["control"] and 0.0 < waits[0][1] <= 0.01 + 1e-9
    conn.recv_messages.resume()  # the queue drained, but the debt holds reading
    assert not transport.reading
    with anyio.fail_after(1):
        while not transport.reading:
            await anyio.sleep(0.001)
    # Not before the debt is paid (a late timer only makes it later).
    assert conn.loop.time() - began >= 0.029
    assert conn.paced_s("control") > 0.0
    assert transport.pauses == 1, "one pause for both reasons"


async def test_the_queue_resumes_reading_when_no_debt_is_owed():
    conn, transport, _ = _open()
    conn.process_event(Frame(Opcode.PING, b""))
    conn.recv_messages.pause()
    assert not transport.reading
    conn.recv_messages.resume()
    assert transport.reading


async def test_every_frame_is_counted_and_only_pings_and_pongs_twice():
    conn, transport, waits = _open(
        frames_per_s=1.0, frames_burst=3, control_frames_per_s=1.0, control_frames_burst=1
    )
    for _ in range(3):
        conn.process_event(Frame(Opcode.TEXT, b"{}"))
    assert transport.reading and waits == []
    conn.process_event(Frame(Opcode.CONT, b"x", fin=True))  # a fragment is a frame too
    assert [what for what, _ in waits] == ["frame_count"]
    conn2, _, waits2 = _open(
        frames_per_s=1.0, frames_burst=3, control_frames_per_s=1.0, control_frames_burst=1
    )
    conn2.process_event(Frame(Opcode.PING, b""))
    conn2.process_event(Frame(Opcode.PING, b""))
    assert [what for what, _ in waits2] == ["control"]


async def test_a_read_is_fed_in_pieces_and_the_rest_waits_for_the_budget_in_order(monkeypatch):
    # One read holding 1,200 text frames: with a burst of 100 a second, reading stops within a
    # piece of the budget, the rest is kept, and it is fed, in order, as the debt is paid.
    conn, transport, waits = _open(frames_per_s=2000.0, frames_burst=100)
    frames = [_frame(0x1, f"{i:05d}".encode()) for i in range(1200)]
    read = b"".join(frames)
    assert len(read) > 3 * FEED_BYTES
    conn.data_received(read)
    per_piece = FEED_BYTES // len(frames[0]) + 1
    assert not transport.reading
    assert 100 <= len(_messages(conn)) <= 100 + per_piece
    assert conn._rest
    queued = len(_messages(conn))
    conn.recv_messages.frames.queue.clear()  # the reader took them (without resuming the queue)
    with anyio.fail_after(5):
        while conn._rest or not transport.reading:
            queued += len(_messages(conn))
            conn.recv_messages.frames.queue.clear()
            await anyio.sleep(0.001)
    queued += len(_messages(conn))
    assert queued == 1200, "nothing lost"
    assert waits and all(what == "frame_count" for what, _ in waits)


async def test_a_long_read_gives_the_loop_up_and_feeds_the_rest_in_order(monkeypatch):
    monkeypatch.setattr(connection_module, "FEED_SLICE_S", 0.0)  # every piece is a slice
    conn, transport, _ = _open(frames_per_s=None, control_frames_per_s=None)
    frames = [_frame(0x1, f"{i:05d}".encode()) for i in range(2000)]
    conn.data_received(b"".join(frames))
    assert not transport.reading and conn._rest, "the rest waits for the next turn of the loop"
    fed_at_once = len(_messages(conn))
    assert fed_at_once < 2000
    with anyio.fail_after(5):
        while conn._rest:
            await anyio.lowlevel.checkpoint()
    assert transport.reading
    assert _messages(conn) == [f"{i:05d}".encode() for i in range(2000)]


async def test_a_message_of_too_many_fragments_fails_the_connection_with_1009():
    conn, transport, _ = _open(frames_per_s=None)
    conn.process_event(Frame(Opcode.TEXT, b"{", fin=False))
    for _ in range(MAX_FRAGMENTS - 1):
        conn.process_event(Frame(Opcode.CONT, b" ", fin=False))
    assert conn.protocol.state is State.OPEN
    conn.process_event(Frame(Opcode.CONT, b" ", fin=False))
    assert conn.protocol.state is State.CLOSING
    assert conn.protocol.close_sent.code == CloseCode.MESSAGE_TOO_BIG
    assert transport.written.startswith(b"\x88"), "the close frame went out"
    # The client is not waited for past the close timeout (the test's connection has 10 s).
    assert not transport.aborted
    assert conn._timers["close"].when() - conn.loop.time() == pytest.approx(conn.close_timeout, abs=0.5)


async def test_fragments_are_counted_per_message():
    conn, _, _ = _open(frames_per_s=None)
    for _ in range(3):  # three messages of MAX_FRAGMENTS fragments each: all within the limit
        conn.process_event(Frame(Opcode.TEXT, b"{", fin=False))
        for _ in range(MAX_FRAGMENTS - 2):
            conn.process_event(Frame(Opcode.CONT, b" ", fin=False))
        conn.process_event(Frame(Opcode.CONT, b"}", fin=True))
    assert conn.protocol.state is State.OPEN


async def test_a_lost_connection_cancels_its_pending_resume_and_rest():
    conn, _, _ = _open(control_frames_per_s=1.0, control_frames_burst=1)
    conn.process_event(Frame(Opcode.PING, b""))
    conn.process_event(Frame(Opcode.PING, b""))
    assert conn._timers
    conn.connection_lost(None)
    assert not conn._timers and not conn._rest


async def test_bytes_arriving_while_a_rest_waits_go_after_it_and_an_end_feeds_it_all(monkeypatch):
    monkeypatch.setattr(connection_module, "FEED_SLICE_S", 0.0)
    conn, transport, _ = _open(frames_per_s=None, control_frames_per_s=None)
    frames = [_frame(0x1, f"{i:05d}".encode()) for i in range(2000)]
    conn.data_received(b"".join(frames[:1000]))
    assert conn._rest
    conn.data_received(b"".join(frames[1000:]))  # e.g. a TLS transport's already-read bytes
    conn.eof_received()
    assert not conn._rest
    assert _messages(conn) == [f"{i:05d}".encode() for i in range(2000)]


def _parsers_last_frame(conn) -> Frame:
    """The frame websockets' parser keeps as a local (its generator, and the one it delegates
    to: ServerProtocol.parse runs Protocol.parse)."""
    parser = conn.protocol.parser
    while parser is not None:
        if "frame" in parser.gi_frame.f_locals:
            return parser.gi_frame.f_locals["frame"]
        parser = parser.gi_yieldfrom
    raise AssertionError("the parser keeps no frame: see ws_internals.forget_payload")


def _read_one(conn) -> bytes:
    """What ``recv()`` does for one unfragmented message, then what the session's reader tells
    the connection after it."""
    message = bytes(conn.recv_messages.frames.queue.popleft().data)
    conn.read_done()
    return message


async def test_the_read_queue_is_bounded_in_bytes_and_a_whole_message_always_gets_in():
    conn, transport, _ = _open(frames_per_s=None)
    third = READ_QUEUE_BYTES // 3 + 1
    conn.process_event(Frame(Opcode.TEXT, b"a" * third))
    conn.process_event(Frame(Opcode.TEXT, b"b" * third))
    assert transport.reading, "within the bound"
    conn.process_event(Frame(Opcode.TEXT, b"c" * third))
    assert not transport.reading, "past it, with whole messages queued: the reader goes first"
    assert _read_one(conn) == b"a" * third
    assert transport.reading, "back within the bound"

    # One message larger than the bound, in fragments: reading goes on until its last fragment
    # is in (the reader cannot take a part of it), then waits for the reader.
    conn, transport, _ = _open(frames_per_s=None)
    conn.process_event(Frame(Opcode.TEXT, b"x" * READ_QUEUE_BYTES, fin=False))
    conn.process_event(Frame(Opcode.CONT, b"y" * READ_QUEUE_BYTES, fin=False))
    assert transport.reading
    conn.process_event(Frame(Opcode.CONT, b"z", fin=True))
    assert not transport.reading
    # The reader took that message; the next one's first fragment alone is over the bound, and
    # no whole message is queued: reading goes on, or the reader would wait for ever.
    queue = conn.recv_messages.frames.queue
    for _ in range(3):
        queue.popleft()
    conn.process_event(Frame(Opcode.TEXT, b"w" * (2 * READ_QUEUE_BYTES), fin=False))
    conn.read_done()
    assert transport.reading


async def test_a_messages_payload_is_let_go_once_it_is_read_not_when_the_next_is_parsed():
    # websockets' parser keeps the last frame it parsed until it has parsed another: a client
    # that sent one large message and went quiet had it kept for the connection's life.
    conn, _, _ = _open(frames_per_s=None)
    payload = b"p" * 100
    conn.data_received(_frame(0x1, payload) + _frame(0x1, b"q" * 100))
    parsed = _parsers_last_frame(conn)
    assert parsed.data == b"q" * 100
    assert _read_one(conn) == payload
    assert parsed.data == b"q" * 100, "still queued: not read yet"
    assert _read_one(conn) == b"q" * 100
    assert parsed.data == b"", "read: the parser's reference holds nothing"


def _deflated_frame(payload: bytes) -> bytes:
    """One masked client text frame compressed as permessage-deflate sends it (no context
    takeover, a 4 KiB window: what the test's extension takes)."""
    zipper = zlib.compressobj(9, zlib.DEFLATED, -12)
    data = (zipper.compress(payload) + zipper.flush(zlib.Z_SYNC_FLUSH))[:-4]
    n = len(data)
    head = bytes([0x80 | 0x40 | 0x1])  # fin, rsv1 (compressed), text
    head += bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack("!H", n)
    return head + b"\0\0\0\0" + data  # a zero mask leaves the bytes as they are


async def test_a_read_of_messages_that_inflate_a_thousandfold_stops_within_a_piece_of_the_bound():
    # Eight messages of 256 KiB of one letter, ~300 bytes each compressed: one 4 KiB piece held
    # them all, so the hold the second one set came too late for the other six (2 MiB queued).
    # Pieces are sized by how much the client's messages inflate.
    conn, transport, _ = _open(frames_per_s=None)
    conn.protocol.extensions = [PerMessageDeflate(True, True, 12, 12)]
    message = b"a" * (256 << 10)
    read = b"".join(_deflated_frame(message) for _ in range(8))
    assert len(read) < FEED_BYTES
    conn.data_received(read)
    assert not transport.reading
    queued = sum(len(frame.data) for frame in conn.recv_messages.frames.queue)
    assert queued <= READ_QUEUE_BYTES + 2 * len(message), f"{queued} bytes queued"
    # The reader takes them one by one, and the rest is fed in pieces small enough for the bound.
    got = []
    with anyio.fail_after(5):
        while len(got) < 8:
            if conn.recv_messages.frames.queue:
                got.append(_read_one(conn))
                queued = sum(len(frame.data) for frame in conn.recv_messages.frames.queue)
                assert queued <= READ_QUEUE_BYTES + len(message) + PIECE_INFLATION_BYTES
            else:
                await anyio.sleep(0.001)
    assert got == [message] * 8, "nothing lost, in order"
