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

Routing: a connection whose URL has ``?session_id=sess_w<i>_...`` (a resume) goes to worker
*i*, because only it holds that session's journal, lease and engine routes. Anything else (a
new session, ``/health``, ``/metrics``, an id that names no worker) goes round-robin over the
living workers; sessions are long-lived and alike, so round-robin keeps the shards even
without asking the workers for their load. ``SO_REUSEPORT`` alone cannot do this: the kernel
would pick the worker, and a resume would land on a process that does not have the session.

Failure: a worker that dies loses its sessions (they were in its memory); its resumes get
HTTP 503 from the front and new sessions go to the other workers. The engine process dying
fails every in-flight turn with ``response.done`` status ``failed`` (retryable), as any
engine failure does.
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
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs
import structlog

log = structlog.get_logger("duplex_actors.server.workers")

#: A session id minted by worker i: ``sess_w3_9f2c...``. The front routes resumes by it.
_OWNED_ID = re.compile(r"^sess_w(\d{1,4})_[0-9a-f]+$")
#: The request line must arrive within this long after accept (slowloris guard in the front).
REQUEST_LINE_TIMEOUT_S = 10.0
#: A longer request line is not a websocket upgrade we serve.
MAX_REQUEST_LINE = 8192


def worker_session_id(index: int) -> str:
    return f"sess_w{index}_{secrets.token_hex(12)}"


def owner_of(session_id: str) -> int | None:
    """The worker index a session id names, or None for an id no worker minted."""
    match = _OWNED_ID.match(session_id)
    return int(match.group(1)) if match else None


class _SessionIds:
    """Picklable ``Runtime(session_ids=...)`` for worker ``index``."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self) -> str:
        return worker_session_id(self.index)


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


def _worker_main(index: int, settings: WorkerSettings, engine_path: str, handoff_path: str, ready) -> None:
    _become_child(f"dx-worker{index}")
    asyncio.run(_run_worker(index, settings, engine_path, handoff_path, ready))


async def _run_worker(
    index: int, settings: WorkerSettings, engine_path: str, handoff_path: str, ready
) -> None:
    from ..actors.runtime import Runtime
    from ..core.session_config import SessionConfig
    from ..engines.engine_process import EngineProcessClient
    from .app import RealtimeServer, ServerConfig

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    log_ = log.bind(worker=index, pid=os.getpid())
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
            session_ids=_SessionIds(index),
            transcriber=transcriber,
            gc_policy=gc_policy,
            **settings.runtime_options,
        ) as runtime:
            async with RealtimeServer(runtime, config) as server:
                ready.send((os.getpid(), server.port))
                front, _ = await loop.sock_accept(listener)
                front.setblocking(False)
                receiving = asyncio.create_task(_receive_connections(front, server))
                stopping = asyncio.create_task(stop.wait())
                await asyncio.wait({receiving, stopping}, return_when=asyncio.FIRST_COMPLETED)
                for task in (receiving, stopping):
                    task.cancel()
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
    """Adopt every socket the front passes, until the front goes away."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            message, fds, _flags, _addr = socket.recv_fds(front, 1, 1)
        except BlockingIOError:
            await _wait_io(loop, front, readable=True)
            continue
        if not message and not fds:
            return  # the front closed its end: it is shutting down
        for fd in fds:
            sock = socket.socket(fileno=fd)
            sock.setblocking(False)
            try:
                await server.adopt(sock)
            except Exception as exc:  # a connection that died in transit is only that one's loss
                log.warning("worker.adopt_failed", error=repr(exc))
                sock.close()


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


@attrs.define
class _Worker:
    index: int
    process: Any
    pid: int = 0
    port: int = 0
    handoff: socket.socket | None = None
    alive: bool = True


