"""The soak over the wire: N websocket clients against a real ``duplex-actors serve`` process.

Where ``soak.py`` drives the runtime in-process, this one starts ``serve`` as a subprocess and
speaks to it only through sockets, so the codec, the connection shell, the resume path and the
server's defences are all in the loop. Each normal client is a GA client taking manual turns
(server VAD off, 100 ms of 24 kHz pcm16, commit, then response.create; words read from the
audio transcript), barges in (cancels mid-response), drops its socket right after a commit
(the events on the wire are lost to it; a response.create the server never read is sent again),
reconnects after up to 1 s and resumes from the last seq it kept, and sometimes closes and
opens a new session. Each checks its own stream: a seq gap is a *lost* event, a seq at or below
one already seen a *duplicate*, a ``response.created`` without exactly one ``response.done``
(or a second one) a *terminal violation*. Events without a seq (``rate_limits.updated``, which
GA sends after every ``response.done``) are outside the journal and not counted.

A fraction of clients is hostile and must be refused without hurting anyone: *flooders* send
hundreds of invalid frames without reading (expected: the flood policy's 1008), *forgers*
resume a dropped session with a forged token (expected: 4409, no journal), *pokers* send
out-of-range sampling values and lone surrogates (expected: GA error events naming the frame's
event_id, ``invalid_value`` with ``param`` naming the refused knob, ``invalid_text``; connection
kept). A hostile client whose refusal did not come is counted as a defence failure.

RSS is the server process's (``/proc/<pid>/status``): at start, after warm-up (at least 1.5x
the journal age, since each journal fills for that long), at the end, and the slope after
warm-up. RSS alone cannot tell a leak from the replay journals following the event rate (each
session keeps its last ``journal_max_age_s`` of events, so they grow when the machine speeds
up), so the memory verdict is on RSS growth after warm-up minus the journals' growth (counted
exactly by the server), against 16 MiB or 5%. At each RSS sample the soak also
reads the server's ``/metrics``: events and bytes held in journals, Python allocator blocks,
event-loop tasks and session records; and it reads them once more before the first client and
after the last session is gone, when nothing should be held. At the end every client closes; the
server must reach 0 sessions (hostile sessions expire after the disconnect grace) and exit 0 on
SIGTERM.

``--workers N`` runs ``serve --workers N``; RSS is then the whole process tree's (front, workers,
engine process), and the idle read-outs are whichever worker answered. With ``--kill-worker``,
worker 1 is killed by its pid (SIGKILL) halfway through: its clients must each be *told* (a
failed ``response.done`` for every response in flight, ``session.closed`` with reason
``worker_lost``, close 1011; a resume of a session that was detached then is refused with
``session_lost``), and they open new sessions. The verdict then asks for zero loss everywhere
else and for no client of the dead worker left untold (``untold_worker_losses``).
``--kill-workers K`` kills K of the starting workers in turn, evenly spaced (worker 1, then
worker 0, then the others), with the same verdict.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

# 100 ms of quiet pcm16 at 24 kHz, the GA wire rate (the server resamples it at the edge).
PCM_100MS = b"\x01\x00" * 2400
_EXPECTED_ERRORS = {"response_cancel_not_active", "conversation_already_has_active_response"}


def server_rss_mb(pid: int, tree: bool = False) -> float:
    """RSS of the server's process; with ``tree``, of it and every process under it (serve
    --workers' workers and engine process)."""
    return sum(_rss_mb(p) for p in {pid, *_descendants(pid)}) if tree else _rss_mb(pid)


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _descendants(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _slope_per_min(points: list[tuple[float, float]]) -> float:
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    var = sum((p[0] - mx) ** 2 for p in points)
    return 0.0 if var == 0 else sum((p[0] - mx) * (p[1] - my) for p in points) / var * 60.0


class _Stream:
    """One client's view of one session's event stream, checked as it arrives."""

    __slots__ = (
        "stats",
        "last",
        "open",
        "ended",
        "closed",
        "sid",
        "generation",
        "token",
        "dones",
        "created",
        "worker_lost",
        "ws",
    )

    def __init__(self, stats: Counter[str]) -> None:
        self.stats = stats
        self.last = 0
        self.open: set[str] = set()
        self.ended: set[str] = set()  # to tell a second response.done from an unseen one's
        self.closed = False
        self.sid = ""
        self.generation = 0
        self.token = ""
        self.dones = 0
        self.created = 0
        self.worker_lost = False  # told its worker died (serve --workers)
        self.ws: Any = None  # the connection the session is on now

    def take(self, event: dict[str, Any]) -> bool:
        """Account one event; False for a duplicate the client drops."""
        seq = event.get("server_event_seq")
        stats = self.stats
        if seq is None:
            self._take_from_the_front(event)
            return True
        if seq <= self.last:
            stats["duplicates"] += 1
            return False
        if seq > self.last + 1:
            stats["lost"] += seq - self.last - 1
        self.last = seq
        stats["events"] += 1
        kind = event["type"]
        if self.closed:
            stats["terminal_violations"] += 1  # anything after session.closed
        if kind == "response.created":
            rid = event["response"]["id"]
            if rid in self.open:
                stats["terminal_violations"] += 1
            self.open.add(rid)
            self.created += 1
        elif kind == "response.done":
            rid = event["response"]["id"]
            if rid not in self.open:
                stats["terminal_violations"] += 1  # a second done, or one without created
            self.open.discard(rid)
            self.ended.add(rid)
            self.dones += 1
            stats[f"responses_{event['response']['status']}"] += 1
        elif kind == "session.closed":
            self.closed = True
        elif kind == "error":
            code = event["error"]["code"]
            stats["errors_expected" if code in _EXPECTED_ERRORS else "errors_unexpected"] += 1
            if code not in _EXPECTED_ERRORS:
                stats[f"error:{code}"] += 1
        return True

    def _take_from_the_front(self, event: dict[str, Any]) -> None:
        """The front's farewell when this session's worker died: no seq (the worker that
        numbered the stream is gone), but each response in flight must end here, once."""
        kind = event["type"]
        if (
            kind == "response.done"
            and event["response"]["status_details"].get("duplex_reason") == "worker_lost"
        ):
            rid = event["response"]["id"]
            if rid in self.open:
                self.open.discard(rid)
            elif rid in self.ended:
                self.stats["terminal_violations"] += 1  # a second done for one that ended
            else:
                # Its response.created never came: the worker told the front of it and was
                # killed before writing it (docs/protocol.md). Ended, never seen started.
                self.stats["responses_ended_unseen"] += 1
            self.ended.add(rid)
            self.dones += 1
            self.stats["responses_ended_by_worker_loss"] += 1
        elif kind == "session.closed" and event.get("reason") == "worker_lost":
            self.lost_with_worker()

    def lost_with_worker(self) -> None:
        """Told that the session died with its worker (farewell, or a resume refused as lost):
        nothing more will come for it, and whatever was open was ended by that."""
        if not self.worker_lost:
            self.worker_lost = True
            self.closed = True
            self.stats["sessions_lost_with_worker"] += 1
            self.stats["responses_ended_by_worker_loss"] += len(self.open)
            self.open.clear()


async def _recv(ws: ClientConnection, timeout: float = 20.0) -> dict[str, Any]:
    event: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), timeout))
    return event


