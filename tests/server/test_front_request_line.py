"""``serve --workers``' front reads each connection's request line without spinning.

A hostile probe (2026-12-02) opened 5,000 connections that each sent a request line without
its end: the front re-peeked every 5 ms and sat at a full core, before any key was checked."""

from __future__ import annotations

import asyncio
import socket

import pytest

from duplex_actors.server.front_door import _peek_request_line

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


class CountingSocket(socket.socket):
    """Counts the front's peeks."""

    peeks = 0

    def recv(self, *args):  # type: ignore[override]
        type(self).peeks += 1
        return super().recv(*args)


@pytest.fixture
def pair():
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    listener.close()
    conn = CountingSocket(fileno=accepted.detach())
    conn.setblocking(False)
    CountingSocket.peeks = 0
    yield client, conn
    client.close()
    conn.close()


async def test_a_request_line_in_pieces_is_waited_for_not_polled(pair):
    client, conn = pair
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(_peek_request_line(loop, conn))
    client.sendall(b"GET /v1/realtime?session")
    await asyncio.sleep(0.3)
    assert not task.done()
    assert CountingSocket.peeks <= 3, CountingSocket.peeks  # polling every 5 ms: ~60
    client.sendall(b"_id=sess_w0_ab HTTP/1.1\r\nHost: x\r\n\r\n")
    line = await asyncio.wait_for(task, 5)
    assert line == b"GET /v1/realtime?session_id=sess_w0_ab HTTP/1.1"
    # The worker receives the same socket: it is readable again at every byte.
    assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    assert conn.recv(1 << 16).startswith(b"GET /v1/realtime?session_id=")  # nothing was consumed


async def test_a_client_gone_mid_line_ends_the_wait(pair):
    client, conn = pair
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(_peek_request_line(loop, conn))
    client.sendall(b"GET /v1/real")
    await asyncio.sleep(0.1)
    client.close()
    assert await asyncio.wait_for(task, 5) is None


@pytest.mark.parametrize(
    ("line", "exempt", "counted"),
    [
        (b"GET /v1/realtime?model=gpt-realtime HTTP/1.1", False, True),
        (b"GET /v1/realtime HTTP/1.1", False, True),
        (b"GET /v1/realtime?session_id=sess_w0g0_ab HTTP/1.1", False, False),  # a resume
        (b"GET /health HTTP/1.1", False, False),
        (b"GET /metrics HTTP/1.1", False, False),
        (b"GET /v1/realtime/../health HTTP/1.1", False, False),
        (b"GARBAGE", False, False),
        (b"GET /v1/realtime HTTP/1.1", True, False),  # an exempt (or trusted proxy's) address
    ],
)
def test_only_a_new_session_from_an_address_not_exempt_counts_in_the_session_quota(line, exempt, counted):
    from duplex_actors.server.front_door import FrontDoor, SessionQuota

    with socket.create_server(("127.0.0.1", 0)) as listener:
        with socket.create_connection(listener.getsockname()):
            conn, _ = listener.accept()
            with conn:
                quota = SessionQuota(2, "/v1/realtime", lambda address: exempt)
                front = FrontDoor([], listener, session_quota=quota)
                assert front._new_session_client(conn, line) == ("127.0.0.1" if counted else None)
                assert FrontDoor([], listener)._new_session_client(conn, line) is None  # no quota


async def test_a_new_session_at_its_quota_waits_for_a_release_then_takes_its_place_once():
    from duplex_actors.server.front_door import QUOTA_SETTLE_S, FrontDoor

    with socket.create_server(("127.0.0.1", 0)) as listener:
        front = FrontDoor([], listener)
        first = front.ledger.handed(0, None, "10.0.0.1")
        front.ledger.handed(0, None, "10.0.0.1")
        loop = asyncio.get_running_loop()
        began = loop.time()
        assert not await front._quota_allows("10.0.0.1", 2)  # nothing released: refused
        assert QUOTA_SETTLE_S <= loop.time() - began < QUOTA_SETTLE_S + 0.2
        assert await front._quota_allows("10.0.0.2", 2)  # another client: at once
        # Two wait; one place frees: one of them takes it (its hand-off counts at once), the
        # other is refused when its wait ends.
        waiting = [asyncio.create_task(_take_when_allowed(front)) for _ in range(2)]
        await asyncio.sleep(0.05)
        front._apply("x", [first])
        assert sorted(await asyncio.gather(*waiting)) == [False, True]
        assert front.ledger.sessions_of("10.0.0.1") == 2


async def _take_when_allowed(front) -> bool:
    allowed = await front._quota_allows("10.0.0.1", 2)
    if allowed:
        front.ledger.handed(0, None, "10.0.0.1")  # as _route hands it over, in the same step
    return allowed