class FrontDoor:
    """Owns the public port; hands each accepted connection to the worker that must serve it."""

    def __init__(self, workers: list[_Worker], listener: socket.socket) -> None:
        self.workers = workers
        self.listener = listener
        self._next = 0
        self.routed = [0] * len(workers)
        self.refused = 0

    def choose(self, request_line: bytes) -> _Worker | None:
        """The owner for a resume, else the next living worker; None if none can take it."""
        parts = request_line.split(b" ")
        target = parts[1].decode("latin-1") if len(parts) >= 2 else ""
        session_id = (parse_qs(urlsplit(target).query).get("session_id") or [None])[0]
        if session_id is not None:
            owner = owner_of(session_id)
            if owner is not None and owner < len(self.workers):
                worker = self.workers[owner]
                return worker if worker.alive else None
        for _ in range(len(self.workers)):
            worker = self.workers[self._next % len(self.workers)]
            self._next += 1
            if worker.alive:
                return worker
        return None

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task] = set()
        while True:
            try:
                conn, _ = await loop.sock_accept(self.listener)
            except OSError as exc:  # out of descriptors, a reset before accept: keep serving
                log.warning("front.accept_failed", error=repr(exc))
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._route(conn))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _route(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            conn.setblocking(False)
            async with asyncio.timeout(REQUEST_LINE_TIMEOUT_S):
                line = await _peek_request_line(loop, conn)
            if line is None:
                return
            worker = self.choose(line)
            while worker is not None:
                try:
                    await _send_fd(loop, worker.handoff, conn)
                    self.routed[worker.index] += 1
                    return
                except OSError as exc:  # the worker is gone: only its own sessions are lost
                    log.error("front.worker_lost", worker=worker.index, error=repr(exc))
                    worker.alive = False
                    worker = None if b"session_id=" in line else self.choose(line)
            self.refused += 1
            body = b"the worker that owns this session is gone, or no worker is running\n"
            with contextlib.suppress(OSError):
                conn.send(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
                    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                )
        except (TimeoutError, OSError, ValueError) as exc:
            log.info("front.connection_dropped", error=repr(exc))
        finally:
            conn.close()  # the worker holds its own duplicate of the socket


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


async def _send_fd(loop: asyncio.AbstractEventLoop, handoff: socket.socket, conn: socket.socket) -> None:
    while True:
        try:
            socket.send_fds(handoff, [b"c"], [conn.fileno()])
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
    pool: list[_Worker] = []
    try:
        engine_pid = engine.start()
        pipes = []
        for index in range(workers):
            handoff_path = os.path.join(folder, f"worker{index}.sock")
            receive, send = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=_worker_main,
                args=(index, settings, engine.path, handoff_path, send),
                name=f"duplex-worker-{index}",
            )
            process.start()
            pool.append(_Worker(index, process))
            pipes.append((receive, handoff_path))
        for worker, (receive, handoff_path) in zip(pool, pipes):
            if not receive.poll(startup_timeout_s):
                raise RuntimeError(f"worker {worker.index} did not start in time")
            worker.pid, worker.port = receive.recv()
            handoff = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            handoff.connect(handoff_path)
            handoff.setblocking(False)
            worker.handoff = handoff
        asyncio.run(_run_front(pool, host, port, settings, engine, engine_pid, on_ready))
    finally:
        _stop_children([worker.process for worker in pool], engine.process)
        shutil.rmtree(folder, ignore_errors=True)


async def _run_front(
    pool: list[_Worker],
    host: str,
    port: int,
    settings: WorkerSettings,
    engine: _EngineSupervisor,
    engine_pid: int,
    on_ready: Callable[[int], None] | None,
) -> None:
    ipv6 = ":" in host
    family = socket.AF_INET6 if ipv6 else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=1024)
    listener.setblocking(False)
    bound = listener.getsockname()[1]
    netloc = f"[{host}]:{bound}" if ipv6 else f"{host}:{bound}"
    front = FrontDoor(pool, listener)
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
    serving = asyncio.create_task(front.serve())
    watching = asyncio.create_task(_watch_children(pool, engine))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    print("shutting down", file=sys.stderr, flush=True)
    failed = serving.done() and not serving.cancelled() and serving.exception() is not None
    for task in (serving, watching, stopping):
        task.cancel()
    listener.close()
    for worker in pool:
        if worker.handoff is not None:
            worker.handoff.close()
    if failed:  # the front itself broke: say so (serve_workers still stops the children)
        raise serving.exception()


async def _watch_children(pool: list[_Worker], engine: _EngineSupervisor) -> None:
    """Mark a worker dead as soon as its process exits, so new sessions skip it; start the
    engine process again if it exits (at most once a second)."""
    while True:
        for worker in pool:
            if worker.alive and not worker.process.is_alive():
                worker.alive = False
                log.error("front.worker_exited", worker=worker.index, exitcode=worker.process.exitcode)
        if not engine.process.is_alive():
            log.error("front.engine_exited", exitcode=engine.process.exitcode)
            try:
                pid = await asyncio.to_thread(engine.wait_ready, engine.spawn())
                engine.restarts += 1
                print(f"engine restarted pid={pid}", file=sys.stderr, flush=True)
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


__all__ = ["serve_workers", "WorkerSettings", "FrontDoor", "owner_of", "worker_session_id"]
