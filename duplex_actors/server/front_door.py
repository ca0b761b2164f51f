"""The front door of ``serve --workers N`` (:mod:`.workers`): it owns the public port, peeks at
each connection's request line, hands the socket to the worker that must serve it, keeps a
duplicate, and ends the connection for its client if that worker dies.

Session ids live here too: each names the worker process that minted it, and the front routes
a resume by it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import re
import secrets
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

import attrs
import structlog

from . import raw_http
from .client_address import peername_ip
from .front_ledger import FrontLedger
from .front_request import FrontRequest, HeadTooLong, peek_request_line, read_request, wait_io
from .guard import ConnectRate, PendingHandshakes, count_refusal
from .tls_relay import REQUEST_LINE_TIMEOUT_S, session_id_in
from .worker_link import pack, unpack
from .worker_liveness import PING_INTERVAL_S, Liveness, time_away

log = structlog.get_logger("duplex_actors.server.workers")

#: A session id minted by the ``n``-th process started as worker ``i``: ``sess_w3g0_9f2c...``.
#: The front routes resumes by it; a worker refuses one of another process as lost.
_OWNED_ID = re.compile(r"^sess_w(\d{1,4})g(\d{1,6})_[0-9a-f]+$")
#: What the front gives a client of a dead worker to read its farewell frames, then closes.
FAREWELL_WAIT_S = 2.0
#: How long a worker's reports may wait in the hand-off socket before the front reads them.
REPORT_BATCH_S = 0.05
#: How long a new session at its client's quota waits for a release the workers may have sent
#: and the front not yet read, before it is refused: a client that closes a session and opens
#: another at once is at its quota for that long (the release follows the close handshake).
QUOTA_SETTLE_S = 0.25
#: How often the front's pinger runs (FrontDoor.ping): twice per ping interval.
PING_PASS_S = PING_INTERVAL_S / 2
#: While accepting fails (out of descriptors), how often the front logs it.
ACCEPT_FAILURE_LOG_S = 5.0
#: While a worker's hand-off socket is full, how often the front checks that it still lives.
HANDOFF_RECHECK_S = 0.5


# --------------------------------------------------------------------------- session ids


def worker_session_id(index: int, generation: int = 0) -> str:
    return f"sess_w{index}g{generation}_{secrets.token_hex(12)}"


def owner_of(session_id: str) -> int | None:
    """The worker index a session id names, or None for an id no worker minted."""
    owner = minted_by(session_id)
    return None if owner is None else owner[0]


def minted_by(session_id: str) -> tuple[int, int] | None:
    """(worker index, generation) of the process that minted ``session_id``, or None."""
    match = _OWNED_ID.match(session_id)
    return (int(match.group(1)), int(match.group(2))) if match else None


# --------------------------------------------------------------------------- the front


@attrs.define(eq=False)
class _Worker:
    index: int
    process: Any
    pid: int = 0
    port: int = 0
    handoff: socket.socket | None = None
    alive: bool = True
    #: How many processes were started for this slot before this one: in the ids it mints.
    generation: int = 0
    started_at: float = 0.0
    #: Deaths in a row, each within STABLE_AFTER_S of its start (what the backoff grows with).
    quick_deaths: int = 0
    #: The pending read of its reports (FrontDoor._reports_waiting), if one is due.
    reading: asyncio.TimerHandle | None = None
    #: Its answers to the front's pings (worker_liveness.py); None until it runs.
    liveness: Liveness | None = None
    #: Times a process in this slot was stopped for not answering (``--worker-timeout-s``).
    hangs: int = 0
    #: Its process said it is draining (``["s"]``): it refuses new sessions, so it gets none.
    draining: bool = False

    def responsive(self, now: float) -> bool:
        return self.liveness is None or self.liveness.responsive(now)

    @property
    def recycled(self) -> bool:
        """Its process drained when told to (a SIGTERM to its pid) and exited cleanly: no
        crash, so no farewell log as an error and no restart backoff."""
        return self.draining and self.process is not None and self.process.exitcode == 0


@attrs.frozen(slots=True)
class SessionQuota:
    """The sessions one client address, and one API key, may open through the front, over
    every worker together.

    Each worker counts a client's sessions as a single-process server does, so with N workers,
    new sessions going round-robin, a client held N times its quota. The front counts each
    client's connections for a new session from hand-off until their worker releases them,
    and answers 429 past ``limit``: a client's live sessions are bounded server-wide. With
    ``per_key``, the same for each API key the server accepts (read from the request's head as
    a worker reads it). Detached sessions, waiting for a resume without a connection, are
    still counted by their worker alone. Not under TLS, whose request the front cannot read.
    """

    #: Sessions per client (None: counted by the workers alone).
    limit: int | None
    #: Clients not counted here: the exempt networks when the limit is the default one, as a
    #: worker leaves them alone.
    exempt: Callable[[str], bool]
    #: Sessions per API key (``--max-sessions-per-key``).
    per_key: int | None = None


class FrontDoor:
    """Owns the public port; hands each accepted connection to the worker that must serve it,
    keeps a duplicate of it, and ends it for the client if that worker dies (module docstring)."""

    def __init__(
        self,
        workers: list[_Worker],
        listener: socket.socket,
        *,
        tls: bool = False,
        clock: Callable[[], float] = time.monotonic,
        handshakes: PendingHandshakes | None = None,
        session_quota: SessionQuota | None = None,
        connect_rates: dict[str, ConnectRate] | None = None,
        path: str = "/v1/realtime",
        keys: tuple[str, ...] = (),
        trusted: Callable[[str], bool] | None = None,
    ) -> None:
        self.workers = workers
        self.session_quota = session_quota
        #: New connections a second to the realtime endpoint, by "address" and by "key", over
        #: every worker (``--connect-rate-per-*``): counted by each worker, a client got N times
        #: its rate. A worker then counts none (not under TLS, where the front reads nothing).
        self.connect_rates = connect_rates or {}
        #: The realtime endpoint, the API keys the server accepts, and the reverse proxies it
        #: trusts: what the front reads a request with as its worker will (front_request.py).
        self.path = path
        self.keys = keys
        self.trusted = trusted
        #: Connections the front answered itself and closed, by why (reported to the workers
        #: for their /metrics: pool_news): "handshakes" (503, too many of the address's
        #: connections before their handshake), "connect_rate_address"/"connect_rate_key"
        #: (429), "address_sessions"/"key_sessions" (429, a quota), "head_too_long" (431),
        #: "no_worker" (503).
        self.refusals: collections.Counter[str] = collections.Counter()
        #: Set (and dropped) when a worker releases a connection: what a new session at its
        #: client's quota waits on (_quota_allows).
        self._released: asyncio.Event | None = None
        #: Connections the front holds while it reads their request line, counted per client
        #: address as a worker counts those in their handshake (past the limits: 503, as a
        #: single-process server answers). Without it one address held as many as the front's
        #: descriptors allow, each for the request line's timeout.
        self.handshakes = handshakes
        #: The clock of the workers' pings and answers (worker_liveness.py).
        self.clock = clock
        self.listener = listener
        self._next = 0
        self.routed = [0] * len(workers)
        self.ledger = FrontLedger(owner=owner_of)
        #: The front's duplicate of every socket a living worker holds, by hand-off id.
        self._held: dict[int, socket.socket] = {}
        #: Under TLS the front can neither read a request line (each connection goes to the next
        #: worker, which relays a resume to its owner: tls_relay.py) nor write the farewell
        #: frames of a dead worker inside its TLS session, whose keys died with it (those
        #: clients see the connection close).
        self.tls = tls
        #: Each held connection's request line (not under TLS): a connection its worker died
        #: without reading is handed to another (worker_exited).
        self._lines: dict[int, bytes] = {}
        #: Connections the front ended because their worker died.
        self.lost_connections = 0
        #: Connections a worker died without reading, handed to another instead.
        self.rerouted = 0
        #: When the pinger last ran (ping).
        self._pinged_at: float | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._lasting: set[asyncio.Task[None]] = set()

    def choose(self, request_line: bytes, now: float | None = None) -> _Worker | None:
        """The owner for a resume, while the process that minted the id lives; else the next
        living worker that answers the front's pings (which refuses a resume of a lost session
        at once), or, while none answers, the next living one; None if none lives."""
        session_id = session_id_in(request_line)
        if session_id is not None:
            owner = minted_by(session_id)
            if owner is not None and owner[0] < len(self.workers):
                worker = self.workers[owner[0]]
                if worker.alive and worker.generation == owner[1]:
                    return worker
        now = self.clock() if now is None else now
        fallback = draining = None
        for _ in range(len(self.workers)):
            worker = self.workers[self._next % len(self.workers)]
            self._next += 1
            if not worker.alive:
                continue
            if worker.draining:
                draining = draining or worker
            elif worker.responsive(now):
                return worker
            else:
                fallback = fallback or worker
        # Every living worker is silent: waiting on one beats refusing everyone (a loaded
        # machine can make them all late at once). Every one draining: one of them says so.
        return fallback or draining

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        failed = 0  # accepts failed since the last one logged
        logged_at = -ACCEPT_FAILURE_LOG_S
        while True:
            try:
                conn, _ = await loop.sock_accept(self.listener)
            except OSError as exc:  # out of descriptors, a reset before accept: keep serving
                # Out of descriptors, this fails every pass until connections close: logged
                # once per ACCEPT_FAILURE_LOG_S with the count, not ten lines a second.
                failed += 1
                if loop.time() - logged_at >= ACCEPT_FAILURE_LOG_S:
                    log.warning("front.accept_failed", error=repr(exc), failures=failed)
                    failed, logged_at = 0, loop.time()
                await asyncio.sleep(0.1)
                continue
            self._spawn(self._route(conn))

    def _spawn(self, coroutine: Coroutine[Any, Any, None], *, lasting: bool = False) -> None:
        """Run ``coroutine`` as a task of the front's; ``lasting``: one that shutting down
        waits for (settle), as a dead worker's farewells."""
        task = asyncio.get_running_loop().create_task(coroutine)
        tasks = self._lasting if lasting else self._tasks
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _route(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        held = False
        counted: str | None = None
        try:
            conn.setblocking(False)
            if self.tls:
                line = b""  # encrypted: the next worker, which relays a resume to its owner
            else:
                if self.handshakes is not None:
                    address = peername_ip(conn.getpeername())
                    refusal = self.handshakes.admit(address)
                    if refusal is not None:
                        self.refusals["handshakes"] += 1
                        conn.send(raw_http.refusal(503, "Service Unavailable", refusal, retry_after=1))
                        return
                    counted = address
                # One deadline for the line and the head: a client sending both a byte at a
                # time holds its connection for one timeout, not two.
                async with asyncio.timeout(REQUEST_LINE_TIMEOUT_S):
                    found = await peek_request_line(loop, conn)
                    if found is None:
                        return
                    request = await self._read(loop, conn, found)
                too_fast = self._rate_refusal(request)
                if too_fast is not None:
                    conn.send(too_fast)
                    return
                counts = self._new_session_counts(request)
                refused = await self._admit(counts)
                if refused is not None:
                    subject, limit, what = refused
                    self.refusals["address_sessions" if what == "address" else "key_sessions"] += 1
                    text = f"this {what} already holds {limit} sessions; close one or retry later"
                    count_refusal(f"front_{what.replace(' ', '_')}_sessions", subject, text)
                    conn.send(raw_http.refusal(429, "Too Many Requests", text, retry_after=5))
                    return
                # Counted in the same step as the last check (_hand_over counts before it waits).
                held = await self._hand_over(conn, found, tuple(subject for subject, _, _ in counts))
                return
            held = await self._hand_over(conn, line)
        except HeadTooLong as exc:
            self.refusals["head_too_long"] += 1
            with contextlib.suppress(OSError):
                conn.send(raw_http.refusal(431, "Request Header Fields Too Large", str(exc)))
        except (TimeoutError, OSError, ValueError) as exc:
            log.info("front.connection_dropped", error=repr(exc))
        finally:
            if counted is not None and self.handshakes is not None:
                self.handshakes.leave(counted)  # handed over (its worker counts it), or ended
            if not held:
                conn.close()

    async def _hand_over(
        self, conn: socket.socket, line: bytes, clients: tuple[str, ...] | None = None
    ) -> bool:
        """Pass ``conn`` to the worker chosen for ``line`` (the next, if one turns out gone),
        counted for ``clients`` (the quotas' subjects it holds a place of); False,
        with a 503 written, when no worker lives."""
        loop = asyncio.get_running_loop()
        worker = self.choose(line)
        resuming = session_id_in(line)
        clients = clients or ()
        while worker is not None and worker.handoff is not None:
            handed = self.ledger.handed(worker.index, resuming, *clients)
            self._held[handed] = conn
            if line:
                self._lines[handed] = line
            try:
                await _send_fd(loop, worker, conn, pack("c", handed))
            except OSError as exc:  # the worker is gone: the supervisor will say so too
                log.error("front.worker_lost", worker=worker.index, error=repr(exc))
                self._held.pop(handed, None)
                self._lines.pop(handed, None)
                self.ledger.released(handed)
                worker.alive = False
                worker = self.choose(line)
                continue
            self.routed[worker.index] += 1
            return True
        self.refusals["no_worker"] += 1
        text = "no worker is running (one is being started again); retry shortly"
        with contextlib.suppress(OSError):
            conn.send(raw_http.refusal(503, "Service Unavailable", text, retry_after=1))
        return False

    async def _quota_allows(self, client: str, limit: int) -> bool:
        """Whether ``client`` may open another session now. At its quota, the releases the
        workers have sent are read at once, then waited for up to QUOTA_SETTLE_S: a client that
        closed a session and opened another at once was refused for a release its worker had
        sent and the front had not yet read (it reads reports in batches). The caller hands
        the connection over in the same step as a True answer, so one freed place admits one."""
        ledger = self.ledger
        if ledger.sessions_of(client) < limit:
            return True
        for worker in self.workers:
            if worker.alive and worker.handoff is not None:
                self._read_reports(worker)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + QUOTA_SETTLE_S
        while ledger.sessions_of(client) >= limit:
            left = deadline - loop.time()
            if left <= 0:
                return False
            if self._released is None:
                self._released = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._released.wait()
        return True

    async def _admit(self, counts: list[tuple[str, int, str]]) -> tuple[str, int, str] | None:
        """Whether a new session counted for each of ``counts`` (subject, limit, what) may be
        handed over now: None, or the count that refuses it. A wait for one subject's place
        lets others run, and one of them may take another subject's place meanwhile: so all are
        checked again, without a wait, before the answer (else a connection counted for its
        address and its key passed its address's quota by one)."""
        ledger = self.ledger
        while True:
            for count in counts:
                subject, limit, _ = count
                if not await self._quota_allows(subject, limit):
                    return count
            if all(ledger.sessions_of(subject) < limit for subject, limit, _ in counts):
                return None

    def _note_release(self) -> None:
        """A connection was released (or lost with its worker): wake what waits on a quota."""
        released = self._released
        if released is not None:
            self._released = None
            released.set()

    async def _read(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, line: bytes) -> FrontRequest:
        """``conn``'s request as its worker will read it, its head read where a count needs it."""
        return await read_request(
            loop,
            conn,
            line,
            path=self.path,
            wants_head=self._wants_head,
            keys=self.keys,
            trusted=self.trusted,
        )

    def _wants_head(self, new_session: bool, peer: str) -> bool:
        """Whether a realtime request's head must be read before it is handed over: for the
        key it presents (the per-key quota and connect rate count it, and with keys a worker
        answers one without 401 before it counts anything), and for the client a trusted proxy
        forwards when a per-address count needs to know it."""
        quota = self.session_quota
        counts_key = bool(self.keys) and (
            bool(self.connect_rates) or (new_session and quota is not None and quota.per_key is not None)
        )
        counts_address = "address" in self.connect_rates or (
            new_session and quota is not None and quota.limit is not None
        )
        return counts_key or (counts_address and self.trusted is not None and self.trusted(peer))

    def _rate_refusal(self, request: FrontRequest) -> bytes | None:
        """A 429 for a realtime request past its address's or its key's connect rate, as a
        worker answers it (http_gate.py: checked in that order, a refused one costs no token;
        with keys, one that presents none is the worker's to refuse with 401, uncounted)."""
        if not self.connect_rates or not request.realtime:
            return None
        if self.keys and request.key is None:
            return None
        now = self.clock()
        for by, rate in self.connect_rates.items():
            subject: object = request.client if by == "address" else request.key
            if subject is None:
                continue
            wait = rate.admit(subject, now)
            if wait > 0.0:
                self.refusals[f"connect_rate_{by}"] += 1
                retry = max(1, math.ceil(wait))
                text = f"too many new connections for this {by}; retry in {retry} s"
                count_refusal(f"front_connect_rate_{by}", request.client, text)
                return raw_http.refusal(429, "Too Many Requests", text, retry_after=retry)
        return None

    def _new_session_counts(self, request: FrontRequest) -> list[tuple[str, int, str]]:
        """Each quota a new session's connection counts in, as (subject, limit, what it
        counts): its client's, and its API key's."""
        quota = self.session_quota
        if quota is None or not request.new_session:
            return []
        counts: list[tuple[str, int, str]] = []
        if quota.limit is not None and not quota.exempt(request.address):
            counts.append((request.client, quota.limit, "address"))
        if quota.per_key is not None and request.key is not None:  # none: the worker says 401
            counts.append(("key:" + request.key.hex(), quota.per_key, "API key"))
        return counts

    # -- what the workers report ------------------------------------------------------------

    def listen_to(self, worker: _Worker) -> None:
        assert worker.handoff is not None
        asyncio.get_running_loop().add_reader(worker.handoff.fileno(), self._reports_waiting, worker)

    def _reports_waiting(self, worker: _Worker) -> None:
        """Reports wait in the socket for up to REPORT_BATCH_S, then are read together. Nothing
        needs them sooner: a dead worker's are read first (worker_exited), and a released
        duplicate may stay open that long. Read one by one, each report woke the front."""
        handoff = worker.handoff
        if handoff is None:
            return
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ValueError, OSError):
            loop.remove_reader(handoff.fileno())
        worker.reading = loop.call_later(REPORT_BATCH_S, self._read_batch, worker)

    def _read_batch(self, worker: _Worker) -> None:
        worker.reading = None
        handoff = worker.handoff
        if handoff is not None and self._read_reports(worker):
            asyncio.get_running_loop().add_reader(handoff.fileno(), self._reports_waiting, worker)

    def _read_reports(self, worker: _Worker) -> bool:
        """Apply every report waiting; False once the worker's end has closed."""
        handoff = worker.handoff
        if handoff is None:
            return False
        reset_told = False
        while True:
            try:
                packet = handoff.recv(4096)
            except BlockingIOError:
                return True
            except ConnectionResetError:
                # A worker that dies with packets of ours unread (a ping, a hand-off) leaves a
                # reset, which the kernel reports once, ahead of the reports it sent while alive:
                # those are still queued, and its clients' farewells are built from them.
                if reset_told:
                    packet = b""
                else:
                    reset_told = True
                    continue
            except OSError:
                packet = b""
            if not packet:  # the worker's end closed: it exited
                with contextlib.suppress(ValueError, OSError):
                    asyncio.get_running_loop().remove_reader(handoff.fileno())
                return False
            try:
                kind, *args = unpack(packet)
                if kind == "q":  # an answer to a ping: its loop turned
                    if worker.liveness is not None and args:
                        worker.liveness.answered(args[0], self.clock())
                    continue
                if kind == "s":
                    worker.draining = True
                    continue
                self._apply(kind, args)
            except (ValueError, TypeError) as exc:  # a bug in a report costs only that report
                log.error("front.bad_report", worker=worker.index, error=repr(exc))

    def _apply(self, kind: str, args: list[Any]) -> None:
        ledger = self.ledger
        if kind == "a":
            ledger.attached(int(args[0]), str(args[1]))
        elif kind == "h":
            ledger.answering(int(args[0]))
        elif kind == "r":
            ledger.response_started(str(args[0]), str(args[1]))
        elif kind == "d":
            ledger.response_ended(str(args[0]), str(args[1]))
        elif kind == "e":
            ledger.session_ended(str(args[0]))
        elif kind == "x":
            if ledger.released(int(args[0])):
                self._note_release()
            self._lines.pop(int(args[0]), None)
            sock = self._held.pop(int(args[0]), None)
            if sock is not None:
                sock.close()

    def worker_exited(self, worker: _Worker, *, crashed: bool) -> int:
        """``worker``'s process is gone: what it reported before it died is applied first; each
        connection it still held gets its farewell if it ``crashed`` (else, after a drain, it
        had closed them all and any left is closed). Returns how many were ended."""
        worker.alive = False
        if worker.reading is not None:
            worker.reading.cancel()
            worker.reading = None
        handoff = worker.handoff
        if handoff is not None:
            self._read_reports(worker)
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(handoff.fileno())
            handoff.close()
            worker.handoff = None
        # A connection the worker never read (handed while it hung, or just before it died)
        # is whole: another worker can serve it as if it had gone there first.
        for handed in self.ledger.unattached(worker.index):
            sock = self._held.get(handed)
            line = self._lines.get(handed)
            if sock is not None and line is not None and _unread(sock, line):
                clients = self.ledger.clients_of(handed)  # counted again where it goes
                self.ledger.released(handed)
                del self._held[handed], self._lines[handed]
                self.rerouted += 1
                self._spawn(self._hand_over_or_close(sock, line, clients), lasting=True)
        self._note_release()
        ended = 0
        for handed, frames in self.ledger.worker_lost(worker.index).items():
            self._lines.pop(handed, None)
            sock = self._held.pop(handed, None)
            if sock is None:
                continue
            ended += 1
            if crashed:
                self.lost_connections += 1
                self._spawn(_say_farewell(sock, b"" if self.tls else frames), lasting=True)
            else:
                sock.close()
        return ended

    async def _hand_over_or_close(
        self, conn: socket.socket, line: bytes, clients: tuple[str, ...] | None = None
    ) -> None:
        try:
            if await self._hand_over(conn, line, clients):
                return
        except OSError as exc:
            log.info("front.connection_dropped", error=repr(exc))
        conn.close()

    async def settle(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) for the work a worker's death set off: its exit notice,
        its clients' farewells, its unread connections going to another worker. Not for the
        connections still being routed: a client slow to send its request line would hold
        the shutdown."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # Again while new ones appear: an exit notice starts the farewells.
        while pending := {task for task in self._lasting if task is not asyncio.current_task()}:
            left = deadline - loop.time()
            if left <= 0:
                return
            await asyncio.wait(pending, timeout=left)

    def close_held(self) -> None:
        for sock in self._held.values():
            sock.close()
        self._held.clear()
        self._lines.clear()

    # -- whether the workers still run their loops (worker_liveness.py) ----------------------

    def ping(self, now: float, every_s: float = PING_PASS_S) -> list[_Worker]:
        """One pass of the pinger, which runs ``every_s``: ping each living worker that is due
        a ping; returns those silent past their ``hung_after_s`` (the caller stops them: this
        touches no process). A pass later than planned by more than FRONT_LATE_S means the
        front was not running: that time is forgiven (worker_liveness.py)."""
        away = time_away(self._pinged_at, now, every_s)
        self._pinged_at = now
        if away:
            log.warning("front.was_away", seconds=round(away, 2))
        hung = []
        for worker in self.workers:
            liveness = worker.liveness
            if not worker.alive or worker.handoff is None or liveness is None:
                continue
            liveness.forgive(away)
            if liveness.hung(now):
                hung.append(worker)
            elif liveness.ping_due(now):
                number = liveness.ping(now)
                try:
                    worker.handoff.send(pack("p", number))
                except BlockingIOError:
                    # Its hand-off socket is full: the worker is not reading it. The ping
                    # counts as sent, so that silence is measured from now.
                    pass
                except OSError:  # gone: its sentinel says so too
                    pass
        return hung

    def pool_news(self, engine_restarts: int, worker_restarts: list[int], engine_hangs: int = 0) -> bytes:
        return pack(
            "m",
            {
                "workers": len(self.workers),
                "alive": sum(1 for w in self.workers if w.alive),
                "restarts": {str(i): n for i, n in enumerate(worker_restarts)},
                "engine_restarts": engine_restarts,
                "engine_hangs": engine_hangs,
                "lost_connections": self.lost_connections,
                "hangs": {str(w.index): w.hangs for w in self.workers},
                "rerouted_connections": self.rerouted,
                "refused": dict(self.refusals),
            },
        )


