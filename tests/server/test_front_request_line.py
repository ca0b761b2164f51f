"""``serve --workers``' front reads each connection's request line without spinning.

A hostile probe (2026-12-02) opened 5,000 connections that each sent a request line without
its end: the front re-peeked every 5 ms and sat at a full core, before any key was checked."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from duplex_actors.server.front_door import FrontDoor, SessionQuota
from duplex_actors.server.front_request import HeadTooLong, peek_request_line

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
    task = asyncio.create_task(peek_request_line(loop, conn))
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
    task = asyncio.create_task(peek_request_line(loop, conn))
    client.sendall(b"GET /v1/real")
    await asyncio.sleep(0.1)
    client.close()
    assert await asyncio.wait_for(task, 5) is None


@pytest.mark.parametrize(
    ("line", "exempt", "counted"),
    [
        (b"GET /v1/realtime?model=gpt-realtime HTTP/1.1", False, True),
        (b"GET /v1/realtime HTTP/1.1", False, True),
        # The worker reads the path without its trailing slash: the same endpoint, the same
        # count (read strictly, these opened sessions the front never counted).
        (b"GET /v1/realtime/ HTTP/1.1", False, True),
        (b"GET /v1/realtime//?model=m HTTP/1.1", False, True),
        (b"GET /v1/realtime?session_id=sess_w0g0_ab HTTP/1.1", False, False),  # a resume
        (b"GET /health HTTP/1.1", False, False),
        (b"GET /metrics HTTP/1.1", False, False),
        (b"GET /v1/realtime/../health HTTP/1.1", False, False),
        (b"GARBAGE", False, False),
        (b"GET /v1/realtime HTTP/1.1", True, False),  # an exempt address
    ],
)
async def test_only_a_new_session_from_an_address_not_exempt_counts_in_the_session_quota(
    line, exempt, counted
):
    quota = SessionQuota(2, lambda address: exempt)
    with _front_reading(line + b"\r\n\r\n", quota) as (front, conn):
        request = await front._read(asyncio.get_running_loop(), conn, line)
        expected = [("127.0.0.1", 2, "address")] if counted else []
        assert front._new_session_counts(request) == expected
        assert FrontDoor([], front.listener)._new_session_counts(request) == []  # no quota


async def test_a_new_session_at_its_quota_waits_for_a_release_then_takes_its_place_once(monkeypatch):
    from duplex_actors.server import front_door
    from duplex_actors.server.front_door import QUOTA_SETTLE_S, FrontDoor

    with socket.create_server(("127.0.0.1", 0)) as listener:
        front = FrontDoor([], listener)
        first = front.ledger.handed(0, None, "10.0.0.1")
        front.ledger.handed(0, None, "10.0.0.1")
        loop = asyncio.get_running_loop()
        began = loop.time()
        assert not await front._quota_allows("10.0.0.1", 2)  # nothing released: refused
        # The lower bound is the point; the upper one only says the wait ends (a full
        # collection late in a CI run can take most of a second).
        assert QUOTA_SETTLE_S <= loop.time() - began < QUOTA_SETTLE_S + 2.0
        assert await front._quota_allows("10.0.0.2", 2)  # another client: at once
        # Two wait; one place frees: one of them takes it (its hand-off counts at once), the
        # other is refused when its wait ends. A longer wait here, so that a pause of the
        # host's between the two steps cannot end both waits before the release.
        monkeypatch.setattr(front_door, "QUOTA_SETTLE_S", 1.5)
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

    quota = SessionQuota(None, lambda _: False, per_key=2)
    with _front_reading(head, quota, keys=("sk-one", "sk-two")) as (front, conn):
        line = head.split(b"\r\n", 1)[0]
        counts = front._new_session_counts(await front._read(asyncio.get_running_loop(), conn, line))
        digest = key_digest(counted_for)
        expected = [] if digest is None else [("key:" + digest.hex(), 2, "API key")]
        assert counts == expected
        assert conn.recv(1 << 16) == head  # nothing was consumed: the worker reads it all


async def test_a_head_too_long_to_read_for_its_key_is_dropped_not_passed_uncounted():
    from duplex_actors.server.front_request import MAX_HEAD

    padding = b"X-Pad: " + b"a" * MAX_HEAD + b"\r\n"
    head = b"GET /v1/realtime HTTP/1.1\r\n" + padding + b"Authorization: Bearer k\r\n\r\n"
    quota = SessionQuota(None, lambda _: False, per_key=2)
    with _front_reading(head, quota, keys=("k",)) as (front, conn):
        with pytest.raises(HeadTooLong):  # _route answers it 431
            await front._read(asyncio.get_running_loop(), conn, b"GET /v1/realtime HTTP/1.1")


async def test_a_session_counts_for_its_address_and_its_key_each_against_its_own_limit():
    head = b"GET /v1/realtime HTTP/1.1\r\nAuthorization: Bearer k\r\n\r\n"
    quota = SessionQuota(5, lambda _: False, per_key=2)
    with _front_reading(head, quota, keys=("k",)) as (front, conn):
        request = await front._read(asyncio.get_running_loop(), conn, b"GET /v1/realtime HTTP/1.1")
        counts = front._new_session_counts(request)
        assert [(limit, what) for _, limit, what in counts] == [(5, "address"), (2, "API key")]
        assert counts[0][0] == "127.0.0.1"


@contextlib.contextmanager
def _front_reading(
    head: bytes, quota: SessionQuota | None, **front: Any
) -> Iterator[tuple[FrontDoor, socket.socket]]:
    """A front with ``quota`` (and ``front``'s other settings), and its end of a connection
    whose client has sent ``head``."""
    with socket.create_server(("127.0.0.1", 0)) as listener, _sent(head) as conn:
        yield FrontDoor([], listener, session_quota=quota, **front), conn


@contextlib.contextmanager
def _sent(head: bytes) -> Iterator[socket.socket]:
    """The server's end of a connection whose client has sent ``head``."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with socket.create_connection(listener.getsockname()) as client:
            conn, _ = listener.accept()
            with conn:
                conn.setblocking(False)
                client.sendall(head)
                yield conn


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


def _rates(**by: int) -> dict[str, Any]:
    """Connect rates with these bursts, refilling too slowly to matter in a test."""
    from duplex_actors.server.guard import ConnectRate

    return {name: ConnectRate(0.001, burst) for name, burst in by.items()}


async def _answers(front: FrontDoor, heads: list[bytes]) -> list[int | None]:
    """The status the front's connect rates give each head in turn (None: let through)."""
    answers: list[int | None] = []
    for head in heads:
        refusal = front._rate_refusal(await _request(front, head))
        answers.append(None if refusal is None else int(refusal.split(b" ")[1]))
    return answers


async def test_the_front_counts_new_connections_of_an_address_and_of_a_key_as_a_worker_does():
    # serve --workers: each worker kept its own buckets, so a client got N times its rate.
    # The front counts every realtime request (a resume too), and nothing else; with keys, a
    # request that presents none is the worker's to refuse (401) and costs no token, and a key
    # is one subject from any address.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        front = FrontDoor([], listener, connect_rates=_rates(address=3))
        line = b"GET /v1/realtime HTTP/1.1\r\n\r\n"
        resume = b"GET /v1/realtime?session_id=sess_w1g0_ab HTTP/1.1\r\n\r\n"
        health = b"GET /health HTTP/1.1\r\n\r\n"
        assert await _answers(front, [line, health, resume, health, line, line, resume]) == [
            None, None, None, None, None, 429, 429,
        ]  # fmt: skip
        refusal = front._rate_refusal(await _request(front, line))
        assert refusal is not None and b"Retry-After: " in refusal
        assert b"too many new connections for this address" in refusal
        assert front.refusals == {"connect_rate_address": 3}

        keyed = FrontDoor([], listener, connect_rates=_rates(address=3, key=2), keys=("sk-a",))
        with_key = b"GET /v1/realtime HTTP/1.1\r\nAuthorization: Bearer sk-a\r\n\r\n"
        wrong_key = b"GET /v1/realtime HTTP/1.1\r\nAuthorization: Bearer sk-b\r\n\r\n"
        assert await _answers(keyed, [wrong_key, with_key, wrong_key, with_key, with_key]) == [
            None, None, None, None, 429,
        ]  # fmt: skip


async def _request(front: FrontDoor, head: bytes) -> Any:
    """``head`` as ``front`` reads it from a connection."""
    with _sent(head) as conn:
        return await front._read(asyncio.get_running_loop(), conn, head.split(b"\r\n", 1)[0])


@pytest.mark.parametrize(
    ("trusted", "forwarded", "client"),
    [
        (True, b"203.0.113.7", "203.0.113.7"),
        # What a client writes itself lies left of the entry its proxy appends: never read.
        (True, b"198.51.100.9, 203.0.113.7", "203.0.113.7"),
        (True, b"2001:db8::1", "2001:db8::/64"),  # counted by its /64, as a worker counts it
        (False, b"203.0.113.7", "127.0.0.1"),  # from a peer not trusted: the header is a lie
    ],
)
async def test_a_trusted_proxys_client_is_read_from_its_head_and_counted_as_itself(
    trusted, forwarded, client
):
    # The front counted a trusted proxy's requests as the proxy's, so it left its clients to
    # each worker: one client behind the proxy held N times its quota and its rate.
    from duplex_actors.server.guard import exempt_from

    head = b"GET /v1/realtime HTTP/1.1\r\nX-Forwarded-For: " + forwarded + b"\r\n\r\n"
    with socket.create_server(("127.0.0.1", 0)) as listener:
        front = FrontDoor(
            [],
            listener,
            session_quota=SessionQuota(2, lambda _: False),
            connect_rates=_rates(address=1),
            trusted=exempt_from(("127.0.0.1/32",)) if trusted else exempt_from(("10.0.0.0/8",)),
        )
        request = await _request(front, head)
        assert request.client == client
        assert front._new_session_counts(request) == [(client, 2, "address")]
        assert front._rate_refusal(request) is None
        assert front._rate_refusal(await _request(front, head)) is not None  # its burst of 1 spent


@pytest.mark.parametrize(
    ("front_settings", "waits_for_the_head"),
    [
        ({}, False),  # nothing to count: the request line is enough
        ({"session_quota": SessionQuota(2, lambda _: False)}, False),  # the peer is the client
        ({"connect_rates": _rates(address=2)}, False),
        ({"connect_rates": _rates(address=2), "keys": ("k",)}, True),  # 401 before a count
        ({"session_quota": SessionQuota(None, lambda _: False, per_key=2), "keys": ("k",)}, True),
        ({"session_quota": SessionQuota(2, lambda _: False), "trusted": lambda _: True}, True),
    ],
)
async def test_the_front_reads_a_head_only_when_a_count_needs_it(front_settings, waits_for_the_head):
    # One more peek per connection, and a client slow with its head holds it longer: only
    # when the key, or the client behind a trusted proxy, decides a count.
    line = b"GET /v1/realtime HTTP/1.1"
    with socket.create_server(("127.0.0.1", 0)) as listener:
        front = FrontDoor([], listener, **front_settings)
        with _sent(line + b"\r\nHost: x\r\n") as conn:  # no blank line yet
            reading = asyncio.create_task(front._read(asyncio.get_running_loop(), conn, line))
            await asyncio.sleep(0.2)
            assert reading.done() is not waits_for_the_head
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading


def test_a_worker_behind_the_front_counts_no_connect_rate_unless_under_tls():
    # The front counts them over every worker; a worker counting them too would charge each
    # connection twice. Under TLS the front reads nothing, so each worker keeps its own.
    from duplex_actors.server.workers import WorkerSettings

    rates = {"connect_rate_per_address": 5.0, "connect_rate_per_key": 2.0, "write_timeout_s": 3.0}
    plain = WorkerSettings(server_options=rates).worker_options
    assert plain == {"connect_rate_per_address": None, "connect_rate_per_key": None, "write_timeout_s": 3.0}
    tls = {**rates, "tls_cert": "c.pem", "tls_key": "k.pem"}
    assert WorkerSettings(server_options=tls).worker_options == tls
