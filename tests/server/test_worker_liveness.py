"""A hung worker of ``serve --workers``: the front's pings (worker_liveness.py), how routing
passes over a silent worker, and the connections a worker never read, handed to another.

The same over real processes (a worker stopped with SIGSTOP by its pid) is in
test_workers.py."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from duplex_actors.server.front_door import PING_PASS_S, FrontDoor, _Worker
from duplex_actors.server.worker_link import FrontLink, unpack
from duplex_actors.server.worker_liveness import PING_INTERVAL_S, Liveness

from .conftest import server_frames

# --------------------------------------------------------------------------- the ledger

_steps = st.lists(
    st.one_of(
        st.tuples(st.just("wait"), st.floats(min_value=0.0, max_value=5.0)),
        st.tuples(st.just("ping"), st.none()),
        # the outstanding ping's answer, an older one, or something that is no number
        st.tuples(st.just("answer"), st.sampled_from(["current", "stale", "text", "ahead"])),
        # the front itself was away that long
        st.tuples(st.just("away"), st.floats(min_value=0.0, max_value=30.0)),
    ),
    max_size=60,
)


@given(_steps, st.sampled_from([None, 3.0, 10.0]))
def test_liveness_reads_silence_from_the_one_unanswered_ping(steps, hung_after_s):
    """At most one ping is outstanding; silence is how long it has waited while the front ran,
    and only its own number ends it; unresponsive and hung follow the silence and their
    thresholds (never hung without one)."""
    now = 100.0
    live = Liveness(now, unresponsive_after_s=2.0, hung_after_s=hung_after_s)
    sent_at = None  # the model: when the outstanding ping went out
    for kind, arg in steps:
        if kind == "wait":
            now += arg
        elif kind == "away":  # time passes that the front did not see: nobody's silence
            now += arg
            last_answer = live.last_answer
            live.forgive(arg)
            assert live.last_answer == pytest.approx(last_answer + arg)
            if sent_at is not None:
                sent_at += arg
        elif kind == "ping":
            if sent_at is None:
                assert live.ping(now) == live.sent
                sent_at = now
            else:
                with pytest.raises(RuntimeError):
                    live.ping(now)
        else:
            number = {
                "current": live.sent,
                "stale": live.sent - 1,
                "text": str(live.sent),
                "ahead": live.sent + 1,
            }[arg]
            took = live.answered(number, now)
            assert took == (arg == "current" and sent_at is not None)
            if took:
                sent_at = None
                assert live.last_answer == now
        silence = 0.0 if sent_at is None else now - sent_at
        assert live.silence(now) == pytest.approx(silence)
        assert live.responsive(now) == (silence < 2.0)
        assert live.hung(now) == (hung_after_s is not None and silence >= hung_after_s)
        assert live.ping_due(now) == (sent_at is None and now - live.last_answer >= PING_INTERVAL_S)


def test_liveness_refuses_thresholds_that_cannot_work():
    with pytest.raises(ValueError):
        Liveness(0.0, unresponsive_after_s=0)
    with pytest.raises(ValueError):
        Liveness(0.0, hung_after_s=0)


# --------------------------------------------------------------------------- routing


def _silent(worker: _Worker, since: float = 0.0) -> None:
    worker.liveness = Liveness(since)
    worker.liveness.ping(since)


def test_new_connections_pass_over_a_silent_worker_but_its_resumes_still_reach_it():
    workers = [_Worker(i, None) for i in range(3)]
    for worker in workers:
        worker.liveness = Liveness(0.0)
    front = FrontDoor(workers, listener=None)
    _silent(workers[1], since=0.0)
    now = 1.0  # silent for 1 s: still used
    assert [front.choose(b"GET /v1/realtime HTTP/1.1", now).index for _ in range(3)] == [0, 1, 2]
    now = 2.5  # past UNRESPONSIVE_AFTER_S
    assert [front.choose(b"GET /v1/realtime HTTP/1.1", now).index for _ in range(4)] == [0, 2, 0, 2]
    # Only it holds its sessions: a resume waits on it rather than being refused as lost.
    resume = b"GET /v1/realtime?session_id=sess_w1g0_ab12 HTTP/1.1"
    assert front.choose(resume, now).index == 1
    # It answers: used again.
    assert workers[1].liveness.answered(1, now)
    assert {front.choose(b"GET /health HTTP/1.1", now).index for _ in range(3)} == {0, 1, 2}
    # All silent: waiting on one beats refusing everyone.
    for worker in workers:
        _silent(worker, since=now)
    assert front.choose(b"GET /v1/realtime HTTP/1.1", now + 5).index in (0, 1, 2)


def test_a_draining_worker_gets_no_new_connections_but_its_resumes_and_as_a_last_resort():
    """A worker drains when its own pid gets SIGTERM (a recycle): it refuses new sessions, so
    they go to the others. Its sessions' resumes still reach it; with every worker draining,
    one of them answers (its 503 says why)."""
    workers = [_Worker(i, None) for i in range(3)]
    for worker in workers:
        worker.liveness = Liveness(0.0)
    front = FrontDoor(workers, listener=None)
    workers[1].draining = True
    assert [front.choose(b"GET /v1/realtime HTTP/1.1", 0.5).index for _ in range(4)] == [0, 2, 0, 2]
    assert front.choose(b"GET /v1/realtime?session_id=sess_w1g0_ab12 HTTP/1.1", 0.5).index == 1
    workers[0].draining = workers[2].draining = True
    assert front.choose(b"GET /v1/realtime HTTP/1.1", 0.5).draining


def test_a_worker_that_drained_when_told_to_starts_again_at_once_and_a_crash_backs_off():
    from types import SimpleNamespace

    from duplex_actors.server.supervisors import RESTART_BACKOFF_MIN_S, _WorkerSupervisor

    supervisor = _WorkerSupervisor.__new__(_WorkerSupervisor)  # backoff reads only the worker
    worker = _Worker(0, SimpleNamespace(exitcode=0), started_at=time.monotonic())
    worker.draining = True
    assert supervisor.backoff(worker) == 0.0 and worker.quick_deaths == 0
    worker.draining = False  # the same young exit, unasked: a crash loop is slowed down
    assert supervisor.backoff(worker) == RESTART_BACKOFF_MIN_S and worker.quick_deaths == 1


# --------------------------------------------------------------------------- over sockets


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setblocking(False)
    b.setblocking(False)
    return a, b


def _passes(front: FrontDoor, start: float, end: float) -> list[tuple[float, list[_Worker]]]:
    """The pinger's passes from ``start`` to ``end``, on time (every PING_PASS_S)."""
    out = []
    t = start
    while t <= end:
        out.append((t, front.ping(t)))
        t += PING_PASS_S
    return out