async def _say_farewell(sock: socket.socket, frames: bytes) -> None:
    """Send a dead worker's client its farewell frames, end our side, and read what it still
    sends (its close frame) until it closes: closing a socket with unread bytes resets the
    connection, and the client's kernel may then drop the frames before the client reads them."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(FAREWELL_WAIT_S):
            view = memoryview(frames)
            while view:
                try:
                    view = view[sock.send(view) :]
                except BlockingIOError:
                    await wait_io(loop, sock, readable=False)
            sock.shutdown(socket.SHUT_WR)
            while True:
                try:
                    if not sock.recv(65536):
                        break
                except BlockingIOError:
                    await wait_io(loop, sock, readable=True)
    except (TimeoutError, OSError):
        pass
    finally:
        sock.close()


def _unread(sock: socket.socket, line: bytes) -> bool:
    """Whether ``sock``'s first unread bytes are still its request ``line``: its worker read
    nothing (a worker reads the request from its start, and a connection carries one request)."""
    try:
        return sock.recv(len(line), socket.MSG_PEEK | socket.MSG_DONTWAIT) == line
    except OSError:
        return False


async def _send_fd(
    loop: asyncio.AbstractEventLoop, worker: _Worker, conn: socket.socket, message: bytes
) -> None:
    """Pass ``conn`` over ``worker``'s hand-off socket, waiting while it is full. A full one
    may belong to a hung worker that the front then stops: the wait gives up (OSError) once
    the worker is no longer the living one it was."""
    handoff = worker.handoff
    if handoff is None:
        raise ConnectionError("the worker is gone")
    while True:
        try:
            socket.send_fds(handoff, [message], [conn.fileno()])
            return
        except BlockingIOError:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HANDOFF_RECHECK_S):
                    await wait_io(loop, handoff, readable=False)
            if not worker.alive or worker.handoff is not handoff:
                raise ConnectionError("the worker is gone") from None


__all__ = ["FrontDoor", "owner_of", "minted_by", "worker_session_id"]
