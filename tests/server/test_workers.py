"""``serve --workers 2`` end to end: real processes (front, two workers, one engine process),
real sockets, the project's own client.

One server is shared by the tests that leave it healthy; the tests that kill a worker or stop
the server start their own."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib.util
import json
import os
import pathlib
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

import anyio
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from duplex_actors.client import ClientConnectionError, DuplexClient, SessionLost
from duplex_actors.engines.engine_process import EngineProcessClient
from duplex_actors.server.front_door import REPORT_BATCH_S, FrontDoor, _Worker, owner_of, worker_session_id
from duplex_actors.server.worker_link import FrontLink

from .conftest import CHUNK_100MS, metric_sample

pytestmark = [pytest.mark.timeout(120)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Served:
    def __init__(self, process: subprocess.Popen, lines: list[str], errors=None) -> None:
        self.process = process
        self.lines = lines
        self._errors = errors
        self.url = lines[0].split()[2]
        self.http = self.url.replace("ws://", "http://").rsplit("/v1/realtime", 1)[0]
        self.worker_pids = [int(line.split()[2].split("=")[1]) for line in lines[1:-1]]
        self.worker_urls = [line.split()[3] for line in lines[1:-1]]
        self.engine_pid = int(lines[-1].split()[1].split("=")[1])
        self.engine_socket = lines[-1].split()[2].split("=", 1)[1]

    def stderr(self) -> str:
        """What the server's processes wrote to stderr so far."""
        self._errors.seek(0)
        return self._errors.read()


@contextlib.contextmanager
def serve_workers(workers: int = 2, *extra: str):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # stderr to a file: a pipe nobody reads would fill up with logs and stall the server
    with tempfile.TemporaryFile("w+") as errors:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "duplex_actors",
                "serve",
                "--engine",
                "scripted",
                "--workers",
                str(workers),
                "--port",
                "0",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=env,
            cwd=ROOT,
        )
        lines: queue.Queue = queue.Queue()
        threading.Thread(
            target=lambda: [lines.put(line.strip()) for line in process.stdout], daemon=True
        ).start()
        try:
            first: list[str] = []
            while len(first) < workers + 2:
                try:
                    first.append(lines.get(timeout=60))
                except queue.Empty:
                    errors.seek(0)
                    # the queue's timeout itself says nothing: the server's stderr does
                    raise AssertionError(  # noqa: B904
                        f"serve --workers did not start: {errors.read()[-3000:]}"
                    )
            yield Served(process, first, errors)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(5)


@pytest.fixture(scope="module")
def served():
    with serve_workers(2) as s:
        yield s


def run(fn, *args):
    return anyio.run(fn, *args, backend="asyncio")


async def open_on(url: str, worker: int, **options) -> tuple[DuplexClient, dict]:
    """A client whose session the front put on ``worker`` (new sessions alternate)."""
    for _ in range(8):
        client = await DuplexClient.connect(url, **options)
        created = await client.recv()
        if owner_of(created["session"]["id"]) == worker:
            return client, created
        await client.close()
    raise AssertionError(f"no session landed on worker {worker} in 8 tries")


async def _raw_session_on(url: str, worker: int):
    """A plain websocket whose session the front put on ``worker``, and the session's id."""
    for _ in range(8):
        ws = await connect(url)
        session_id = json.loads(await ws.recv())["session"]["id"]
        if owner_of(session_id) == worker:
            return ws, session_id
        await ws.close()
    raise AssertionError(f"no session landed on worker {worker} in 8 tries")


async def one_turn(client: DuplexClient, timeout: float = 20.0) -> list[dict]:
    await ask(client)
    done, events = await client.wait_for("response.done", timeout=timeout)
    assert done["response"]["status"] == "completed", done
    return events


async def ask(client: DuplexClient) -> None:
    """A GA client's manual turn: a commit only adds the audio, response.create asks."""
    await client.send_audio(CHUNK_100MS)
    await client.commit()
    await client.create_response()


async def turns_until_one_completes(client: DuplexClient, tries: int = 40) -> list[str]:
    """Ask for turns, half a second apart, until one completes (a new engine process is
    loading meanwhile): every turn's status."""
    statuses = []
    for _ in range(tries):
        await ask(client)
        done, _ = await client.wait_for("response.done", timeout=30)
        statuses.append(done["response"]["status"])
        if statuses[-1] == "completed":
            break
        await anyio.sleep(0.5)
    return statuses


async def resume_of_lost(url: str, session_id: str, **options) -> tuple[dict, int | None]:
    """Resume ``session_id`` (with any token: a lost session has none to check): the server's
    answer and the close code that followed it."""
    async with connect(f"{url}?session_id={session_id}", **options) as ws:
        await ws.send(
            json.dumps(
                {
                    "type": "session.resume",
                    "session_id": session_id,
                    "generation": 0,
                    "resume_token": "t",
                    "last_seq": 1,
                }
            )
        )
        answer = json.loads(await ws.recv())
        with contextlib.suppress(Exception):
            await ws.recv()
    return answer, ws.close_code


# --------------------------------------------------------------------------- routing, no processes


def test_the_front_sends_a_resume_to_its_owner_and_new_sessions_round_robin():
    front = FrontDoor([_Worker(0, None), _Worker(1, None), _Worker(2, None)], listener=None)
    new = [front.choose(b"GET /v1/realtime HTTP/1.1").index for _ in range(6)]
    assert new == [0, 1, 2, 0, 1, 2]
    sid = worker_session_id(2)
    assert owner_of(sid) == 2 and owner_of("sess_0123abcd") is None
    for _ in range(3):
        assert front.choose(f"GET /v1/realtime?model=x&session_id={sid} HTTP/1.1".encode()).index == 2
    # Its owner gone (or started again: a new generation), a resume goes to a living worker,
    # which refuses it at once as lost (4404, session_lost).
    front.workers[2].alive = False
    assert front.choose(f"GET /v1/realtime?session_id={sid} HTTP/1.1".encode()).index in (0, 1)
    front.workers[2].alive = True
    front.workers[2].generation = 1
    assert front.choose(f"GET /v1/realtime?session_id={sid} HTTP/1.1".encode()).index in (0, 1)
    assert front.choose(f"GET /v1/realtime?session_id={worker_session_id(2, 1)} HTTP/1.1".encode()).index == 2
    assert {front.choose(b"GET /health HTTP/1.1").index for _ in range(6)} == {0, 1, 2}
    # An id no worker minted goes to any worker, which answers 4404 the usual way.
    assert front.choose(b"GET /v1/realtime?session_id=sess_w9g0_ab HTTP/1.1").index in (0, 1, 2)
    for worker in front.workers:
        worker.alive = False
    assert front.choose(b"GET /v1/realtime HTTP/1.1") is None


