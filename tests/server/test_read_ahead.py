"""Each client's read-ahead over all its connections (server/read_ahead.py, server/connection.py).

What must hold: the ledger's count per client is what its connections hold parsed and unhandled
(read queues, and the message each reader has taken until it says it handled it); while a
client holds its limit, none of its connections feeds its parser (the bytes wait, in order,
and nothing is lost), other clients' connections read as before, and once the client is back
under the limit its waiting connections go on. A closed connection takes its holdings with it.
Over a real socket: many sessions of one client, each sending megabyte messages (a kilobyte
deflated) faster than its frame budget lets them be handled, stay within the limit together,
and every message is still answered."""

from __future__ import annotations

import asyncio
import json
import struct
import zlib

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect
from websockets.protocol import State
from websockets.server import ServerProtocol

from duplex_actors.actors.runtime import Runtime
from duplex_actors.engines.scripted import ScriptedEngine
from duplex_actors.server.app import RealtimeServer, ServerConfig
from duplex_actors.server.connection import PIECE_INFLATION_BYTES, paced_connection, with_edge_limits
from duplex_actors.server.guard import exempt_from
from duplex_actors.server.read_ahead import ReadAheadLedger

from .conftest import http_get, metric_sample
from .test_connection import _read_one, _Server, _Transport

pytestmark = pytest.mark.anyio


# --------------------------------------------------------------------------- the ledger alone


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(-300, 300), st.booleans()),
        max_size=60,
    )
)
def test_the_ledger_counts_each_client_and_wakes_its_waiters_once_it_is_under(steps):
    limit = 400
    ledger = ReadAheadLedger(limit)
    held = {c: 0 for c in "abc"}
    woken: dict[str, int] = {c: 0 for c in "abc"}
    waiting: dict[str, int] = {c: 0 for c in "abc"}
    for client, delta, wait in steps:
        delta = max(delta, -held[client])  # a connection only gives back what it counted
        before = held[client]
        ledger.change(client, delta)
        held[client] += delta
        if delta < 0 and held[client] < limit and waiting[client]:
            woken[client] += waiting[client]
            waiting[client] = 0
        if wait and ledger.over(client):
            ledger.wait(client, object(), lambda c=client: woken.__setitem__(c, woken[c] - 1))
            waiting[client] += 1
        assert ledger.held(client) == held[client]
        assert ledger.over(client) is (held[client] >= limit)
        assert ledger.total == sum(held.values())
        assert ledger.waiting(client) == waiting[client], (client, before, delta)
    # Each wake-up decremented what the model added for it: every waiter was woken exactly once.
    assert all(n == 0 for n in woken.values()), woken
    with pytest.raises(ValueError):
        ledger.change("a", -(held["a"] + 1))


def test_a_forgotten_waiter_is_not_woken():
    ledger = ReadAheadLedger(10)
    ledger.change("a", 10)
    calls = []
    ledger.wait("a", "conn", lambda: calls.append(1))
    ledger.forget("a", "conn")
    ledger.change("a", -5)
    assert calls == [] and ledger.waiting("a") == 0


# --------------------------------------------------------------------------- connections


def _frame(payload: bytes, opcode: int = 0x1, fin: bool = True) -> bytes:
    """One masked client frame of any length (a zero mask leaves the payload as it is)."""
    head = bytes([(0x80 if fin else 0) | opcode])
    n = len(payload)
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 1 << 16:
        head += bytes([0x80 | 126]) + struct.pack("!H", n)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", n)
    return head + b"\0\0\0\0" + payload