def _append() -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(PCM_100MS).decode()})


# Manual turns: serve turns server VAD on for new sessions when its model loads; this client
# commits and asks for each response itself, as a push-to-talk GA client does.
_MANUAL_TURNS = json.dumps(
    {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}}
)


async def _connect(url: str, stats: Counter[str], attempts: int = 1) -> ClientConnection:
    """A websocket, retried (``attempts``) when the handshake fails: a handshake caught by the
    death of the worker it was handed to fails without a session (serve --workers runs)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidHandshake

    for attempt in range(attempts):
        try:
            return await connect(url)
        except (InvalidHandshake, OSError):
            if attempt == attempts - 1:
                raise
            stats["handshakes_failed_with_worker"] += 1
            await asyncio.sleep(0.2)
    raise AssertionError("unreachable")


async def _resume(
    url: str, stream: _Stream, stats: Counter[str], control_id: str, attempts: int = 1
) -> ClientConnection | None:
    ws = stream.ws = await _connect(f"{url}?session_id={stream.sid}", stats, attempts)
    await ws.send(
        json.dumps(
            {
                "type": "session.resume",
                "session_id": stream.sid,
                "generation": stream.generation,
                "resume_token": stream.token,
                "last_seq": stream.last,
                "control_id": control_id,
            }
        )
    )
    while True:
        event = await _recv(ws)
        if event["type"] == "error" and event.get("server_event_seq") is None:
            stats[f"resume_refused:{event['error']['code']}"] += 1
            if event["error"]["code"] == "session_lost":
                stream.lost_with_worker()
            await ws.close()
            return None
        stream.take(event)
        if event["type"] == "session.resumed":
            stream.generation, stream.token = event["generation"], event["resume_token"]
            stats["resumes"] += 1
            return ws


async def _normal_client(
    url: str,
    rng: random.Random,
    deadline: float,
    stats: Counter[str],
    p_barge: float,
    p_drop: float,
    p_churn: float,
    killing: bool = False,
) -> None:
    from websockets.exceptions import ConnectionClosed

    # A run that kills a worker retries a handshake the death caught (no session had begun).
    attempts = 5 if killing else 1
    while time.monotonic() < deadline:
        stream = _Stream(stats)
        ws: ClientConnection | None = await _connect(url, stats, attempts)
        try:
            ws = await _one_session(url, ws, stream, rng, deadline, stats, p_barge, p_drop, p_churn, attempts)
        except ConnectionClosed as closed:
            if not killing:
                raise
            if not stream.sid:  # closed before session.created: no session was lost
                stats["handshakes_failed_with_worker"] += 1
                continue
            # Its worker was killed: a farewell must have come first (else it was never told).
            # What arrived before the close frame is still there to read.
            await _read_what_is_left(stream.ws, stream)
            if not stream.worker_lost:
                stats["untold_worker_losses"] += 1
                stats[f"untold_close:{closed.rcvd.code if closed.rcvd else None}"] += 1
                stream.open.clear()
            ws = None
        if ws is not None:
            await ws.close()  # 1000: the server closes the session (client_disconnected)
        if stream.open:
            stats["responses_left_open"] += len(stream.open)


async def _read_what_is_left(ws: ClientConnection, stream: _Stream) -> None:
    from websockets.exceptions import ConnectionClosed

    try:
        while True:
            stream.take(await _recv(ws, 1.0))
    except (TimeoutError, ConnectionClosed):
        pass


async def _one_session(
    url: str,
    ws: ClientConnection | None,
    stream: _Stream,
    rng: random.Random,
    deadline: float,
    stats: Counter[str],
    p_barge: float,
    p_drop: float,
    p_churn: float,
    attempts: int = 1,
) -> ClientConnection | None:
    """One session, from its session.created to a churn or the deadline; returns the socket
    still to close (None: the session ended without one)."""
    assert ws is not None  # the caller's new connection (``ws`` is None only after a failed resume)
    stream.ws = ws
    opened = await _recv(ws)
    stream.take(opened)
    if opened["type"] != "session.created":
        # Its worker died after opening the session, before the client read session.created:
        # the front's farewell (session.closed, worker_lost) came first, and told it.
        if stream.worker_lost:
            return None
        raise AssertionError(f"a session began with {opened['type']!r}, not session.created: {opened}")
    stream.sid, stream.token = opened["session"]["id"], opened["resume_token"]
    stats["sessions_opened"] += 1
    await ws.send(_MANUAL_TURNS)
    resumes = 0
    while time.monotonic() < deadline and ws is not None and not stream.worker_lost:
        await ws.send(_append())
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        # GA: a commit never creates a response by itself; the client asks for one.
        await ws.send(json.dumps({"type": "response.create"}))
        stats["turns"] += 1
        created = stream.created
        barge = rng.random() < p_barge
        drop_after = rng.randint(1, 12) if rng.random() < p_drop else None
        seen = 0
        dones = stream.dones
        while stream.dones == dones:
            event = await _recv(ws)
            seen += 1
            stream.take(event)
            if stream.dones > dones:
                break
            # An audio response (the default) streams its words as the audio transcript.
            if barge and event["type"] == "response.output_audio_transcript.delta":
                barge = False
                stats["barge_ins"] += 1
                await ws.send(json.dumps({"type": "response.cancel"}))
            if drop_after is not None and seen >= drop_after:
                drop_after = None
                stats["drops"] += 1
                ws.transport.abort()
                await asyncio.sleep(rng.uniform(0.05, 1.0))
                resumes += 1
                ws = stream.ws = await _resume(url, stream, stats, f"{stream.sid}-r{resumes}", attempts)
                if ws is None:
                    break
                if stream.created == created and stream.dones == dones:
                    # The replay holds no response for this turn: the server never read
                    # our response.create before the socket went, so ask again.
                    stats["response_create_resent"] += 1
                    await ws.send(json.dumps({"type": "response.create"}))
                # (the loop ends here if the response's done came with the replay)
        await asyncio.sleep(rng.uniform(0.05, 0.3))
        if ws is not None and rng.random() < p_churn:
            break
    return ws


async def _hostile_client(
    url: str, rng: random.Random, deadline: float, stats: Counter[str], killing: bool = False
) -> None:
    from websockets.exceptions import ConnectionClosed, InvalidHandshake

    while time.monotonic() < deadline:
        try:
            await _hostile_round(url, rng, stats)
        except (ConnectionClosed, InvalidHandshake, OSError):
            if not killing:
                raise
            # Its worker died under it (a farewell's 1011, or a handshake cut): no defence was
            # tried, so none failed.
            stats["hostile_cut_by_worker_loss"] += 1
        await asyncio.sleep(rng.uniform(0.5, 2.0))


def _lost_with_worker(ws: ClientConnection) -> bool:
    """Whether the front closed ``ws`` because its worker died (serve --workers)."""
    return ws.close_code == 1011 and (ws.close_reason or "").startswith("worker lost")


async def _hostile_round(url: str, rng: random.Random, stats: Counter[str]) -> None:
    """One hostile try: a flood, a forged resume or out-of-range values."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    kind = rng.choice(("flood", "forge", "poke"))
    stats[f"hostile_{kind}"] += 1
    ws = await connect(url)
    created = await _recv(ws)
    if created["type"] == "session.closed" and created.get("reason") == "worker_lost":
        stats["hostile_cut_by_worker_loss"] += 1  # its worker died before session.created was read
        return
    sid = created["session"]["id"]
    if kind == "flood":
        for i in range(400):
            await ws.send(f"garbage {i}")
        try:
            while True:
                await _recv(ws, 10.0)
        except ConnectionClosed:
            pass
        except TimeoutError:
            pass
        if _lost_with_worker(ws):
            stats["hostile_cut_by_worker_loss"] += 1
        elif ws.close_code != 1008:
            stats["defence_failures"] += 1
            stats[f"defence_failed:flood:{ws.close_code}"] += 1
    elif kind == "forge":
        ws.transport.abort()
        await asyncio.sleep(0.05)
        thief = await connect(f"{url}?session_id={sid}")
        await thief.send(
            json.dumps(
                {
                    "type": "session.resume",
                    "session_id": sid,
                    "generation": 0,
                    "resume_token": "forged",
                    "last_seq": 0,
                    "control_id": "x",
                }
            )
        )
        answer = await _recv(thief)
        try:
            extra = await _recv(thief, 5.0)
        except (TimeoutError, ConnectionClosed):
            extra = None
        # (session_lost: the session died with its worker before the thief came, in a run
        # that kills one; refused all the same, and its journal is gone)
        refusals = ("resume_conflict", "session_lost")
        if answer["type"] != "error" or answer["error"]["code"] not in refusals or extra is not None:
            stats["defence_failures"] += 1
            stats["defence_failed:forge"] += 1
    else:
        # Each frame's refusal is a GA error naming its event_id (and, for a field of a
        # session.update, its param). A session.update is refused whole (all or nothing,
        # as OpenAI's): the error alone comes, never a session.updated; so is the surrogate.
        frames = [
            (
                json.dumps(
                    {
                        "type": "session.update",
                        "event_id": "p1",
                        "session": {"duplex": {"sampling": {"seed": 2**70}}},
                    }
                ),
                ("invalid_value", "session.duplex.sampling.seed"),
            ),
            (
                '{"type": "session.update", "event_id": "p2", "session": {"instructions": "\\ud800"}}',
                ("invalid_text", None),
            ),
        ]
        for frame, expected in frames:
            await ws.send(frame)
            sent_id = json.loads(frame)["event_id"]
            try:
                answer = await _recv(ws, 5.0)
                while answer["type"] != "error":
                    answer = await _recv(ws, 5.0)
                error = answer["error"]
                refused = (
                    error.get("type") == "invalid_request_error"
                    and error.get("event_id") == sent_id
                    and (error.get("code"), error.get("param")) == expected
                )
            except (TimeoutError, ConnectionClosed):
                if _lost_with_worker(ws):
                    stats["hostile_cut_by_worker_loss"] += 1
                    return
                refused = False
            if not refused:
                stats["defence_failures"] += 1
                stats["defence_failed:poke"] += 1
        await ws.close()