def test_the_front_reads_reports_in_batches_and_all_of_a_dead_workers_first():
    """A worker's reports wait in the hand-off socket for one read per REPORT_BATCH_S (one
    wake-up of the front per report cost it ~0.1 ms a turn); a worker that dies before the
    read is due still has every report applied before its clients get their farewells."""

    async def main() -> None:
        front_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        front_end.setblocking(False)
        worker_end.setblocking(False)
        worker = _Worker(0, None, handoff=front_end)
        front = FrontDoor([worker], listener=None)
        front.listen_to(worker)
        link = FrontLink(worker_end)
        held, client = socket.socketpair()
        held.setblocking(False)
        handed = front.ledger.handed(0)
        front._held[handed] = held
        sid = "sess_w0g0_ab12"
        link.attached(handed, sid)
        link.response_started(sid, "resp_1")
        await asyncio.sleep(REPORT_BATCH_S / 5)
        assert front.ledger._responses == {}  # not read yet
        await asyncio.sleep(REPORT_BATCH_S + 0.1)
        assert front.ledger._responses == {sid: ["resp_1"]}
        link.response_started(sid, "resp_2")
        link.response_ended(sid, "resp_1")
        assert front.worker_exited(worker, crashed=True) == 1
        client.settimeout(2)
        received = b""
        while b"worker lost" not in received:
            received += await asyncio.to_thread(client.recv, 65536)
        client.close()
        assert b'"resp_2"' in received and b'"resp_1"' not in received
        assert b'"session.closed"' in received
        worker_end.close()

    asyncio.run(main())


# --------------------------------------------------------------------------- a live server


@pytest.mark.slow
def test_new_sessions_land_on_both_workers_and_each_completes_a_turn(served):
    async def main():
        clients = [await DuplexClient.connect(served.url) for _ in range(4)]
        owners = []
        try:
            created = [await c.recv() for c in clients]
            owners = [owner_of(e["session"]["id"]) for e in created]
            async with anyio.create_task_group() as tg:
                for c in clients:
                    tg.start_soon(one_turn, c)
        finally:
            for c in clients:
                await c.close()
        return owners

    owners = run(main)
    assert sorted(owners) == [0, 0, 1, 1]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(300, 304))
def test_a_random_walk_through_the_front_keeps_every_promise(served, seed):
    """tests/server/test_wire_walk.py's client, through the front to a worker: its drops and
    resumes (answers lost too) reach the session's owner, whichever connection they come on."""
    from .test_wire_walk import assert_kept_its_promises, walk_speech, walk_to

    assert_kept_its_promises(asyncio.run(walk_to(served.url, seed, 200, walk_speech())), seed)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed", [5, 21])
def test_random_walks_keep_every_promise_while_a_worker_is_killed_by_its_pid(seed):
    """Six walks through the front, one worker SIGKILLed while they run, then two more walks on
    the worker started again. A lost session ends properly: one failed response.done
    (worker_lost) per response it had running, then session.closed, or, for a resume the
    dead worker never answered, session_lost; nothing after. Every other walk keeps every
    promise of tests/server/test_wire_walk.py.

    Explored first with 20 rounds (scratch): in one, a client that had dropped its connection
    and resumed on a new one got session.closed with its response never ended, because the
    worker had not yet released the old connection, and the old one took the session's open
    responses (the front's ledger; tests/server/test_front_ledger.py holds the case alone)."""
    from .test_wire_walk import WalkedStream, Walker, walk_speech

    class LossAwareStream(WalkedStream):
        def __init__(self) -> None:
            super().__init__()
            self.lost = False

        def take(self, event: dict) -> None:
            kind = event["type"]
            if self.lost:
                self.problems.append(f"{kind} after the session was lost")
            elif kind == "response.done" and event["server_event_seq"] is None:
                error = event["response"]["status_details"]["error"]["code"]
                rid = event["response"]["id"]
                # A response the client never saw start may be ended too: the worker tells
                # the front of a response.created just before writing it, and may be killed
                # between the two (docs/protocol.md). One it saw end may not.
                if error != "worker_lost" or rid in self.ended:
                    self.problems.append(f"front's response.done for {rid} ({error}), not running")
                self.open.discard(rid)
                self.ended.add(rid)
            elif kind == "session.closed" and event.get("reason") == "worker_lost":
                if self.open:
                    self.problems.append(f"session lost with responses never ended: {sorted(self.open)}")
                self.lost = True
            elif kind == "error" and event["error"].get("code") == "session_lost":
                self.lost = True
            else:
                super().take(event)

    class LossAwareWalker(Walker):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.stream = LossAwareStream()

        async def _until(self, done, what: str, timeout: float = 30.0) -> None:
            await super()._until(lambda: done() or self.stream.lost, what, timeout)

    async def one(url: str, walk_seed: int, speech: bytes, after_s: float):
        await asyncio.sleep(after_s)
        walker = LossAwareWalker(url, walk_seed, speech)
        await walker.open()
        session_id = walker.stream.session_id
        for _ in range(300):
            if walker.stream.lost or walker.stream.problems:
                break
            try:
                await walker.step()
            except ConnectionClosed:
                await asyncio.sleep(1.0)  # the farewell is read by then
                if not walker.stream.lost:
                    walker.stream.problems.append("the connection closed, not as a lost session")
                break
            await asyncio.sleep(0)
        if not walker.stream.lost and not walker.stream.problems:
            await walker.settle()
        with contextlib.suppress(ConnectionClosed):
            await walker.close()
        return owner_of(session_id), walker.stream

    async def main(url: str, victim: int, speech: bytes):
        async def kill() -> None:
            await asyncio.sleep(1.0 + seed % 3 * 0.5)
            os.kill(victim, signal.SIGKILL)

        walks = [one(url, seed * 100 + i, speech, 0.0) for i in range(6)]
        walks += [one(url, seed * 100 + 50 + i, speech, 8.0) for i in range(2)]  # on the new worker
        results, _ = await asyncio.gather(asyncio.gather(*walks), kill())
        return results

    with serve_workers(2) as s:
        results = asyncio.run(main(s.url, s.worker_pids[1], walk_speech()))
    problems = [(owner, stream.problems) for owner, stream in results if stream.problems]
    assert not problems, problems
    owners = [owner for owner, _ in results]
    assert owners.count(1) >= 2, owners  # the dead worker held some of the walks
    assert any(stream.lost for _, stream in results), "the kill cost no walk its session"
    assert all(not stream.lost for owner, stream in results if owner == 0)