def _open_for(ledger: ReadAheadLedger, client: str, exempt=None):
    """A connection past its handshake whose client is ``client``, counted in ``ledger``."""
    waits: list[tuple[str, float]] = []
    cls = with_edge_limits(
        paced_connection(frames_per_s=None, on_paced=lambda what, wait: waits.append((what, wait))),
        max_head_bytes=None,
        max_headers=64,
        handshakes=None,
        read_ahead=ledger,
        read_ahead_exempt=exempt,
    )
    protocol = ServerProtocol()
    protocol.state = State.OPEN
    protocol.parser = protocol.parse()
    next(protocol.parser)
    conn = cls(protocol, _Server(), max_queue=None)
    transport = _Transport()
    conn.connection_made(transport)
    conn.request = object()
    conn.client_ip = client  # what a trusted proxy's header, or the socket's peer, says
    return conn, transport, waits


def _queued(conn) -> list[bytes]:
    return [bytes(frame.data) for frame in conn.recv_messages.frames.queue]


async def _settle() -> None:
    for _ in range(5):
        await anyio.lowlevel.checkpoint()


async def test_a_client_at_its_limit_has_none_of_its_connections_read_and_others_clients_read_on():
    kib = 1 << 10
    ledger = ReadAheadLedger(300 * kib)
    a, a_transport, a_waits = _open_for(ledger, "10.0.0.1")
    b, b_transport, b_waits = _open_for(ledger, "10.0.0.1")
    c, c_transport, _ = _open_for(ledger, "10.0.0.2")

    # a: two messages of 200 KiB. Its own queue stops at the second (past READ_QUEUE_BYTES), and
    # its client now holds 400 KiB, past the limit.
    a.data_received(_frame(b"a" * (200 * kib)) + _frame(b"A" * (200 * kib)))
    assert len(_queued(a)) == 2 and ledger.held("10.0.0.1") == 400 * kib

    # b, the same client's other connection: nothing of its message is parsed, and it is not
    # lost: it waits, with reading paused.
    b.data_received(_frame(b"b" * (10 * kib)) + _frame(b"B" * 10))
    assert _queued(b) == [] and not b_transport.reading
    assert ledger.waiting("10.0.0.1") == 1 and ledger.holds == 1

    # c, another client: reads as before.
    c.data_received(_frame(b"c" * (10 * kib)))
    assert _queued(c) == [b"c" * (10 * kib)] and c_transport.reading

    # a's reader takes a message: it is in the reader's hands and still counts ...
    assert _read_one(a) == b"a" * (200 * kib)
    assert ledger.held("10.0.0.1") == 400 * kib and not b_transport.reading
    # ... until the reader has handled it: the client is back under, and b goes on, in order.
    a.handled()
    assert ledger.held("10.0.0.1") == 200 * kib
    await _settle()
    assert _queued(b) == [b"b" * (10 * kib), b"B" * 10] and b_transport.reading
    assert ledger.held("10.0.0.1") == 200 * kib + 10 * kib + 10
    assert [what for what, _ in b_waits] == ["read_ahead"] and a_waits == []

    # A lost connection takes what it held, and a read after its end counts nothing again.
    a.connection_lost(None)
    assert ledger.held("10.0.0.1") == 10 * kib + 10
    a.read_done()
    a.handled()
    assert ledger.held("10.0.0.1") == 10 * kib + 10
    for conn in (b, c):
        while conn.recv_messages.frames.queue:
            _read_one(conn)
            conn.handled()
    assert ledger.total == 0


def _one_client_at_its_limit():
    """Two connections of one client: ``a`` holds the client's limit (100 bytes queued), and
    what ``b`` was sent waits unparsed."""
    ledger = ReadAheadLedger(100)
    a, _, _ = _open_for(ledger, "10.0.0.1")
    b, b_transport, _ = _open_for(ledger, "10.0.0.1")
    a.data_received(_frame(b"x" * 100))
    b.data_received(_frame(b"y"))
    assert _queued(b) == [] and not b_transport.reading and ledger.waiting("10.0.0.1") == 1
    return ledger, a, b, b_transport


async def test_a_message_a_reader_holds_unhandled_keeps_its_client_at_the_limit():
    ledger, a, b, b_transport = _one_client_at_its_limit()
    assert _read_one(a) == b"x" * 100  # taken, and waiting out a pacer before it is handled
    assert ledger.held("10.0.0.1") == 100
    await _settle()
    assert _queued(b) == [] and not b_transport.reading
    a.handled()
    await _settle()
    assert _queued(b) == [b"y"] and b_transport.reading


