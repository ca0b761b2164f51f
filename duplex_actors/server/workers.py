"""``serve --workers N``: sessions sharded over N processes, one engine process for all of them.

Theory of operation
-------------------
Python runs one event loop per process, so one ``serve`` process uses one core for sessions,
JSON and websocket framing. ``--workers N`` runs:

* one **engine process** (:mod:`duplex_actors.engines.engine_process`): the only place the
  engine backend lives, so its batching spans every worker's sessions;
* N **worker processes**, each a full :class:`~duplex_actors.Runtime` plus
  :class:`~duplex_actors.server.RealtimeServer`, whose engine is an
  :class:`~duplex_actors.engines.engine_process.EngineProcessClient`. Worker *i* names its
  sessions ``sess_w<i>_<random>``, so the id itself says who owns a session;
* this **front process**, which owns the public port. It accepts a TCP connection, *peeks*
  (``MSG_PEEK``) at the HTTP request line without consuming a byte, picks a worker, and passes
  the socket to it over a Unix ``SOCK_SEQPACKET`` socket (``SCM_RIGHTS``). The worker then
  reads the whole upgrade request itself, so auth, the handshake and the session run exactly
  as in a single-process server; the front never touches a websocket frame.

Routing: a connection whose URL has ``?session_id=sess_w<i>g<n>_...`` (a resume) goes to
worker *i* while its process is still the *n*-th one started for that slot, because only it
holds that session's journal, lease and engine routes. Anything else (a new session,
``/health``, ``/metrics``, an id that names no worker, or a session of a worker process that
is gone) goes round-robin over the living workers; sessions are long-lived and alike, so
round-robin keeps the shards even without asking the workers for their load.
``SO_REUSEPORT`` alone cannot do this: the kernel would pick the worker, and a resume would
land on a process that does not have the session.

Supervision: the front keeps its own duplicate of every socket it hands over, and each worker
reports which session a connection carries and when responses start and end
(:mod:`.worker_link`). A worker process that dies (a crash, ``kill -9``) is noticed at once
(its process sentinel), and for each of its connections the front itself sends a failed
``response.done`` per response in flight, ``session.closed`` (``worker_lost``) and close code
1011 (:mod:`.front_ledger`); the sessions themselves are lost with the process's memory, and
a resume of one is refused at once with ``session_lost`` (4404) by whichever worker gets it.
The worker is started again (backoff 0.5 s doubling to 30 s while it keeps dying young), with
a new generation in the ids it mints. The engine process dying fails every in-flight turn
with ``response.done`` status ``failed`` (retryable), as any engine failure does, and is
started again too.

Drain: on SIGTERM the front stops accepting, and each worker drains as a single-process
server does (no new session or response, the ones in flight finish up to
``--drain-timeout-s``, then every session gets ``session.closed``); the front exits once the
last worker has.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs
import structlog

from ..logconfig import ensure_configured
from .front_ledger import FrontLedger
from .worker_link import FrontLink, pack, unpack

log = structlog.get_logger("duplex_actors.server.workers")

#: A session id minted by the ``n``-th process started as worker ``i``: ``sess_w3g0_9f2c...``.
#: The front routes resumes by it; a worker refuses one of another process as lost.
_OWNED_ID = re.compile(r"^sess_w(\d{1,4})g(\d{1,6})_[0-9a-f]+$")
#: The request line must arrive within this long after accept (slowloris guard in the front).
REQUEST_LINE_TIMEOUT_S = 10.0
#: A longer request line is not a websocket upgrade we serve.
MAX_REQUEST_LINE = 8192


#: A worker that dies within this long of its start is restarted after a growing backoff.
RESTART_BACKOFF_MIN_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 30.0
#: What the front gives a client of a dead worker to read its farewell frames, then closes.
FAREWELL_WAIT_S = 2.0
#: How long a worker's reports may wait in the hand-off socket before the front reads them.
REPORT_BATCH_S = 0.05


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


class _SessionIds:
    """Picklable ``Runtime(session_ids=...)`` for worker ``index``, generation ``generation``."""

    def __init__(self, index: int, generation: int = 0) -> None:
        self.index = index
        self.generation = generation

    def __call__(self) -> str:
        return worker_session_id(self.index, self.generation)


class _LostWithAnotherProcess:
    """``RealtimeServer.lost_session`` of worker (index, generation): an id minted by another
    worker process reached this one only because that process is gone (the front routes a
    resume to its owner while the owner lives), and with it the session."""

    def __init__(self, index: int, generation: int) -> None:
        self.me = (index, generation)

    def __call__(self, session_id: str) -> bool:
        owner = minted_by(session_id)
        return owner is not None and owner != self.me


@attrs.frozen(slots=True, kw_only=True)
class WorkerSettings:
    """Everything a worker process needs to build its runtime and server (crosses a spawn)."""

    engine: str = "scripted"
    model: str | None = None
    api_key: str | None = None
    limits: Any = None  # wire.WireLimits; Any so this module imports without the server extra
    session_overrides: dict = attrs.field(factory=dict)
    max_sessions: int = 10_000  # per worker
    max_connections: int = 10_000  # per worker
    #: Builds the backend in the engine process instead of ``engine``/``model`` (picklable: a
    #: module-level function). The benchmark uses it for an unpaced engine.
    engine_factory: Callable[[], Any] | None = None
    #: More ServerConfig fields for every worker (write timeout, admission quotas,
    #: compression...), as ``serve`` would set them in one process. Quotas count per worker.
    server_options: dict = attrs.field(factory=dict)
    #: More Runtime options (e.g. stall_timeout_s).
    runtime_options: dict = attrs.field(factory=dict)
    #: GcPolicy's reclaim interval, as ``serve --gc-reclaim-s`` (0: CPython's own collector).
    gc_reclaim_s: float = 30.0
    #: Recogniser processes per worker, as ``serve --transcription-workers``.
    transcription_workers: int = 1
    #: How long a worker lets responses in flight finish after SIGTERM (``--drain-timeout-s``).
    drain_timeout_s: float = 10.0

    def build_engine(self):
        if self.engine_factory is not None:
            return self.engine_factory()
        from .cli_commands import EngineChoice, build_engine

        return build_engine(EngineChoice(self.engine), self.model)


# --------------------------------------------------------------------------- child processes


def _become_child(name: str) -> None:
    """On Linux: name this process (``ps``, ``top`` and the benchmark show ``dx-worker0``,
    ``dx-engine``), and have the kernel SIGTERM it when the front dies, even by SIGKILL, so no
    worker or engine process outlives it. Elsewhere a no-op; the front's shutdown still stops
    its children."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
            libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the front died before the request took effect
            os._exit(1)