def test_health_through_the_front_answers(served):
    with urllib.request.urlopen(served.http + "/health", timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "ok"


def test_binary_audio_at_16_khz_through_the_front_and_across_a_resume(served):
    """The duplex-native client's wire (binary frames, 16 kHz input) reaches a worker through
    the front, and still holds after a drop and a resume on the session's owner."""

    async def main():
        client, _ = await open_on(served.url, 1, reconnect_backoff_s=0.1)
        try:
            native = {"input": {"format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": None}}
            await client.update_session({"audio": native, "duplex": {"binary_audio": True}})
            await client.wait_for("session.updated", timeout=10)
            assert client.binary_audio
            await client.send_audio(CHUNK_100MS)  # 150 ms at 16 kHz
            await client.heartbeat()  # its ack: the worker has read the audio
            await client.wait_for("heartbeat.ack", timeout=10)
            client.abort_transport()
            await client.wait_for("session.resumed", timeout=20)
            assert client.binary_audio
            assert await client.send_audio(CHUNK_100MS) is None  # still a binary frame
            await client.commit()
            committed, before = await client.wait_for("input_audio_buffer.committed", timeout=10)
            assert not [e for e in before if e["type"] == "error"], before
            return committed["audio_ms"], client.reconnects
        finally:
            await client.close()

    assert run(main) == (300, 1)


def test_a_model_native_client_streaming_in_real_time_gets_its_units_decided_on_a_worker(served):
    """A worker runs its loop under plain asyncio, and handles a real-time client's appends as
    websockets parses them, in the connection's callbacks. The append that completes a unit
    starts its engine request there; it failed with NoEventLoopError (an internal error for the
    frame, the unit never decided) until the runtime named the async library."""

    async def main():
        ws, _ = await _raw_session_on(served.url, 0)
        try:
            native = {"format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": None}
            update = {"audio": {"input": native}, "duplex": {"model_native": True}}
            await ws.send(json.dumps({"type": "session.update", "session": update}))
            while json.loads(await ws.recv())["type"] != "session.updated":
                pass
            chunk = base64.b64encode(b"\x01\x00" * 320).decode()  # 20 ms; a unit is 1 s
            start = time.monotonic()
            for k in range(60):
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
                await asyncio.sleep(max(0.0, start + (k + 1) * 0.02 - time.monotonic()))
            seen = []
            with anyio.fail_after(20):
                while not seen or seen[-1]["type"] not in ("response.done", "error"):
                    seen.append(json.loads(await ws.recv()))
            return [e["type"] for e in seen], [e for e in seen if e["type"] == "error"]
        finally:
            await ws.close()

    types, errors = run(main)
    assert errors == [], errors
    assert "response.created" in types, types  # the scripted engine speaks on its first unit


@pytest.mark.parametrize("worker", [0, 1])
def test_a_dropped_session_resumes_on_its_owner_and_misses_nothing(served, worker):
    async def main():
        client, created = await open_on(served.url, worker, reconnect_backoff_s=0.1)
        events = [created]
        try:
            await ask(client)
            for _ in range(200):
                events.append(await client.recv(timeout=10))
                # an audio response's words arrive only as its transcript
                if events[-1]["type"] == "response.output_audio_transcript.delta":
                    break
            client.abort_transport()  # no close frame: the worker detaches the session
            async for event in client.events():
                events.append(event)
                if event["type"] == "response.done":
                    break
            await client.heartbeat()  # the resumed session still takes commands
            ack, before_ack = await client.wait_for("heartbeat.ack", timeout=10)
            events.extend([*before_ack, ack])
        finally:
            await client.close()
        return client, events

    client, events = run(main)
    types = [e["type"] for e in events]
    # rate_limits.updated is derived from response.done (the codec gives it no seq of its own)
    seqs = [e["server_event_seq"] for e in events if e["type"] != "rate_limits.updated"]
    assert seqs == list(range(1, len(seqs) + 1)), "every event exactly once, in order"
    assert types[types.index("response.done") + 1] == "rate_limits.updated"
    assert client.reconnects == 1 and client.gaps == 0 and client.duplicates_dropped == 0
    assert types.count("session.resumed") == 1 and types.count("response.done") == 1
    assert events[-1]["type"] == "heartbeat.ack"
    done = next(e for e in events if e["type"] == "response.done")
    assert done["response"]["status"] == "completed"
    assert owner_of(client.session_id) == worker


def test_closing_a_session_on_one_worker_leaves_the_other_workers_session_alone(served):
    async def main():
        a, _ = await open_on(served.url, 0)
        b, _ = await open_on(served.url, 1)
        try:
            await ask(b)
            await b.wait_for("response.created", timeout=10)
            await a.send({"type": "session.close"})
            closed, _ = await a.wait_for("session.closed", timeout=10)
            done, b_events = await b.wait_for("response.done", timeout=20)
            await b.heartbeat()
            await b.wait_for("heartbeat.ack", timeout=10)
            second = await one_turn(b)  # and b keeps working after a is gone
        finally:
            await a.close()
            await b.close()
        return closed, done, b_events + second

    closed, done, b_events = run(main)
    assert closed["reason"] == "client_closed"
    assert done["response"]["status"] == "completed"
    assert not [e for e in b_events if e["type"] == "error"]


def test_one_engine_process_has_both_workers_turns_in_flight_at_once(served):
    async def main():
        a, _ = await open_on(served.url, 0)
        b, _ = await open_on(served.url, 1)
        probe = EngineProcessClient(served.engine_socket)
        try:
            before = await probe.remote_statistics()
            async with anyio.create_task_group() as tg:
                tg.start_soon(one_turn, a)
                tg.start_soon(one_turn, b)
            after = await probe.remote_statistics()
        finally:
            await probe.aclose()
            await a.close()
            await b.close()
        return before, after

    before, after = run(main)
    assert after["pid"] == served.engine_pid
    # The two workers and this probe, and the front's liveness probe once it has asked (its
    # first question goes a second after the engine process started).
    assert after["connections"] in (3, 4)
    assert after["streams_total"] - before["streams_total"] == 2
    assert after["max_runtimes_in_flight"] == 2


def _descendants(pid: int) -> set[int]:
    """The processes under ``pid`` now (Linux: read from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")"
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
def test_a_worker_transcribes_input_as_single_process_serve_does_and_stops_its_recogniser():
    pytest.importorskip("pocketsphinx")  # without the extra both servers answer .failed
    # Its own server: what is checked is what is left once it has stopped. A worker process
    # ends with os._exit, which runs no exit hook: its recogniser's worker process (~150 MB)
    # outlived it, one per test run, until the worker stopped it itself.
    with serve_workers(2) as served:  # (--workers 1 is single-process serve)
        result = run(_transcribed_turn, served.url)
        running = _descendants(served.process.pid)
    assert result["type"] == "conversation.item.input_audio_transcription.completed", result
    assert len(running) >= 3  # the engine process, the worker and its recogniser at least
    deadline = time.monotonic() + 10  # processes still exiting get a moment
    while (left := _alive(running)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, left


def _alive(pids: set[int]) -> dict[int, bytes]:
    """Those of ``pids`` still running (not exited, nor exited and waiting to be reaped), with
    their command lines."""
    alive = {}
    for pid in pids:
        try:
            state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state not in ("Z", "X"):
                alive[pid] = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
    return alive


async def _transcribed_turn(url: str) -> dict:
    """One committed turn with input transcription on: its completed (or failed) event."""
    client = await DuplexClient.connect(url)
    try:
        await client.recv()
        await client.update_session(
            {
                "type": "realtime",
                "audio": {"input": {"transcription": {"model": "whisper-1"}, "turn_detection": None}},
            }
        )
        await client.wait_for("session.updated", timeout=10)
        await client.send_audio(CHUNK_100MS)
        await client.commit()
        for _ in range(100):
            event = await client.recv(timeout=60)
            kind = event["type"]
            if kind.startswith("conversation.item.input_audio_transcription.") and not kind.endswith(
                ".delta"
            ):
                return event
    finally:
        await client.close()
    raise AssertionError("no transcription result")


# --------------------------------------------------------------------------- failure and shutdown


@pytest.mark.slow
@pytest.mark.parametrize("loop", [None, "asyncio"])
def test_kill_9_of_a_worker_ends_its_responses_for_their_clients_and_the_worker_comes_back(loop):
    # Once on serve's default loop (uvloop where installed), once on asyncio's own: the front's
    # fd passing, the sentinels and the farewells run on whichever the tree was started with.
    with serve_workers(2, *(("--loop", loop) if loop else ())) as s:
        runs_on = loop or ("uvloop" if importlib.util.find_spec("uvloop") else "asyncio")
        assert f"loop={runs_on})" in s.lines[0], s.lines[0]

        async def main():
            doomed = [await _raw_session_on(s.url, 1) for _ in range(3)]
            survivor, _ = await open_on(s.url, 0)
            for ws, _ in doomed:
                await ws.send(json.dumps({"type": "response.create"}))
                while json.loads(await ws.recv())["type"] != "response.created":
                    pass
            await ask(survivor)
            killed_at = time.monotonic()
            os.kill(s.worker_pids[1], signal.SIGKILL)
            ends = []
            for ws, session_id in doomed:
                events = []
                with anyio.fail_after(20), contextlib.suppress(ConnectionClosed):
                    async for frame in ws:
                        events.append(json.loads(frame))
                ends.append((session_id, events, ws.close_code, time.monotonic() - killed_at))
            # The survivor's turn, on the other worker, goes on as if nothing happened.
            done, _ = await survivor.wait_for("response.done", timeout=20)
            await survivor.close()
            # A resume of a lost session is refused at once, and says why.
            asked_at = time.monotonic()
            refused = (*await resume_of_lost(s.url, ends[0][0]), time.monotonic() - asked_at)
            # The worker is started again: new sessions reach its slot, under a new generation.
            owners = []
            for _ in range(40):
                client = await DuplexClient.connect(s.url)
                owners.append((await client.recv())["session"]["id"])
                await client.close()
                if any(sid.startswith("sess_w1g1_") for sid in owners):
                    break
                await anyio.sleep(0.25)
            return ends, done, refused, owners

        ends, done, refused, owners = run(main)
        for _sid, events, close_code, after in ends:
            kinds = [e["type"] for e in events]
            failed = [e for e in events if e["type"] == "response.done"]
            assert len(failed) == 1, kinds
            assert failed[0]["response"]["status"] == "failed", failed
            assert failed[0]["response"]["status_details"]["error"]["code"] == "worker_lost"
            assert kinds[-1] == "session.closed" and events[-1]["reason"] == "worker_lost", kinds
            assert close_code == 1011
            assert after < 10, after  # told at once, not after a timeout
        assert done["response"]["status"] == "completed"
        refusal, close_code, took = refused
        assert refusal["error"]["code"] == "session_lost" and close_code == 4404, refusal
        assert took < 5, took
        assert any(sid.startswith("sess_w1g1_") for sid in owners), owners
        with urllib.request.urlopen(s.http + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert 'duplex_worker_restarts{worker="1"} 1.0' in metrics
        assert "duplex_worker_lost_connections 3.0" in metrics

        async def shutdown():
            # A session is open: SIGTERM ends it as the single-process server does.
            client = await DuplexClient.connect(s.url, auto_reconnect=False)
            await client.recv()
            s.process.send_signal(signal.SIGTERM)
            try:
                closed, _ = await client.wait_for("session.closed", timeout=20)
                assert closed["reason"] == "runtime_shutdown"
            except SessionLost:
                pass  # the connection went away first (close code 1001)
            await client.close()

        run(shutdown)
        assert s.process.wait(30) == 0
        for pid in [s.engine_pid, *s.worker_pids]:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert not os.path.exists(s.engine_socket)


@pytest.mark.slow
def test_a_hung_worker_is_passed_over_then_stopped_and_started_again_and_no_client_waits_on_it():
    """Worker 1 stopped by its pid (SIGSTOP: alive, its loop frozen, its hand-off socket still
    taking sockets). New clients right after it: the front does not know yet, so some are
    handed to it; after --worker-timeout-s the front stops it, and those (never read) go to
    worker 0. Its own client is told, as after a crash, and the slot starts again."""
    with serve_workers(2, "--worker-timeout-s", "3") as s:

        async def main():
            held, _ = await _raw_session_on(s.url, 1)
            os.kill(s.worker_pids[1], signal.SIGSTOP)
            stopped_at = time.monotonic()

            async def newcomer(results: list) -> None:
                with anyio.fail_after(30):
                    for attempt in range(3):
                        try:
                            client = await DuplexClient.connect(s.url)
                            break
                        except ClientConnectionError as exc:
                            # The front stops the hung worker with SIGCONT and SIGABRT: in that
                            # moment it may read a request it then never answers, which the
                            # front answers 503 "try again" (front_ledger.py); a retry is served.
                            if exc.status != 503 or attempt == 2:
                                raise
                            await anyio.sleep(1.0)
                    created = await client.recv()
                    await one_turn(client)
                    await client.close()
                results.append((created["session"]["id"], time.monotonic() - stopped_at))

            served: list = []
            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(newcomer, served)
            # Its own client hears nothing until the front stops it, then its farewell.
            events = []
            with anyio.fail_after(20), contextlib.suppress(ConnectionClosed):
                async for frame in held:
                    events.append(json.loads(frame))
            told = time.monotonic() - stopped_at
            # Once the front has seen the silence, new sessions go straight to worker 0 (or to
            # the slot's new process), never to the stopped one.
            later = []
            for _ in range(4):
                with anyio.fail_after(10):
                    client = await DuplexClient.connect(s.url)
                    later.append((await client.recv())["session"]["id"])
                    await client.close()
            return served, events, held.close_code, told, later

        served, events, close_code, told, later = run(main)
        assert len(served) == 4
        assert all(sid.startswith(("sess_w0g0_", "sess_w1g1_")) for sid, _ in served), served
        # Some were handed to the stopped worker before the front knew: served after the stop.
        assert max(after for _, after in served) >= 2.5, served
        assert all(sid.startswith(("sess_w0g0_", "sess_w1g1_")) for sid in later), later
        assert [e["type"] for e in events] == ["session.closed"] and events[0]["reason"] == "worker_lost"
        assert close_code == 1011
        assert 2.5 <= told < 10, told
        errors = s.stderr()
        assert "worker 1 pid=" in errors and "answered nothing for" in errors, errors[-3000:]
        assert "Fatal Python error: Aborted" in errors  # where its threads were, from faulthandler
        with urllib.request.urlopen(s.http + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert 'duplex_worker_hangs{worker="1"} 1.0' in metrics, metrics
        rerouted = re.search(r"^duplex_worker_rerouted_connections (\d+)", metrics, re.M)
        assert rerouted is not None and int(rerouted.group(1)) >= 1, metrics
        with pytest.raises(ProcessLookupError):
            os.kill(s.worker_pids[1], 0)


@pytest.mark.slow
def test_a_sigterm_to_one_workers_pid_drains_it_while_new_clients_go_to_the_other():
    """A recycle of one worker (SIGTERM to its own pid, not the front's): its response in
    flight completes and its session closes as in any drain; the clients that come meanwhile
    all get a session elsewhere (before: every other one got HTTP 503 from the draining
    worker); it exits cleanly and its slot starts again at once, not after a crash's backoff."""
    with serve_workers(2, "--scripted-pace", "5") as s:

        async def main():
            client, _ = await open_on(s.url, 1)
            await ask(client)
            await client.wait_for("response.created", timeout=10)
            os.kill(s.worker_pids[1], signal.SIGTERM)
            await anyio.sleep(0.3)  # its report reaches the front (read every 50 ms)
            newcomers = []
            for _ in range(6):
                with anyio.fail_after(10):
                    async with connect(s.url) as ws:
                        newcomers.append(json.loads(await ws.recv()))
            done, _ = await client.wait_for("response.done", timeout=30)
            closed, _ = await client.wait_for("session.closed", timeout=10)
            return newcomers, done, closed

        newcomers, done, closed = run(main)
        assert [e["type"] for e in newcomers] == ["session.created"] * 6, newcomers
        assert not any(e["session"]["id"].startswith("sess_w1g0_") for e in newcomers), newcomers
        assert done["response"]["status"] == "completed"
        assert closed["reason"] == "runtime_shutdown"
        deadline = time.monotonic() + 15
        while "worker 1 restarted" not in s.stderr() and time.monotonic() < deadline:
            time.sleep(0.1)
        errors = s.stderr()
        assert "worker 1 drained and exited (SIGTERM to its pid)" in errors, errors[-3000:]
        assert "in_s=0.0" in errors and "worker 1 restarted" in errors, errors[-3000:]


@pytest.mark.slow
def test_a_drain_does_not_wait_out_a_hung_worker_and_its_clients_are_told():
    """SIGTERM while worker 1 is stopped (SIGSTOP): the other worker drains as usual, the
    stopped one is stopped as hung after --worker-timeout-s and its client gets its farewell,
    and the server exits then, not after the drain's whole limit (it took 40 s before)."""
    with serve_workers(2, "--worker-timeout-s", "2") as s:

        async def main():
            hung_ws, _ = await _raw_session_on(s.url, 1)
            healthy, _ = await open_on(s.url, 0)
            os.kill(s.worker_pids[1], signal.SIGSTOP)
            signalled_at = time.monotonic()
            s.process.send_signal(signal.SIGTERM)
            closed, _ = await healthy.wait_for("session.closed", timeout=20)
            events = []
            with anyio.fail_after(30), contextlib.suppress(ConnectionClosed):
                async for frame in hung_ws:
                    events.append(json.loads(frame))
            await healthy.close()
            return closed, events, hung_ws.close_code, signalled_at

        closed, events, close_code, signalled_at = run(main)
        assert s.process.wait(30) == 0
        took = time.monotonic() - signalled_at
        assert closed["reason"] == "runtime_shutdown"
        assert [e["type"] for e in events] == ["session.closed"] and events[0]["reason"] == "worker_lost"
        assert close_code == 1011
        assert took < 15, took
        assert "worker 1 pid=" in s.stderr() and "answered nothing" in s.stderr()


@pytest.mark.slow
def test_a_pause_of_the_whole_server_is_not_taken_for_hung_workers():
    """Every process of the server stopped for longer than --worker-timeout-s (what a
    suspended VM or a frozen cgroup does, here one by one), the front continued first: it
    wakes up with its pings long unanswered, yet that time was its own absence too. No worker
    is stopped, and the sessions on both go on."""
    with serve_workers(2, "--worker-timeout-s", "3") as s:

        async def main():
            clients = [(await open_on(s.url, worker))[0] for worker in (0, 1)]
            everyone = [s.engine_pid, *s.worker_pids]
            for pid in everyone:
                os.kill(pid, signal.SIGSTOP)
            # Long enough for the front to have sent each worker a ping they cannot answer
            # (one a second, on passes every half second), short of the timeout.
            await anyio.sleep(1.6)
            os.kill(s.process.pid, signal.SIGSTOP)
            await anyio.sleep(4)
            os.kill(s.process.pid, signal.SIGCONT)
            await anyio.sleep(0.3)  # the front runs alone for a moment
            for pid in everyone:
                os.kill(pid, signal.SIGCONT)
            await anyio.sleep(3)  # past the timeout again, all running
            for client in clients:
                await one_turn(client)
                await client.close()

        run(main)
        for pid in s.worker_pids:
            os.kill(pid, 0)  # still the same processes
        errors = s.stderr()
        assert "answered nothing" not in errors, errors[-3000:]
        assert "front.was_away" in errors


@pytest.mark.slow
def test_killing_the_front_lets_its_workers_finish_responses_in_flight_then_takes_every_process_with_it():
    # A response paced to take about 4 s is in flight on each worker when the front dies.
    with serve_workers(2, "--scripted-pace", "5") as s:

        async def main():
            clients = [await _raw_session_on(s.url, worker) for worker in (0, 1)]
            for ws, _ in clients:
                await ws.send(json.dumps({"type": "response.create"}))
                while json.loads(await ws.recv())["type"] != "response.created":
                    pass
            s.process.kill()  # SIGKILL: no shutdown code runs in the front
            ends = []
            for ws, _ in clients:
                terminals = []
                with anyio.fail_after(30), contextlib.suppress(ConnectionClosed):
                    async for frame in ws:
                        event = json.loads(frame)
                        if event["type"] in ("response.done", "session.closed", "error"):
                            terminals.append((event["type"], event.get("response", {}).get("status")))
                ends.append((terminals, ws.close_code))
            return ends

        # Its workers finish the responses for their clients, then close their sessions, as
        # in a drain. Before, a worker that saw its front's end close before the kernel's
        # SIGTERM came ended them at once, cancelled.
        for terminals, close_code in run(main):
            assert terminals == [("response.done", "completed"), ("session.closed", None)], terminals
            assert close_code == 1001
        s.process.wait(10)
        deadline = time.monotonic() + 20
        alive = [s.engine_pid, *s.worker_pids]
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [pid for pid in alive if _running(pid)]
        assert alive == [], "children outlived the front"
        # They removed their sockets, and the last one out the folder the front would have
        # removed (before, one empty folder was left in the temporary directory per kill).
        folder = os.path.dirname(s.engine_socket)
        assert not os.path.exists(folder), os.listdir(folder)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_a_killed_engine_process_fails_the_turns_in_flight_and_is_started_again():
    with serve_workers(2) as s:

        async def main():
            client, _ = await open_on(s.url, 1)
            try:
                await ask(client)
                await client.wait_for("response.output_audio_transcript.delta", timeout=20)
                os.kill(s.engine_pid, signal.SIGKILL)
                failed, _ = await client.wait_for("response.done", timeout=20)
                # the front starts a new engine process; the worker reconnects on its next turn
                statuses = await turns_until_one_completes(client)
            finally:
                await client.close()
            return failed, statuses

        failed, statuses = run(main)
        assert failed["response"]["status"] == "failed"
        assert statuses[-1] == "completed", statuses
        assert set(statuses[:-1]) <= {"failed"}


@pytest.mark.slow
def test_a_hung_engine_process_is_stopped_and_started_again_and_turns_complete_after():
    """The engine process stopped by its pid (SIGSTOP) mid-turn: alive, its socket still
    accepting, answering nothing. The turn in flight waits on it; after --engine-timeout-s the
    front stops it (its stacks on stderr) and starts a new one; that turn ends failed, and a
    later turn completes. Without the watch every turn would fail after the stall timeout,
    for as long as the process lived."""
    with serve_workers(2, "--engine-timeout-s", "3", "--scripted-pace", "5") as s:

        async def main():
            client, _ = await open_on(s.url, 0)
            try:
                await ask(client)
                await client.wait_for("response.created", timeout=20)
                os.kill(s.engine_pid, signal.SIGSTOP)
                stopped_at = time.monotonic()
                failed, _ = await client.wait_for("response.done", timeout=20)
                ended_after = time.monotonic() - stopped_at
                statuses = await turns_until_one_completes(client)
            finally:
                await client.close()
            return failed, ended_after, statuses

        failed, ended_after, statuses = run(main)
        assert failed["response"]["status"] == "failed", failed
        assert ended_after < 12, ended_after  # the front's timeout, not the 15 s stall watchdog
        assert statuses[-1] == "completed", statuses
        errors = s.stderr()
        assert f"engine pid={s.engine_pid} answered nothing for" in errors, errors[-3000:]
        assert "engine restarted pid=" in errors
        with pytest.raises(ProcessLookupError):
            os.kill(s.engine_pid, 0)
        with urllib.request.urlopen(s.http + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert "duplex_engine_process_hangs 1.0" in metrics, metrics


@pytest.mark.slow
def test_serve_flags_reach_the_workers_and_the_per_address_quota_is_the_servers_over_all_of_them():
    # serve's admission and connection flags used to stop at the front: a worker built its
    # ServerConfig from four of them, so --max-sessions-per-address was silently unlimited
    # with --workers. Then each worker counted a client's sessions on its own, and new sessions
    # go round-robin: with 2 workers a quota of 2 let one client hold 4. The front now counts
    # them over every worker and answers the next 429, as a worker answers past its default.
    with serve_workers(2, "--max-sessions-per-address", "2", "--no-compression") as s:

        async def main() -> None:
            opened = []
            for _ in range(2):
                ws = await connect(s.url)
                assert json.loads(await ws.recv())["type"] == "session.created"
                assert ws.protocol.extensions == []  # --no-compression reached the worker
                opened.append(ws)
            with urllib.request.urlopen(s.http + "/health", timeout=10) as response:
                assert response.status == 200  # not a session: never counted, never refused
            with pytest.raises(InvalidStatus) as refused:
                await connect(s.url)
            assert refused.value.response.status_code == 429
            assert b"already holds 2 sessions" in refused.value.response.body
            assert refused.value.response.headers["Retry-After"] == "5"
            # A client at its quota that closes a session and opens another at once gets it,
            # on either worker: the front waits for the release its worker reports (it reads
            # reports in batches, and refused such a client before it had read it).
            for _ in range(10):
                await opened.pop(0).close()
                ws = await connect(s.url)
                assert json.loads(await ws.recv())["type"] == "session.created"
                opened.append(ws)
            for ws in opened:
                await ws.close()

        run(main)
        errors = s.stderr()
        assert "what=front_address_sessions" in errors and "refused=1" in errors, errors[-3000:]


@pytest.mark.slow
def test_the_per_key_quota_is_the_servers_over_all_of_its_workers():
    # As the per-address quota: each worker counted a key's sessions alone, so with 2 workers
    # --max-sessions-per-key 2 let one key hold 4 (on the tree before, the third opened). The
    # front reads the key from the request's head and counts it over every
    # worker; another key, and a key's own quota freed by a close, are served at once.
    with serve_workers(2, "--api-key", "sk-a", "--max-sessions-per-key", "2") as s:

        async def main() -> None:
            opened = []
            for _ in range(2):
                ws = await connect(s.url, additional_headers={"Authorization": "Bearer sk-a"})
                assert json.loads(await ws.recv())["type"] == "session.created"
                opened.append(ws)
            with pytest.raises(InvalidStatus) as refused:
                await connect(s.url, additional_headers={"Authorization": "Bearer sk-a"})
            assert refused.value.response.status_code == 429
            assert b"this API key already holds 2 sessions" in refused.value.response.body
            # The key in the subprotocol, as browsers send it: the same key, the same count.
            with pytest.raises(InvalidStatus) as refused:
                await connect(s.url, subprotocols=["realtime", "openai-insecure-api-key.sk-a"])
            assert refused.value.response.status_code == 429
            # A wrong key is the worker's to refuse (401), not counted here.
            with pytest.raises(InvalidStatus) as wrong:
                await connect(s.url, additional_headers={"Authorization": "Bearer sk-b"})
            assert wrong.value.response.status_code == 401
            for _ in range(4):
                await opened.pop(0).close()
                ws = await connect(s.url, additional_headers={"Authorization": "Bearer sk-a"})
                assert json.loads(await ws.recv())["type"] == "session.created"
                opened.append(ws)
            for ws in opened:
                await ws.close()

        run(main)
        errors = s.stderr()
        assert "what=front_API_key_sessions" in errors, errors[-3000:]
        # A head too long for the front to read its key is answered, not passed on uncounted.
        host, port = urllib.parse.urlsplit(s.url).netloc.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            padding = b"X-Pad: " + b"a" * (40 << 10) + b"\r\n"
            raw.sendall(
                b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\n" + padding + b"Authorization: Bearer sk-a\r\n\r\n"
            )
            assert raw.recv(64).startswith(b"HTTP/1.1 431 ")


@pytest.mark.slow
def test_connect_rates_and_a_proxied_clients_quota_are_the_servers_over_all_of_its_workers():
    # Each worker kept its own connect-rate buckets, so with 2 workers a client got twice its
    # --connect-rate-per-address burst; and the front counted a trusted proxy's clients as
    # the proxy (so not at all), leaving each worker to count them alone: one client behind
    # the proxy held twice --max-sessions-per-address. On the tree before, the third session
    # below opened and the 21st connection passed. The front now reads X-Forwarded-For from a
    # trusted proxy's requests, as a worker reads it, and counts both over every worker.
    with serve_workers(
        2,
        "--trusted-proxies",
        "127.0.0.1/32",
        "--max-sessions-per-address",
        "2",
        "--connect-rate-per-address",
        "0.01",  # after the burst of 20, nothing refills during the test
    ) as s:

        def via_proxy(client: str) -> dict[str, str]:
            return {"X-Forwarded-For": client}

        async def main() -> None:
            opened = []
            for _ in range(2):  # tokens of 203.0.113.7 spent: 2
                ws = await connect(s.url, additional_headers=via_proxy("203.0.113.7"))
                assert json.loads(await ws.recv())["type"] == "session.created"
                opened.append(ws)
            with pytest.raises(InvalidStatus) as refused:  # 3
                await connect(s.url, additional_headers=via_proxy("203.0.113.7"))
            assert refused.value.response.status_code == 429
            assert b"already holds 2 sessions" in refused.value.response.body
            # A client that writes its own X-Forwarded-For before the proxy's entry is still
            # the address the proxy appended.
            with pytest.raises(InvalidStatus) as refused:  # 4
                await connect(s.url, additional_headers=via_proxy("198.51.100.1, 203.0.113.7"))
            assert refused.value.response.status_code == 429
            async with connect(s.url, additional_headers=via_proxy("203.0.113.8")) as other:
                assert json.loads(await other.recv())["type"] == "session.created"
            for ws in opened:
                await ws.close()
            for _ in range(16):  # 5 to 20: the burst
                async with connect(s.url, additional_headers=via_proxy("203.0.113.7")) as ws:
                    assert json.loads(await ws.recv())["type"] == "session.created"
            with pytest.raises(InvalidStatus) as refused:  # 21
                await connect(s.url, additional_headers=via_proxy("203.0.113.7"))
            assert refused.value.response.status_code == 429
            assert b"too many new connections for this address" in refused.value.response.body
            assert int(refused.value.response.headers["Retry-After"]) >= 1
            async with connect(s.url, additional_headers=via_proxy("203.0.113.8")) as other:
                assert json.loads(await other.recv())["type"] == "session.created"

        run(main)
        errors = s.stderr()
        assert "what=front_connect_rate_address" in errors, errors[-3000:]
        assert "what=front_address_sessions" in errors, errors[-3000:]
        # A worker counts no connect rate behind the front: the front's refusals reach the
        # workers' /metrics instead.
        wanted = {
            'duplex_front_refused{reason="connect_rate_address"} 1.0',
            'duplex_front_refused{reason="address_sessions"} 2.0',
        }
        deadline = time.monotonic() + 10
        while True:
            with urllib.request.urlopen(s.http + "/metrics", timeout=10) as response:
                lines = set(response.read().decode().splitlines())
            if wanted <= lines or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert wanted <= lines, sorted(
            line for line in lines if "front_refused" in line or "rate_limited" in line
        )


@pytest.mark.slow
def test_the_memory_budgets_are_the_servers_shared_out_among_its_workers():
    # --text-budget-mb (and the audio and journal budgets) bounded each worker, so N workers
    # let the server hold N times what the flag said. Now each worker holds 1/N: 512 KiB each
    # here. One client's items of 60,000 emoji (240,000 bytes as Python holds them): two fit a
    # worker's part, the third is refused (a whole 1 MiB took four before the fifth was).
    item = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "\U0001f600" * 60_000}],
    }
    frame = json.dumps({"type": "conversation.item.create", "item": item}, ensure_ascii=False)
    with serve_workers(2, "--text-budget-mb", "1") as s:

        async def main() -> None:
            async with connect(s.url, max_size=None) as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
                answers = []
                for _ in range(3):
                    await ws.send(frame)
                    while True:
                        event = json.loads(await ws.recv())
                        if event["type"] in ("conversation.item.added", "error"):
                            break
                    answers.append(event["type"] if event["type"] != "error" else event["error"]["code"])
                assert answers == ["conversation.item.added"] * 2 + ["resource_exhausted"], answers

        run(main)