#: What the soak reads from the server's /metrics beside its RSS: with these a report can tell
#: memory that follows the replay journals (the recent event rate) from memory that leaks.
_INSIDE = {
    ("duplex_journal", "events"): "journal_events",
    ("duplex_journal", "bytes"): "journal_bytes",
    ("duplex_python_allocated_blocks", None): "python_blocks",
    ("duplex_event_loop_tasks", None): "tasks",
    ("duplex_engine_parked_pumps", None): "parked_pumps",
    ("duplex_server_session_records", None): "records",
}


def _working_tasks(inside: dict[str, float]) -> float:
    """Tasks alive, less the engine's parked pumps: a pool that the first turns fill and that
    stays bounded, so it is no leak."""
    return inside.get("tasks", 0) - inside.get("parked_pumps", 0)


def _inside(http: str) -> dict[str, float]:
    """The server's own memory-relevant gauges, from /metrics; {} if it does not answer."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(http + "/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = _INSIDE.get((sample.name, sample.labels.get("unit")))
            if key is not None:
                found[key] = sample.value
            elif sample.name == "duplex_sessions":
                found["sessions"] = found.get("sessions", 0) + sample.value
    return found


async def _sample(
    pid: int,
    http: str,
    t0: float,
    samples: list[tuple[float, float]],
    inside: list[tuple[float, dict[str, float]]],
    every: float,
    tree: bool = False,
) -> None:
    while True:
        at = time.monotonic() - t0
        samples.append((at, server_rss_mb(pid, tree)))
        inside.append((at, await asyncio.to_thread(_inside, http)))
        await asyncio.sleep(every)


def _inside_report(
    inside: list[tuple[float, dict[str, float]]], warmup_s: float, seconds: float
) -> dict[str, Any]:
    """The server's gauges after warm-up and at the last sample while clients ran, and how much
    each moved between (the idle read-out after the run is reported apart)."""
    after = [(t, v) for t, v in inside if v and warmup_s <= t <= seconds]
    if not after:
        return {}
    first, last = after[0][1], after[-1][1]
    return {
        "after_warmup": first,
        "end": last,
        "change": {k: last[k] - first[k] for k in first if k in last},
        "peak_journal_bytes": max(v.get("journal_bytes", 0) for _, v in after),
    }


async def _health(http: str) -> dict[str, Any]:
    import urllib.request

    def get() -> dict[str, Any]:
        health: dict[str, Any] = json.loads(urllib.request.urlopen(http + "/health", timeout=5).read())
        return health

    return await asyncio.to_thread(get)


async def _run(
    sessions: int,
    seconds: float,
    seed: int,
    hostile: float,
    journal_max_age_s: float,
    progress: Callable[[str], None] | None,
    workers: int = 1,
    kill_worker: bool = False,
    kill_workers: int = 0,
) -> dict[str, Any]:
    # --kill-worker is --kill-workers 1: worker 1 at half time, as it always was.
    kills = max(kill_workers, 1 if kill_worker else 0)
    kill_worker = kills > 0
    if kill_worker and workers < 2:
        raise ValueError("--kill-worker needs --workers 2 or more")
    if kills > workers:
        raise ValueError(f"--kill-workers {kills}: only {workers} workers start")
    grace = 3.0
    command = [
        sys.executable,
        "-m",
        "duplex_actors",
        "serve",
        "--engine",
        "scripted",
        "--port",
        "0",
        "--workers",
        str(workers),
        "--max-sessions",
        str(sessions * 4),
        "--max-connections",
        str(sessions * 8),
        "--disconnect-grace-s",
        str(grace),
        "--journal-max-age-s",
        str(journal_max_age_s),
        # Diagnosis: extra serve options (e.g. "--gc-reclaim-s 0") without changing the soak.
        *os.environ.get("DUPLEX_SOAK_SERVE_ARGS", "").split(),
    ]
    # The server's log goes to a file: an undrained pipe fills (64 KiB) and then blocks the
    # server's event loop on its next log line, which a long run reaches within minutes.
    # Kept open for the server's whole life (closed in the finally below).
    log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115
        "w+", prefix="wire-soak-serve-", suffix=".log", delete=False
    )
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_file, text=True, env=dict(os.environ))
    assert proc.stdout is not None  # stdout=PIPE
    stdout = proc.stdout
    stats: Counter[str] = Counter()
    samples: list[tuple[float, float]] = []
    inside: list[tuple[float, dict[str, float]]] = []
    report: dict[str, Any] = {}
    try:
        line = await asyncio.wait_for(asyncio.to_thread(stdout.readline), 60)
        if "serving" not in line:
            raise RuntimeError(f"serve did not start: {line!r}; see {log_file.name}")
        # serve --workers prints a line per worker, then the engine's: worker 1's pid is killed.
        pool = [await asyncio.to_thread(stdout.readline) for _ in range(workers + 1 if workers > 1 else 0)]
        worker_pids = [int(p.split()[2].split("=")[1]) for p in pool if p.startswith("worker ")]
        asyncio.get_running_loop().run_in_executor(None, stdout.read)  # keep stdout drained
        url = line.split()[2]
        http = url.replace("ws://", "http://").rsplit("/v1/realtime", 1)[0]
        t0 = time.monotonic()
        deadline = t0 + seconds
        warmup_s = 1.5 * journal_max_age_s
        rng = random.Random(seed)
        n_hostile = int(round(sessions * hostile))
        idle_before = await asyncio.to_thread(_inside, http)
        sampler = asyncio.create_task(
            _sample(proc.pid, http, t0, samples, inside, max(1.0, seconds / 60), workers > 1)
        )
        tasks = []
        for i in range(sessions):
            crng = random.Random(rng.getrandbits(64))
            if i < n_hostile:
                tasks.append(_hostile_client(url, crng, deadline, stats, kill_worker))
            else:
                tasks.append(_normal_client(url, crng, deadline, stats, 0.2, 0.08, 0.03, kill_worker))

        async def ticker() -> None:
            while progress is not None:
                await asyncio.sleep(max(5.0, seconds / 20))
                progress(
                    f"t={time.monotonic() - t0:6.1f}s server_rss={server_rss_mb(proc.pid, workers > 1):7.1f}MiB "
                    f"events={stats['events']} lost={stats['lost']} dup={stats['duplicates']} "
                    f"resumes={stats['resumes']}"
                )

        async def kill_in_turn() -> None:
            # Starting workers, evenly spaced over the run: worker 1 (as --kill-worker always
            # did), then worker 0, then the others. With two kills, the clients that moved to
            # worker 0 lose it too, and resumes of worker 1's sessions meet a dying worker.
            order = [1, 0, *range(2, workers)]
            for k in range(kills):
                await asyncio.sleep(t0 + seconds * (k + 1) / (kills + 1) - time.monotonic())
                index = order[k]
                os.kill(worker_pids[index], signal.SIGKILL)
                stats["workers_killed"] += 1
                if progress is not None:
                    progress(
                        f"t={time.monotonic() - t0:6.1f}s killed worker {index} "
                        f"(pid {worker_pids[index]}) with SIGKILL"
                    )

        tick = asyncio.create_task(ticker())
        killer = asyncio.create_task(kill_in_turn()) if kill_worker else None
        results = await asyncio.gather(*tasks, return_exceptions=True)
        tick.cancel()
        if killer is not None:
            await killer
        failures = [r for r in results if isinstance(r, BaseException)]
        for failure in failures:
            stats[f"client_failed:{type(failure).__name__}"] += 1
            # Where, so that a rare one (a race with a killed worker) can be read from the report.
            frame = traceback.extract_tb(failure.__traceback__)[-1:] if failure.__traceback__ else []
            where = f"{frame[0].name}:{frame[0].lineno}" if frame else "?"
            stats[f"client_failed_at:{where}:{str(failure)[:60]}"] += 1
        # Every normal client closed its session; hostile leftovers expire after the grace.
        left = None
        zeros = 0
        for _ in range(int((grace + 5) / 0.25)):
            try:
                left = (await _health(http))["sessions"]
            except OSError as exc:  # an unresponsive server is a finding, not a crash of the bench
                stats[f"health_failed:{type(exc).__name__}"] += 1
                left = None
            # With --workers each answer is one worker's: all must have said 0 in a row.
            zeros = zeros + 1 if left == 0 else 0
            if zeros >= workers:
                break
            await asyncio.sleep(0.25)
        sampler.cancel()
        samples.append((time.monotonic() - t0, server_rss_mb(proc.pid, workers > 1)))
        # With every session gone, what the server still holds: tasks and records must be back
        # where they started (exact). Python blocks also count cyclic garbage that waits for
        # the next full collection (GcPolicy reclaims every 30 s; without it CPython's gen-2
        # heuristic decides), so they are a hint, not a verdict: without the policy they grow
        # far more, on the same code.
        idle_after = await asyncio.to_thread(_inside, http)
        for _ in range(20):  # connections closing at the last moment finish their tasks
            if (
                not idle_after
                or not idle_before
                or (
                    _working_tasks(idle_after) <= _working_tasks(idle_before)
                    and idle_after.get("records", 0) == 0
                )
            ):
                break
            await asyncio.sleep(0.25)
            idle_after = await asyncio.to_thread(_inside, http)
        proc.send_signal(signal.SIGTERM)
        exit_code = await asyncio.to_thread(proc.wait, 30)
        after = [s for s in samples if s[0] >= warmup_s]
        at_warmup = after[0][1] if after else None
        report = {
            "sessions": sessions,
            "seconds": seconds,
            "seed": seed,
            "hostile_fraction": hostile,
            "workers": workers,
            "worker_killed": kill_worker,
            "workers_killed": kills,
            "untold_worker_losses": stats["untold_worker_losses"],
            "sessions_lost_with_worker": stats["sessions_lost_with_worker"],
            "journal_max_age_s": journal_max_age_s,
            "warmup_s": warmup_s,
            "rss_mb": {
                "start": samples[0][1],
                "after_warmup": at_warmup,
                "end": samples[-1][1],
                "peak": max(s[1] for s in samples),
            },
            "rss_slope_mb_per_min_after_warmup": _slope_per_min(after),
            # Read from the server's /metrics at each RSS sample: journals (which follow the
            # event rate), Python allocator blocks, tasks and session records.
            "server_inside": _inside_report(inside, warmup_s, seconds),
            "server_idle": {"before": idle_before, "after": idle_after},
            "lost": stats["lost"],
            "duplicates": stats["duplicates"],
            "terminal_violations": stats["terminal_violations"],
            "defence_failures": stats["defence_failures"],
            "client_failures": len(failures),
            "sessions_left": left,
            "server_exit_code": exit_code,
            "server_log": log_file.name,
            "client_failure_examples": [repr(f)[:300] for f in failures[:5]],
            "counts": dict(sorted(stats.items())),
        }
        growth = (samples[-1][1] - at_warmup) if at_warmup is not None else None
        report["rss_growth_after_warmup_mb"] = growth
        # The journals hold each session's last journal_max_age_s of events, so what they
        # hold follows the event rate, which drifts with the machine's speed over ten minutes
        # (the journal's growth after warm-up can be most of the RSS's). That growth is
        # bounded by design and counted exactly by the server; the allowance is for
        # everything else.
        change = report["server_inside"].get("change", {})
        journal_mb = max(0.0, change.get("journal_bytes", 0) / 2**20)
        unexplained = None if growth is None else growth - journal_mb
        report["rss_growth_beyond_journals_mb"] = unexplained
        report["ok"] = (
            report["lost"] == 0
            and report["duplicates"] == 0
            and report["terminal_violations"] == 0
            and report["defence_failures"] == 0
            and not failures
            and left == 0
            and exit_code == 0
            and stats["errors_unexpected"] == 0
            # A worker killed and started again refills its memory from nothing: RSS is
            # reported, not judged, in such a run.
            and (
                kill_worker
                or unexplained is None
                or at_warmup is None
                or unexplained <= max(16.0, 0.05 * at_warmup)
            )
            # nothing kept once every session is gone: no record, no task beyond the start's
            and idle_after.get("records", 0) == 0
            # (with --workers the two read-outs may come from different workers)
            and (workers > 1 or _working_tasks(idle_after) <= _working_tasks(idle_before))
            and stats["untold_worker_losses"] == 0
        )
        return report
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run(
    sessions: int = 500,
    seconds: float = 600.0,
    *,
    seed: int = 0,
    hostile: float = 0.05,
    journal_max_age_s: float = 60.0,
    progress: Callable[[str], None] | None = None,
    workers: int = 1,
    kill_worker: bool = False,
    kill_workers: int = 0,
) -> dict[str, Any]:
    return asyncio.run(
        _run(
            sessions, seconds, seed, hostile, journal_max_age_s, progress, workers, kill_worker, kill_workers
        )
    )


def summary(report: dict[str, Any]) -> str:
    rss = report["rss_mb"]
    return (
        f"wire soak {report['sessions']} clients x {report['seconds']:.0f}s "
        f"(hostile {report['hostile_fraction']:.0%}{_pool(report)}): lost={report['lost']} "
        f"duplicates={report['duplicates']} terminal_violations={report['terminal_violations']} "
        f"defence_failures={report['defence_failures']} client_failures={report['client_failures']} "
        f"sessions_left={report['sessions_left']} exit={report['server_exit_code']}; server RSS MiB "
        f"start={rss['start']:.1f} after_warmup={rss['after_warmup'] or 0:.1f} end={rss['end']:.1f} "
        f"peak={rss['peak']:.1f} slope={report['rss_slope_mb_per_min_after_warmup']:+.2f}/min"
        f"{_beyond(report.get('rss_growth_beyond_journals_mb'))}; "
        f"{_inside_summary(report.get('server_inside') or {})}"
        f"{_idle_summary(report.get('server_idle') or {})}ok={report['ok']}"
    )


def _pool(report: dict[str, Any]) -> str:
    if report.get("workers", 1) <= 1:
        return ""
    kills = report.get("workers_killed", 1 if report.get("worker_killed") else 0)
    who = "worker 1 killed" if kills == 1 else f"{kills} workers killed in turn"
    killed = (
        f", {who}: {report['sessions_lost_with_worker']} sessions lost with them and told, "
        f"{report['untold_worker_losses']} untold"
        if kills
        else ""
    )
    return f", {report['workers']} workers{killed}"


def _beyond(mb: float | None) -> str:
    return "" if mb is None else f", growth beyond the journals' {mb:+.1f} (the allowance is on this)"


def _idle_summary(idle: dict[str, Any]) -> str:
    before, after = idle.get("before") or {}, idle.get("after") or {}
    if not before or not after:
        return ""
    return (
        f"with no session, before -> after: python blocks (garbage awaiting the next full "
        f"collection included) {before.get('python_blocks', 0):.0f}->"
        f"{after.get('python_blocks', 0):.0f}, tasks {before.get('tasks', 0):.0f}->{after.get('tasks', 0):.0f}, "
        f"records {before.get('records', 0):.0f}->{after.get('records', 0):.0f}; "
    )


def _inside_summary(inside: dict[str, Any]) -> str:
    if not inside:
        return ""
    a, e = inside["after_warmup"], inside["end"]

    def pair(key: str, scale: float = 1.0, fmt: str = ".0f") -> str:
        return f"{a.get(key, 0) / scale:{fmt}}->{e.get(key, 0) / scale:{fmt}}"

    return (
        f"inside the server after warm-up -> last sample under load: journal events {pair('journal_events')}, "
        f"journal MiB {pair('journal_bytes', 1 << 20, '.1f')}, python blocks {pair('python_blocks')}, "
        f"tasks {pair('tasks')}, records {pair('records')}; "
    )