def _engine_main(settings: WorkerSettings, path: str, ready) -> None:
    _become_child("dx-engine")
    ensure_configured()  # a process of its own: its logging is set up as the front's is
    from ..engines.engine_process import serve_engine

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        try:
            await serve_engine(settings.build_engine, path, ready=lambda: ready.send(os.getpid()), stop=stop)
        finally:
            _ignore_stop_signals()

    asyncio.run(main())


def _worker_main(
    index: int, generation: int, settings: WorkerSettings, engine_path: str, handoff_path: str, ready
) -> None:
    _become_child(f"dx-worker{index}")
    ensure_configured()  # a process of its own: its logging is set up as the front's is
    asyncio.run(_run_worker(index, generation, settings, engine_path, handoff_path, ready))


async def _run_worker(
    index: int, generation: int, settings: WorkerSettings, engine_path: str, handoff_path: str, ready
) -> None:
    from ..actors.runtime import Runtime
    from ..core.session_config import SessionConfig
    from ..engines.engine_process import EngineProcessClient
    from .app import RealtimeServer, ServerConfig

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    log_ = log.bind(worker=index, generation=generation, pid=os.getpid())
    from ..actors.gc_policy import GcPolicy
    from ..audio.transcription import default_transcriber

    backend = EngineProcessClient(engine_path)
    # As single-process serve: a session that asks for input transcription gets it here too
    # (loaded lazily on its first transcribed turn; None without the 'transcription' extra).
    transcriber = default_transcriber(settings.transcription_workers)
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        api_key=settings.api_key,
        max_connections=settings.max_connections,
        **({"limits": settings.limits} if settings.limits is not None else {}),
        **settings.server_options,
    )
    # The same collector policy as single-process serve: without it a worker's full
    # collections ran on its loop (25-50 ms probe stalls at 40 live sessions).
    gc_policy = GcPolicy(reclaim_interval_s=settings.gc_reclaim_s) if settings.gc_reclaim_s > 0 else None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(handoff_path)
    os.chmod(handoff_path, 0o600)
    listener.listen(1)
    listener.setblocking(False)
    try:
        async with Runtime(
            backend,
            config=SessionConfig(**settings.session_overrides),
            max_sessions=settings.max_sessions,
            session_ids=_SessionIds(index, generation),
            transcriber=transcriber,
            gc_policy=gc_policy,
            **settings.runtime_options,
        ) as runtime:
            async with RealtimeServer(runtime, config) as server:
                server.lost_session = _LostWithAnotherProcess(index, generation)
                ready.send((os.getpid(), server.port))
                front, _ = await loop.sock_accept(listener)
                front.setblocking(False)
                server.front_link = FrontLink(front)
                receiving = asyncio.create_task(_receive_connections(front, server))
                stopping = asyncio.create_task(stop.wait())
                await asyncio.wait({receiving, stopping}, return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                if stop.is_set():
                    # SIGTERM: drain as single-process serve does. Sockets the front handed
                    # over meanwhile are still adopted (and refused: no new session).
                    log_.info("worker.draining")
                    await server.shutdown(settings.drain_timeout_s)
                receiving.cancel()
                log_.info("worker.stopping")
        # leaving the runtime closed every session with reason runtime_shutdown
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(handoff_path)
        await backend.aclose()
        if transcriber is not None:
            # This process ends with os._exit (multiprocessing's): no exit hook would stop the
            # recogniser's worker process, which outlived every worker that had transcribed.
            await asyncio.to_thread(transcriber.close, wait=True)
        _ignore_stop_signals()


def _ignore_stop_signals() -> None:
    # Our work is done; a SIGTERM from the parent arriving while asyncio.run tears the loop down
    # would otherwise hit a closed wakeup fd and print a traceback.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)


async def _receive_connections(front: socket.socket, server) -> None:
    """Adopt every socket the front passes, and take its news of the pool, until the front
    goes away."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            message, fds, _flags, _addr = socket.recv_fds(front, 4096, 1)
        except BlockingIOError:
            await _wait_io(loop, front, readable=True)
            continue
        if not message and not fds:
            return  # the front closed its end: it is shutting down
        try:
            kind, *args = unpack(message)
        except ValueError as exc:
            log.error("worker.bad_front_message", error=repr(exc))
            kind, args = "?", []
        if kind == "m" and args and isinstance(args[0], dict):
            server.metrics.set_pool(args[0])
        handed_id = args[0] if kind == "c" and args and isinstance(args[0], int) else None
        for fd in fds:
            sock = socket.socket(fileno=fd)
            sock.setblocking(False)
            try:
                await server.adopt(sock, handed_id)
            except Exception as exc:  # a connection that died in transit is only that one's loss
                log.warning("worker.adopt_failed", error=repr(exc))
                sock.close()
                if handed_id is not None and server.front_link is not None:
                    server.front_link.released(handed_id)


async def _wait_io(loop: asyncio.AbstractEventLoop, sock: socket.socket, *, readable: bool) -> None:
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    add, remove = (loop.add_reader, loop.remove_reader) if readable else (loop.add_writer, loop.remove_writer)
    add(sock.fileno(), wake)
    try:
        await ready
    finally:
        remove(sock.fileno())


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


class FrontDoor:
    """Owns the public port; hands each accepted connection to the worker that must serve it,
    keeps a duplicate of it, and ends it for the client if that worker dies (module docstring)."""

    def __init__(self, workers: list[_Worker], listener: socket.socket, *, farewells: bool = True) -> None:
        self.workers = workers
        self.listener = listener
        self._next = 0
        self.routed = [0] * len(workers)
        self.refused = 0
        self.ledger = FrontLedger()
        #: The front's duplicate of every socket a living worker holds, by hand-off id.
        self._held: dict[int, socket.socket] = {}
        #: Whether the front may write the farewell frames itself: not inside a worker's TLS
        #: session, whose keys died with it (those clients see the connection close).
        self.farewells = farewells
        #: Connections the front ended because their worker died.
        self.lost_connections = 0
        self._tasks: set[asyncio.Task] = set()

    def choose(self, request_line: bytes) -> _Worker | None:
        """The owner for a resume, while the process that minted the id lives; else the next
        living worker (which refuses a resume of a lost session at once); None if none lives."""
        parts = request_line.split(b" ")
        target = parts[1].decode("latin-1") if len(parts) >= 2 else ""
        session_ids = parse_qs(urlsplit(target).query).get("session_id")
        if session_ids:
            owner = minted_by(session_ids[0])
            if owner is not None and owner[0] < len(self.workers):
                worker = self.workers[owner[0]]
                if worker.alive and worker.generation == owner[1]:
                    return worker
        for _ in range(len(self.workers)):
            worker = self.workers[self._next % len(self.workers)]
            self._next += 1
            if worker.alive:
                return worker
        return None

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self.listener)
            except OSError as exc:  # out of descriptors, a reset before accept: keep serving
                log.warning("front.accept_failed", error=repr(exc))
                await asyncio.sleep(0.1)
                continue
            self._spawn(self._route(conn))

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _route(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        held = False
        try:
            conn.setblocking(False)
            async with asyncio.timeout(REQUEST_LINE_TIMEOUT_S):
                line = await _peek_request_line(loop, conn)
            if line is None:
                return
            worker = self.choose(line)
            while worker is not None and worker.handoff is not None:
                handed = self.ledger.handed(worker.index)
                self._held[handed] = conn
                try:
                    await _send_fd(loop, worker.handoff, conn, pack("c", handed))
                except OSError as exc:  # the worker is gone: the supervisor will say so too
                    log.error("front.worker_lost", worker=worker.index, error=repr(exc))
                    self._held.pop(handed, None)
                    self.ledger.released(handed)
                    worker.alive = False
                    worker = self.choose(line)
                    continue
                self.routed[worker.index] += 1
                held = True
                return
            self.refused += 1
            body = b"no worker is running (one is being started again); retry shortly\n"
            with contextlib.suppress(OSError):
                conn.send(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: 1\r\n"
                    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                )
        except (TimeoutError, OSError, ValueError) as exc:
            log.info("front.connection_dropped", error=repr(exc))
        finally:
            if not held:
                conn.close()

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
        while True:
            try:
                packet = handoff.recv(4096)
            except BlockingIOError:
                return True
            except OSError:
                packet = b""
            if not packet:  # the worker's end closed: it exited
                with contextlib.suppress(ValueError, OSError):
                    asyncio.get_running_loop().remove_reader(handoff.fileno())
                return False
            try:
                kind, *args = unpack(packet)
                self._apply(kind, args)
            except (ValueError, TypeError) as exc:  # a bug in a report costs only that report
                log.error("front.bad_report", worker=worker.index, error=repr(exc))

    def _apply(self, kind: str, args: list) -> None:
        ledger = self.ledger
        if kind == "a":
            ledger.attached(int(args[0]), str(args[1]))
        elif kind == "r":
            ledger.response_started(str(args[0]), str(args[1]))
        elif kind == "d":
            ledger.response_ended(str(args[0]), str(args[1]))
        elif kind == "e":
            ledger.session_ended(str(args[0]))
        elif kind == "x":
            ledger.released(int(args[0]))
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
        ended = 0
        for handed, frames in self.ledger.worker_lost(worker.index).items():
            sock = self._held.pop(handed, None)
            if sock is None:
                continue
            ended += 1
            if crashed:
                self.lost_connections += 1
                self._spawn(_say_farewell(sock, frames if self.farewells else b""))
            else:
                sock.close()
        return ended

    def close_held(self) -> None:
        for sock in self._held.values():
            sock.close()
        self._held.clear()

    def pool_news(self, engine_restarts: int, worker_restarts: list[int]) -> bytes:
        return pack(
            "m",
            {
                "workers": len(self.workers),
                "alive": sum(1 for w in self.workers if w.alive),
                "restarts": {str(i): n for i, n in enumerate(worker_restarts)},
                "engine_restarts": engine_restarts,
                "lost_connections": self.lost_connections,
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
                    await _wait_io(loop, sock, readable=False)
            sock.shutdown(socket.SHUT_WR)
            while True:
                try:
                    if not sock.recv(65536):
                        break
                except BlockingIOError:
                    await _wait_io(loop, sock, readable=True)
    except (TimeoutError, OSError):
        pass
    finally:
        sock.close()


async def _peek_request_line(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes | None:
    """The HTTP request line, read with MSG_PEEK so the worker still receives every byte."""
    seen = -1  # bytes buffered at the last peek that waited for more
    try:
        while True:
            try:
                data = conn.recv(MAX_REQUEST_LINE, socket.MSG_PEEK)
            except BlockingIOError:
                await _wait_io(loop, conn, readable=True)
                continue
            if not data:
                return None  # closed before sending anything
            end = data.find(b"\r\n")
            if end >= 0:
                return data[:end]
            if len(data) >= MAX_REQUEST_LINE:
                raise ValueError("request line too long")
            if len(data) == seen:
                return None  # readable with nothing new: the client closed mid-line
            seen = len(data)
            # Part of a line is buffered, and a peek leaves it there: the socket stays readable,
            # and waiting for readability would spin. So the kernel is asked to call it readable
            # only once more bytes than these have come (or the client is gone). Re-peeking
            # every 5 ms instead kept the front at a full core with 5,000 such connections
            # open (a slow-loris client: a request line without its end).
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, seen + 1)
            await _wait_io(loop, conn, readable=True)
    finally:
        if seen >= 0:
            with contextlib.suppress(OSError):
                # The worker gets the same socket: it must see each byte as it comes.
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)


async def _send_fd(
    loop: asyncio.AbstractEventLoop, handoff: socket.socket, conn: socket.socket, message: bytes
) -> None:
    while True:
        try:
            socket.send_fds(handoff, [message], [conn.fileno()])
            return
        except BlockingIOError:
            await _wait_io(loop, handoff, readable=False)


# --------------------------------------------------------------------------- the parent


class _EngineSupervisor:
    """Starts the engine process, and starts it again if it dies (the workers reconnect on
    their next turn; the turns that were in flight end as failed)."""

    def __init__(self, ctx, settings: WorkerSettings, path: str, startup_timeout_s: float) -> None:
        self.ctx = ctx
        self.settings = settings
        self.path = path
        self.startup_timeout_s = startup_timeout_s
        self.process: Any = None
        self.restarts = 0

    def spawn(self):
        """Start the process; returns the pipe its pid arrives on once its socket accepts.
        Call from the front's main thread: the child's parent-death signal is tied to the
        thread that started it."""
        ready, ready_send = self.ctx.Pipe(duplex=False)
        self.process = self.ctx.Process(
            target=_engine_main, args=(self.settings, self.path, ready_send), name="duplex-engine"
        )
        self.process.start()
        return ready

    def wait_ready(self, ready) -> int:
        if not ready.poll(self.startup_timeout_s):
            raise RuntimeError("the engine process did not start in time")
        return ready.recv()

    def start(self) -> int:
        return self.wait_ready(self.spawn())


class _WorkerSupervisor:
    """Starts the worker processes, and each again when it dies: at once if it had run a
    while, else after a backoff that doubles with each quick death (RESTART_BACKOFF_*)."""

    def __init__(
        self, ctx, settings: WorkerSettings, engine_path: str, folder: str, timeout_s: float
    ) -> None:
        self.ctx = ctx
        self.settings = settings
        self.engine_path = engine_path
        self.folder = folder
        self.startup_timeout_s = timeout_s
        self.pool: list[_Worker] = []
        self.restarts: list[int] = []
        self.stopping = False

    def spawn(self, worker: _Worker):
        """Start ``worker``'s process (from the main thread, as _EngineSupervisor.spawn says);
        returns the pipe its (pid, port) arrives on and its hand-off socket's path."""
        path = os.path.join(self.folder, f"worker{worker.index}g{worker.generation}.sock")
        receive, send = self.ctx.Pipe(duplex=False)
        worker.process = self.ctx.Process(
            target=_worker_main,
            args=(worker.index, worker.generation, self.settings, self.engine_path, path, send),
            name=f"duplex-worker-{worker.index}",
        )
        worker.process.start()
        worker.started_at = time.monotonic()
        return receive, path

    def wait_ready(self, worker: _Worker, receive, path: str) -> None:
        """Block until the worker's server runs, then connect its hand-off socket."""
        if not receive.poll(self.startup_timeout_s):
            raise RuntimeError(f"worker {worker.index} did not start in time")
        worker.pid, worker.port = receive.recv()
        handoff = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        handoff.connect(path)
        handoff.setblocking(False)
        worker.handoff = handoff
        worker.alive = True

    def start_all(self, workers: int) -> None:
        self.pool = [_Worker(index, None) for index in range(workers)]
        self.restarts = [0] * workers
        started = [(worker, *self.spawn(worker)) for worker in self.pool]
        for worker, receive, path in started:
            self.wait_ready(worker, receive, path)

    def backoff(self, worker: _Worker) -> float:
        """How long to wait before starting ``worker`` again, given how long it had run."""
        if time.monotonic() - worker.started_at >= STABLE_AFTER_S:
            worker.quick_deaths = 0
            return 0.0
        worker.quick_deaths += 1
        return min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_MIN_S * 2 ** (worker.quick_deaths - 1))

    async def restart(self, worker: _Worker, front: FrontDoor) -> bool:
        """Start ``worker`` again after its backoff; whether it runs (False: stopping, or it did
        not start, in which case the caller's next death notice tries again)."""
        delay = self.backoff(worker)
        log.warning(
            "front.worker_restarting", worker=worker.index, in_s=delay, quick_deaths=worker.quick_deaths
        )
        await asyncio.sleep(delay)
        if self.stopping:
            return False
        worker.generation += 1
        receive, path = self.spawn(worker)
        try:
            await asyncio.to_thread(self.wait_ready, worker, receive, path)
        except Exception as exc:  # the next try waits longer (it died young)
            log.error("front.worker_restart_failed", worker=worker.index, error=repr(exc))
            worker.process.kill()
            await asyncio.to_thread(worker.process.join, 5)
            return False
        if self.stopping:  # SIGTERM came while it started: it drains like the others
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGTERM)
        self.restarts[worker.index] += 1
        front.listen_to(worker)
        print(
            f"worker {worker.index} restarted pid={worker.pid} generation={worker.generation}",
            file=sys.stderr,
            flush=True,
        )
        return True