def test_a_ping_goes_out_over_the_hand_off_socket_and_the_workers_answer_ends_the_silence():
    async def main() -> None:
        front_end, worker_end = _pair()
        worker = _Worker(0, None, handoff=front_end)
        worker.liveness = Liveness(0.0, hung_after_s=3.0)
        clock = [0.0]
        front = FrontDoor([worker], listener=None, clock=lambda: clock[0])
        assert _passes(front, 0.0, PING_INTERVAL_S - PING_PASS_S)[-1][1] == []
        with pytest.raises(BlockingIOError):  # nothing due yet: its start counts as an answer
            worker_end.recv(4096)
        assert front.ping(PING_INTERVAL_S) == []
        kind, number = unpack(worker_end.recv(4096))
        assert (kind, number) == ("p", 1)
        assert front.ping(PING_INTERVAL_S + PING_PASS_S) == []  # one outstanding: no second
        with pytest.raises(BlockingIOError):
            worker_end.recv(4096)
        FrontLink(worker_end).answer_ping(number)  # what the worker's loop sends back
        clock[0] = answered = PING_INTERVAL_S + PING_PASS_S
        assert front._read_reports(worker)
        assert worker.liveness.outstanding_since is None
        # Next ping one interval after the answer; then no answer: hung once that ping is
        # hung_after_s old, and only then.
        passes = _passes(front, answered + PING_PASS_S, answered + PING_INTERVAL_S + 3.0)
        assert unpack(worker_end.recv(4096)) == ["p", 2]
        assert [hung for _, hung in passes[:-1]] == [[]] * (len(passes) - 1)
        assert passes[-1][1] == [worker]
        worker_end.close()
        front_end.close()

    asyncio.run(main())