@pytest.mark.slow
def test_a_clients_read_ahead_is_the_servers_shared_out_among_its_workers():
    # As the memory budgets: 16 MiB over two workers is 8 MiB each (never less than a whole
    # message at the transport cap and a piece, which the default 1 MiB frames make 4.25 MiB).
    with serve_workers(2, "--read-ahead-mb-per-client", "16") as s:
        with urllib.request.urlopen(s.http + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert metric_sample(metrics, "duplex_client_read_ahead_limit_bytes") == 8 << 20
    with serve_workers(2, "--read-ahead-mb-per-client", "2") as s:
        with urllib.request.urlopen(s.http + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert metric_sample(metrics, "duplex_client_read_ahead_limit_bytes") == (4 << 20) + (256 << 10)


@pytest.mark.slow
def test_serve_workers_listens_on_an_ipv6_host_and_prints_a_url_clients_parse():
    # The front door's listener was IPv4 only (create_server's default family), and the URL it
    # printed, ws://::1:PORT/..., is one no client parses.
    with serve_workers(2, "--host", "::1") as s:
        assert s.url.startswith("ws://[::1]:"), s.url

        async def main() -> None:
            client = await DuplexClient.connect(s.url)
            await client.recv()
            await one_turn(client)
            await client.close()

        run(main)


def test_the_front_holds_no_more_connections_reading_their_request_line_than_an_address_may_open():
    # A single-process server answers the 65th silent connection from one address 503; the
    # front of --workers held every one until the request line's timeout (3,000 of them, as
    # many as its descriptors allow), before any worker counted them.
    with serve_workers(2, "--exempt-networks", "10.0.0.0/8", "--max-handshakes-per-address", "8") as s:
        port = int(s.url.rsplit(":", 1)[1].split("/")[0])
        silent = []
        for _ in range(40):
            sock = socket.socket()
            sock.bind(("127.0.0.2", 0))
            sock.connect(("127.0.0.1", port))
            silent.append(sock)
        time.sleep(1.0)
        held, refused = 0, 0
        for sock in silent:
            sock.setblocking(False)
            try:
                answer = sock.recv(100)
            except BlockingIOError:
                held += 1
                continue
            refused += answer.startswith(b"HTTP/1.1 503")
        assert (held, refused) == (8, 32)
        with urllib.request.urlopen(s.http + "/health", timeout=10) as response:  # another address
            assert response.status == 200
        for sock in silent:
            sock.close()
        time.sleep(0.5)

        # Their places are free again: the address's requests are served.
        for _ in range(9):
            with socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0)) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert sock.recv(100).startswith(b"HTTP/1.1 200")