async def test_an_exempt_address_is_not_counted():
    ledger = ReadAheadLedger(100)
    conn, transport, _ = _open_for(ledger, "127.0.0.1", exempt=exempt_from(("127.0.0.0/8",)))
    conn.data_received(_frame(b"x" * 150) + _frame(b"y" * 150))
    assert _queued(conn) == [b"x" * 150, b"y" * 150] and transport.reading
    assert ledger.total == 0


async def test_a_lost_connection_that_waited_is_not_woken_and_leaves_nothing_counted():
    ledger, a, b, _ = _one_client_at_its_limit()
    b.connection_lost(None)
    assert ledger.waiting("10.0.0.1") == 0
    a.connection_lost(None)
    assert ledger.total == 0


# --------------------------------------------------------------------------- over a socket


def _deflated(message: str) -> int:
    zipper = zlib.compressobj(6, zlib.DEFLATED, -12)
    return len(zipper.compress(message.encode()) + zipper.flush(zlib.Z_SYNC_FLUSH))


async def test_sessions_of_one_client_sending_inflating_messages_stay_within_its_limit_and_all_are_answered():
    """Sixteen sessions of one client each send four ~1 MB messages (a kilobyte each, deflated)
    at once. The frame budget lets each session's reader handle one a quarter second, so the
    rest wait: before, in each connection's read queue and its reader's hands (one whole
    message and up to 256 KiB more each: 15.2 MiB at once when measured); now within the
    client's limit, plus the message that crossed it. Every message is answered, in order."""
    mib = 1 << 20
    limit = 4 * mib + PIECE_INFLATION_BYTES  # the least a server with these limits uses
    config = ServerConfig(
        port=0,
        exempt_networks=(),  # loopback is the client here, and counted
        max_sessions_per_address=16,
        frame_intake_bytes_per_s=4 * mib,
        frame_intake_burst_bytes=mib,
        read_ahead_bytes_per_client=1,  # raised to the least it may be (the transport cap and a piece)
    )
    padding = "x" * 999_000
    assert _deflated(padding) < 4096
    async with Runtime(ScriptedEngine(record=False)) as runtime, RealtimeServer(runtime, config) as server:
        ledger = server.read_ahead
        assert ledger is not None and ledger.limit == limit
        highest = 0

        async def watch() -> None:
            nonlocal highest
            while True:
                highest = max(highest, ledger.total)
                await asyncio.sleep(0)

        async def session(i: int) -> list[tuple[str, str]]:
            async with connect(server.url, max_size=None, ping_interval=None) as ws:
                await ws.recv()  # session.created
                for k in range(4):
                    await ws.send(json.dumps({"type": "x.pad", "event_id": f"e{i}.{k}", "pad": padding}))
                answers = []
                for _ in range(4):
                    event = json.loads(await asyncio.wait_for(ws.recv(), 60))
                    answers.append((event["type"], event["error"]["event_id"]))
                return answers

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            answers = await asyncio.gather(*(session(i) for i in range(16)))
        finally:
            watcher.cancel()
        for i, got in enumerate(answers):
            assert got == [("error", f"e{i}.{k}") for k in range(4)], got
        # One message past the limit at most: the one whose piece crossed it (each connection
        # asks before every piece, and the count changes as each message is parsed).
        assert highest <= limit + 1.5 * mib, f"held {highest / mib:.1f} MiB at once"
        assert ledger.holds > 0, "the client was never held: the test did not reach the limit"
        assert ledger.total == 0
        _, _, body = await http_get(server.http_url + "/metrics")
        assert metric_sample(body, "duplex_client_read_ahead_bytes") == 0
        assert metric_sample(body, "duplex_client_read_ahead_holds_total") == ledger.holds