def serve_workers(
    workers: int,
    host: str,
    port: int,
    settings: WorkerSettings,
    *,
    startup_timeout_s: float = 60.0,
    on_ready: Callable[[int], None] | None = None,
) -> None:
    """Run the engine process, ``workers`` worker processes and the front until SIGINT/SIGTERM.
    ``on_ready(port)`` is called once the public port accepts connections."""
    ctx = multiprocessing.get_context("spawn")  # no forked copies of the parent's loop or threads
    folder = tempfile.mkdtemp(prefix="duplex-workers-")  # 0700: only we can reach the sockets
    engine = _EngineSupervisor(ctx, settings, os.path.join(folder, "engine.sock"), startup_timeout_s)
    supervisor = _WorkerSupervisor(ctx, settings, engine.path, folder, startup_timeout_s)
    try:
        engine_pid = engine.start()
        supervisor.start_all(workers)
        asyncio.run(_run_front(supervisor, host, port, settings, engine, engine_pid, on_ready))
    finally:
        _stop_children([worker.process for worker in supervisor.pool if worker.process], engine.process)
        shutil.rmtree(folder, ignore_errors=True)


async def _run_front(
    supervisor: _WorkerSupervisor,
    host: str,
    port: int,
    settings: WorkerSettings,
    engine: _EngineSupervisor,
    engine_pid: int,
    on_ready: Callable[[int], None] | None,
) -> None:
    pool = supervisor.pool
    ipv6 = ":" in host
    family = socket.AF_INET6 if ipv6 else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=1024)
    listener.setblocking(False)
    bound = listener.getsockname()[1]
    netloc = f"[{host}]:{bound}" if ipv6 else f"{host}:{bound}"
    front = FrontDoor(pool, listener, farewells=settings.server_options.get("tls_cert") is None)
    for worker in pool:
        front.listen_to(worker)
    auth = "on" if settings.api_key else "off"
    print(
        f"duplex-actors serving ws://{netloc}/v1/realtime (engine={settings.engine}, auth={auth}, "
        f"workers={len(pool)}); health http://{netloc}/health (answered by one worker)",
        flush=True,
    )
    for worker in pool:
        print(f"worker {worker.index} pid={worker.pid} ws://127.0.0.1:{worker.port}/v1/realtime", flush=True)
    print(f"engine pid={engine_pid} socket={engine.path}", flush=True)
    if on_ready is not None:
        on_ready(bound)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    def tell_pool() -> None:
        news = front.pool_news(engine.restarts, supervisor.restarts)
        for worker in pool:
            if worker.alive and worker.handoff is not None:
                with contextlib.suppress(OSError):
                    worker.handoff.send(news)

    async def on_worker_exit(worker: _Worker) -> None:
        process = worker.process
        process.join(0)  # reaps it, so exitcode is known
        # The sentinel closes as the process exits, a moment before it can be reaped: read as
        # "no exit code", a clean exit during a drain was taken for a crash (farewells sent).
        for _ in range(200):
            if process.exitcode is not None:
                break
            await asyncio.sleep(0.005)
            process.join(0)
        crashed = process.exitcode != 0 or not supervisor.stopping
        ended = front.worker_exited(worker, crashed=crashed)
        if supervisor.stopping and not crashed:
            return
        log.error(
            "front.worker_exited", worker=worker.index, exitcode=process.exitcode, connections_ended=ended
        )
        print(
            f"worker {worker.index} exited (exit code {process.exitcode}); {ended} connections ended",
            file=sys.stderr,
            flush=True,
        )
        tell_pool()
        while not supervisor.stopping:
            if await supervisor.restart(worker, front):
                watch(worker)
                tell_pool()
                return

    def watch(worker: _Worker) -> None:
        sentinel = worker.process.sentinel

        def exited() -> None:
            loop.remove_reader(sentinel)
            front._spawn(on_worker_exit(worker))

        loop.add_reader(sentinel, exited)

    for worker in pool:
        watch(worker)
    tell_pool()
    serving = asyncio.create_task(front.serve())
    watching = asyncio.create_task(_watch_engine(engine, tell_pool))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    failure = serving.exception() if serving.done() and not serving.cancelled() else None
    print("shutting down: draining the workers", file=sys.stderr, flush=True)
    supervisor.stopping = True
    serving.cancel()
    listener.close()
    # Each worker drains as single-process serve does; the front keeps reading their reports
    # (and closing the sockets they are done with) until the last one has exited.
    for worker in pool:
        if worker.alive and worker.process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGTERM)
    limit = settings.drain_timeout_s + float(settings.server_options.get("write_timeout_s", 10.0)) + 10.0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(limit):
            while any(worker.process.is_alive() for worker in pool):
                await asyncio.sleep(0.05)
    await asyncio.sleep(0)  # exit notices already due run before the sockets are let go
    for task in (watching, stopping):
        task.cancel()
    front.close_held()
    for worker in pool:
        if worker.handoff is not None:
            worker.handoff.close()
    if failure is not None:  # the front itself broke: say so (serve_workers still stops the children)
        raise failure


async def _watch_engine(engine: _EngineSupervisor, restarted: Callable[[], None]) -> None:
    """Start the engine process again if it exits (at most once a second)."""
    while True:
        if not engine.process.is_alive():
            log.error("front.engine_exited", exitcode=engine.process.exitcode)
            try:
                pid = await asyncio.to_thread(engine.wait_ready, engine.spawn())
                engine.restarts += 1
                print(f"engine restarted pid={pid}", file=sys.stderr, flush=True)
                restarted()
            except Exception as exc:  # try again on the next pass
                log.error("front.engine_restart_failed", error=repr(exc))
            await asyncio.sleep(1.0)
        await asyncio.sleep(0.5)


def _stop_children(workers: list[Any], engine: Any) -> None:
    # Workers first (they close their sessions, which aborts their engine requests), engine last.
    for group in (workers, [engine] if engine is not None else []):
        for process in group:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        for process in group:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(2)


__all__ = ["serve_workers", "WorkerSettings", "FrontDoor", "owner_of", "minted_by", "worker_session_id"]