def test_the_workers_draining_report_reaches_the_front():
    front_end, worker_end = _pair()
    worker = _Worker(0, None, handoff=front_end)
    front = FrontDoor([worker], listener=None)
    FrontLink(worker_end).draining()  # what a worker sends as its SIGTERM drain begins
    assert front._read_reports(worker) and worker.draining
    worker_end.close()
    front_end.close()


def test_time_the_front_itself_did_not_run_is_not_a_workers_silence():
    """The whole machine stopped for 30 s (a suspended VM): the front wakes up with its ping
    30 s unanswered. That is not the worker's doing: it is not stopped, and silence counts
    again from the front's return."""
    front_end, worker_end = _pair()
    worker = _Worker(0, None, handoff=front_end)
    worker.liveness = Liveness(0.0, hung_after_s=3.0)
    front = FrontDoor([worker], listener=None, clock=lambda: 0.0)
    _passes(front, 0.0, PING_INTERVAL_S)
    assert unpack(worker_end.recv(4096)) == ["p", 1]
    assert front.ping(PING_INTERVAL_S + 30.0) == []  # back after 30 s
    assert worker.liveness.responsive(PING_INTERVAL_S + 30.0)
    # Still no answer, the front running all along: stopped 3 s after its return (less the
    # one pass the front was due to wait anyway).
    back = PING_INTERVAL_S + 30.0
    passes = _passes(front, back + PING_PASS_S, back + 4.0)
    first_hung = next(t for t, hung in passes if hung)
    assert first_hung == pytest.approx(back + 3.0 - PING_PASS_S)
    worker_end.close()
    front_end.close()


def test_a_connection_its_dead_worker_never_read_goes_to_another_and_one_it_read_is_ended():
    """What worker_exited does with a lost worker's connections that carry no session: one
    whose request is still unread is handed to a living worker, bytes and all (the client never
    knows); one the worker had started reading gets the close frame, as before."""

    async def main() -> None:
        dead_front, dead_end = _pair()
        live_front, live_end = _pair()
        dead = _Worker(0, None, handoff=dead_front)
        live = _Worker(1, None, handoff=live_front)
        front = FrontDoor([dead, live], listener=None)
        line = b"GET /v1/realtime HTTP/1.1"
        request = line + b"\r\nHost: x\r\n\r\n"
        unread_conn, unread_client = socket.socketpair()
        read_conn, read_client = socket.socketpair()
        front._next = 0  # both go to worker 0
        for conn, client in ((unread_conn, unread_client), (read_conn, read_client)):
            conn.setblocking(False)
            client.sendall(request)
            assert await front._hand_over(conn, line)
            front._next = 0
        # Worker 0 reads the second connection's request (as a worker does, from its start),
        # then dies before reporting a session on either.
        for k in range(2):
            message, fds, _flags, _addr = socket.recv_fds(dead_end, 4096, 1)
            got = socket.socket(fileno=fds[0])
            assert unpack(message) == ["c", k + 1]  # handed in that order
            if k == 1:
                assert got.recv(4096) == request
            got.close()
        dead_end.close()
        assert front.worker_exited(dead, crashed=True) == 1
        assert front.rerouted == 1
        await asyncio.sleep(0.05)
        message, fds, _flags, _addr = socket.recv_fds(live_end, 4096, 1)
        handed = socket.socket(fileno=fds[0])
        assert unpack(message)[0] == "c"
        assert handed.recv(4096) == request  # whole, for the living worker to serve
        handed.sendall(b"HTTP/1.1 101 Switching Protocols\r\n\r\n")
        unread_client.settimeout(2)
        assert unread_client.recv(4096).startswith(b"HTTP/1.1 101")
        # The other one: the worker had read its request, so it cannot be started over. Its
        # client still waits for the handshake's answer: an HTTP 503 saying to try again
        # (websocket frames there read as a broken HTTP response).
        read_client.settimeout(2)
        assert read_client.recv(4096).startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert front.ledger.of_worker(0) == []
        for sock in (handed, unread_client, read_client, live_end, live_front):
            sock.close()

    asyncio.run(main())


