"""``serve --workers``' front reads each connection's request line without spinning.

A hostile probe (2026-12-02) opened 5,000 connections that each sent a request line without
its end: the front re-peeked every 5 ms and sat at a full core, before any key was checked."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import pytest

from duplex_actors.server.front_door import FrontDoor, SessionQuota, _peek_request_line

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


@pytest.mark.parametrize(
    ("head", "counted_for"),
    [
        (b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-one\r\n\r\n", "sk-one"),
        (b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\napi-key: sk-two\r\n\r\n", "sk-two"),
        (
            b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\n"
            b"Sec-WebSocket-Protocol: realtime, openai-insecure-api-key.sk-one\r\n\r\n",
            "sk-one",
        ),
        (b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-wrong\r\n\r\n", None),
        (b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\n\r\n", None),  # no key: the worker says 401
        # Given twice, as the worker reads it: any one that is a key counts.
        (
            b"GET /v1/realtime HTTP/1.1\r\nAuthorization: Bearer x\r\nAuthorization: Bearer sk-two\r\n\r\n",
            "sk-two",
        ),
        # A resume, or a request for no session, counts for nothing (and is not read further).
        (b"GET /v1/realtime?session_id=sess_w0g0_ab HTTP/1.1\r\nAuthorization: Bearer sk-one\r\n\r\n", None),
        (b"GET /health HTTP/1.1\r\nAuthorization: Bearer sk-one\r\n\r\n", None),
    ],
)
async def test_a_new_sessions_api_key_is_read_from_its_head_and_counted_by_digest(head, counted_for):
    # serve --workers: each worker counted a key's sessions alone, so a key held its
    # --max-sessions-per-key on every worker. The front reads the key where a worker does.
    from duplex_actors.server.guard import key_digest

    quota = SessionQuota(None, "/v1/realtime", lambda _: False, per_key=2, keys=("sk-one", "sk-two"))
    with _front_reading(head, quota) as (front, conn):
        line = head.split(b"\r\n", 1)[0]
        counts = await front._new_session_counts(asyncio.get_running_loop(), conn, line)
        digest = key_digest(counted_for)
        expected = [] if digest is None else [("key:" + digest.hex(), 2, "API key")]
        assert counts == expected
        assert conn.recv(1 << 16) == head  # nothing was consumed: the worker reads it all


async def test_a_head_too_long_to_read_for_its_key_is_dropped_not_passed_uncounted():
    from duplex_actors.server.front_door import MAX_HEAD, HeadTooLong

    padding = b"X-Pad: " + b"a" * MAX_HEAD + b"\r\n"
    head = b"GET /v1/realtime HTTP/1.1\r\n" + padding + b"Authorization: Bearer k\r\n\r\n"
    quota = SessionQuota(None, "/v1/realtime", lambda _: False, per_key=2, keys=("k",))
    with _front_reading(head, quota) as (front, conn):
        with pytest.raises(HeadTooLong):  # _route answers it 431
            await front._new_session_counts(asyncio.get_running_loop(), conn, b"GET /v1/realtime HTTP/1.1")


async def test_a_session_counts_for_its_address_and_its_key_each_against_its_own_limit():
    head = b"GET /v1/realtime HTTP/1.1\r\nAuthorization: Bearer k\r\n\r\n"
    quota = SessionQuota(5, "/v1/realtime", lambda _: False, per_key=2, keys=("k",))
    with _front_reading(head, quota) as (front, conn):
        counts = await front._new_session_counts(
            asyncio.get_running_loop(), conn, b"GET /v1/realtime HTTP/1.1"
        )
        assert [(limit, what) for _, limit, what in counts] == [(5, "address"), (2, "API key")]
        assert counts[0][0] == "127.0.0.1"


@contextlib.contextmanager
def _front_reading(head: bytes, quota: SessionQuota) -> Iterator[tuple[FrontDoor, socket.socket]]:
    """A front with ``quota``, and its end of a connection whose client has sent ``head``."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with socket.create_connection(listener.getsockname()) as client:
            conn, _ = listener.accept()
            with conn:
                conn.setblocking(False)
                client.sendall(head)
                yield FrontDoor([], listener, session_quota=quota), conn


async def test_a_place_taken_while_another_quota_is_waited_for_is_checked_again():
    # Counted for its address and its key: the key at its quota, the wait for it lets another
    # connection of the same address take the address's last place. Answered by the checks
    # before the wait, it passed the address's quota by one; now all are checked again.
    from duplex_actors.server.front_door import FrontDoor

    with socket.create_server(("127.0.0.1", 0)) as listener:
        front = FrontDoor([], listener)
        holder = front.ledger.handed(0, None, "key:k")  # the key at its quota of 1
        counts = [("10.0.0.1", 1, "address"), ("key:k", 1, "API key")]
        admitting = asyncio.create_task(front._admit(counts))
        await asyncio.sleep(0.05)  # waiting for the key's place
        front.ledger.handed(0, None, "10.0.0.1")  # another connection takes the address's place
        front._apply("x", [holder])  # and the key's place frees
        assert await asyncio.wait_for(admitting, 5) == ("10.0.0.1", 1, "address")
        # With every place free, admitted at once.
        assert await front._admit([("10.0.0.2", 1, "address"), ("key:k", 1, "API key")]) is None