def test_a_connection_waiting_on_a_full_hand_off_socket_goes_elsewhere_once_its_worker_is_stopped():
    """A hung worker stops reading its hand-off socket, which fills up; a connection the
    front is passing to it waits. Once the front gives up on the worker, it goes to another."""

    async def main() -> None:
        full_front, full_end = _pair()
        live_front, live_end = _pair()
        while True:  # fill the hung worker's socket
            try:
                full_front.send(b"x" * 512)
            except BlockingIOError:
                break
        hung = _Worker(0, None, handoff=full_front)
        live = _Worker(1, None, handoff=live_front)
        front = FrontDoor([hung, live], listener=None)
        conn, client = socket.socketpair()
        conn.setblocking(False)
        line = b"GET /v1/realtime HTTP/1.1"
        handing = asyncio.ensure_future(front._hand_over(conn, line))
        await asyncio.sleep(0.3)
        assert not handing.done()  # waiting for room
        hung.alive = False  # what stop_hung does
        assert await asyncio.wait_for(handing, 5)
        message, fds, _flags, _addr = socket.recv_fds(live_end, 4096, 1)
        assert unpack(message)[0] == "c" and len(fds) == 1
        assert front.ledger.of_worker(0) == [] and len(front.ledger.of_worker(1)) == 1
        for sock in (socket.socket(fileno=fds[0]), conn, client, full_front, full_end, live_front, live_end):
            sock.close()

    asyncio.run(main())


def _read_to_end(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_worker_that_dies_with_a_ping_unread_still_has_its_last_reports_in_the_farewell():
    """A process that dies with packets of ours unread (a ping, a hand-off) leaves the front a
    connection reset, which the kernel reports once, ahead of the reports the worker sent while
    alive. Those reports are still queued and must be read: they say which session the
    connection carries and which responses ended. Dropped with the reset, the client got no
    session.closed, and a second response.done for a response it had seen end (the wire soak
    that kills a worker saw both, about one run in ten)."""

    async def main() -> None:
        front_end, worker_end = _pair()
        worker = _Worker(0, None, handoff=front_end)
        worker.liveness = Liveness(0.0)
        front = FrontDoor([worker], listener=None, clock=lambda: 0.0)
        conn, client = socket.socketpair()
        conn.setblocking(False)
        line = b"GET /v1/realtime HTTP/1.1"
        client.sendall(line + b"\r\nHost: x\r\n\r\n")
        assert await front._hand_over(conn, line)
        message, fds, _flags, _addr = socket.recv_fds(worker_end, 4096, 1)
        with socket.socket(fileno=fds[0]) as handed:
            handed.recv(4096)  # the worker reads the request and serves a session on it
        link = FrontLink(worker_end)
        link.attached(unpack(message)[1], "sess_w0g0_a")
        link.response_started("sess_w0g0_a", "resp_1")
        link.response_ended("sess_w0g0_a", "resp_1")
        link.response_started("sess_w0g0_a", "resp_2")
        _passes(front, 0.0, PING_INTERVAL_S)  # a ping it will never read
        worker_end.close()
        assert front.worker_exited(worker, crashed=True) == 1
        client.settimeout(5)
        frames = server_frames(await asyncio.to_thread(_read_to_end, client))
        client.close()
        await front.settle(5)
        events = [json.loads(payload) for opcode, payload in frames if opcode == 0x1]
        assert [(e["type"], e.get("response", {}).get("id")) for e in events] == [
            ("response.done", "resp_2"),  # not resp_1: its end was reported
            ("session.closed", None),
        ]
        assert events[1]["reason"] == "worker_lost"
        assert frames[-1][0] == 0x8 and struct.unpack("!H", frames[-1][1][:2])[0] == 1011
        front_end.close()

    asyncio.run(main())


# --------------------------------------------------------------------------- the engine process


def test_the_engine_probe_finds_a_process_that_accepts_but_never_answers(tmp_path):
    """A hung engine process's socket still accepts (its backlog) and its hello never comes:
    each question fails on its connect timeout and is asked again, and the silence runs on
    from the first, until hung_after_s; then True once, and never again for that process. A
    new process starts a fresh record."""
    from duplex_actors.server.supervisors import _EngineProbe

    async def main() -> None:
        path = str(tmp_path / "engine.sock")
        server = await asyncio.start_unix_server(lambda r, w: None, path)  # accepts, says nothing
        clock = [0.0]
        probe = _EngineProbe(path, hung_after_s=3.0, clock=lambda: clock[0])
        process = object()
        found = []
        while clock[0] <= 6.0:
            found.append((clock[0], probe.hung(process)))
            await asyncio.sleep(0.05)  # the question's task runs (its connect times out later)
            clock[0] += PING_PASS_S
        # First ping at 1.0 s (its start counts as an answer), hung 3 s later, once.
        assert [t for t, hung in found if hung] == [4.0]
        assert probe.hung(object()) is False  # a new process: a fresh record
        assert probe.liveness is not None and probe.liveness.silence(clock[0]) == 0.0
        await probe.aclose()
        server.close()

    asyncio.run(main())


def test_the_engine_probe_leaves_an_engine_process_that_answers_alone(tmp_path):
    """The engine channel's stats request, answered by a real engine host's loop, keeps the
    silence short over 20 s of passes."""
    from duplex_actors.engines.engine_process import EngineHostServer
    from duplex_actors.engines.scripted import ScriptedEngine
    from duplex_actors.server.supervisors import _EngineProbe

    async def main() -> None:
        path = str(tmp_path / "engine.sock")
        async with EngineHostServer(ScriptedEngine(), path):
            clock = [0.0]
            probe = _EngineProbe(path, hung_after_s=3.0, clock=lambda: clock[0])
            process = object()
            answers = 0
            while clock[0] <= 20.0:
                assert probe.hung(process) is False
                for _ in range(20):  # let a question's round trip finish
                    await asyncio.sleep(0.005)
                    if probe._asking is None or probe._asking.done():
                        break
                if probe.liveness.outstanding_since is None and probe.liveness.sent > answers:
                    answers = probe.liveness.sent
                clock[0] += PING_PASS_S
            assert answers >= 15  # about one a second
            await probe.aclose()

    asyncio.run(main())


def test_the_engine_probe_does_not_count_time_the_front_was_away(tmp_path):
    from duplex_actors.server.supervisors import _EngineProbe

    async def main() -> None:
        path = str(tmp_path / "engine.sock")
        server = await asyncio.start_unix_server(lambda r, w: None, path)
        clock = [0.0]
        probe = _EngineProbe(path, hung_after_s=3.0, clock=lambda: clock[0])
        process = object()
        for t in (0.0, 0.5, 1.0, 1.5, 2.0):  # a question goes out at 1.0, unanswered
            clock[0] = t
            assert probe.hung(process) is False
            await asyncio.sleep(0.01)
        clock[0] = 32.0  # the front was away 29.5 s
        assert probe.hung(process) is False
        hung_at = None
        while hung_at is None:
            clock[0] += PING_PASS_S
            if probe.hung(process):
                hung_at = clock[0]
            await asyncio.sleep(0.01)
        assert hung_at == 32.0 + 3.0 - 1.0 - PING_PASS_S  # 1 s of silence before it left
        await probe.aclose()
        server.close()

    asyncio.run(main())


def test_shutting_down_waits_for_a_dead_workers_farewells_but_not_for_connections_being_routed():
    """settle: the front's last wait, for what a worker's death set off (its exit notice, which
    then starts the farewells); a connection still being routed (a client slow to send its
    request line) does not hold it, and the wait has a bound."""

    async def main() -> None:
        front = FrontDoor([], listener=None)
        loop = asyncio.get_running_loop()
        done = []

        async def farewell() -> None:
            await asyncio.sleep(0.1)
            done.append("farewell")

        async def exit_notice() -> None:
            await asyncio.sleep(0.1)
            front._spawn(farewell(), lasting=True)

        front._spawn(exit_notice(), lasting=True)
        front._spawn(asyncio.sleep(30))  # routing a slow client
        began = loop.time()
        await front.settle(5.0)
        assert done == ["farewell"] and loop.time() - began < 1.0
        front._spawn(asyncio.sleep(30), lasting=True)
        began = loop.time()
        await front.settle(0.2)
        assert 0.2 <= loop.time() - began < 1.0
        for task in front._tasks | front._lasting:
            task.cancel()

    asyncio.run(main())
