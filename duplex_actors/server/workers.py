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

A worker that *hangs* (alive, its loop stuck) is found by pings (:mod:`.worker_liveness`):
after 2 s without an answer new connections go to the other workers; after
``--worker-timeout-s`` (10 s) the front stops it (SIGABRT, so its stacks go to stderr, then
SIGKILL) and its death is handled as above. A connection handed to a worker that died or was
stopped before reading a byte of it goes to another worker instead of being ended. The engine
process is pinged too, over its own channel, and stopped after ``--engine-timeout-s`` (30 s).

Drain: on SIGTERM the front stops accepting, and each worker drains as a single-process
server does (no new session or response, the ones in flight finish up to
``--drain-timeout-s``, then every session gets ``session.closed``); the front exits once the
last worker has.

Layout: this module holds the settings, what runs in the worker and engine processes, and the
front's main (:func:`serve_workers`); :mod:`.front_door` routes connections and says farewell
for a dead worker; :mod:`.supervisors` starts the children and starts them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import structlog

from ..audio.transcription import IDLE_UNLOAD_S
from ..logconfig import ensure_configured
from ..parent_death import end_with_parent
from .config import ServerConfig
from .event_loop import resolve as resolve_loop
from .event_loop import run as run_loop
from .front_door import (
    FAREWELL_WAIT_S,
    PING_PASS_S,
    FrontDoor,
    SessionQuota,
    _Worker,
    minted_by,
    owner_of,
    worker_session_id,
)
from .front_request import wait_io
from .guard import PendingHandshakes, connect_rates, exempt_from
from .lossy_output import make_output_lossy
from .stop_requests import STOP_SIGNALS, StopRequests
from .supervisors import (
    _EngineSupervisor,
    _stop_children,
    _watch_engine,
    _WorkerSupervisor,
    stop_hung_process,
)
from .worker_link import FrontLink, pack, unpack
from .worker_liveness import ENGINE_HUNG_AFTER_S, HUNG_AFTER_S

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from ..engines.base import EngineBackend
    from .app import RealtimeServer

log = structlog.get_logger("duplex_actors.server.workers")


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


class _RelayRoutes:
    """``RealtimeServer.relay_path`` of worker ``index`` under TLS: the relay socket of the worker
    that minted a session id, when that is another worker (tls_relay.py)."""

    def __init__(self, index: int, folder: str) -> None:
        self.index = index
        self.folder = folder

    def __call__(self, session_id: str | None) -> str | None:
        owner = None if session_id is None else minted_by(session_id)
        if owner is None or owner[0] == self.index:
            return None
        return relay_socket(self.folder, owner[0])


def relay_socket(folder: str, index: int) -> str:
    """Where worker ``index`` (any generation) takes connections relayed to it under TLS."""
    return os.path.join(folder, f"relay{index}.sock")


@attrs.frozen(slots=True, kw_only=True)
class WorkerSettings:
    """Everything a worker process needs to build its runtime and server (crosses a spawn)."""

    engine: str = "scripted"
    model: str | None = None
    #: ``serve --scripted-pace``: the scripted engine's latencies, stretched.
    scripted_pace: float = 1.0
    api_key: str | None = None
    limits: Any = None  # wire.WireLimits; Any so this module imports without the server extra
    session_overrides: dict[str, Any] = attrs.field(factory=dict)
    max_sessions: int = 10_000  # per worker
    max_connections: int = 10_000  # per worker
    #: Builds the backend in the engine process instead of ``engine``/``model`` (picklable: a
    #: module-level function). The benchmark uses it for an unpaced engine.
    engine_factory: Callable[[], EngineBackend] | None = None
    #: More ServerConfig fields for every worker (write timeout, admission quotas,
    #: compression...), as ``serve`` would set them in one process. Each worker counts its
    #: own quotas; the front counts the per-client and per-key sessions and the connect rates
    #: over all of them (FrontDoor).
    server_options: dict[str, Any] = attrs.field(factory=dict)
    #: More Runtime options (e.g. stall_timeout_s).
    runtime_options: dict[str, Any] = attrs.field(factory=dict)
    #: GcPolicy's reclaim interval, as ``serve --gc-reclaim-s`` (0: CPython's own collector).
    gc_reclaim_s: float = 30.0
    #: Recogniser decodes at once per worker, as ``serve --transcription-workers`` (0: none).
    transcription_workers: int = 1
    #: Seconds unused before a worker lets its recogniser go, as ``serve
    #: --transcription-idle-s`` (0: kept for good).
    transcription_idle_s: float = IDLE_UNLOAD_S
    #: How long a worker lets responses in flight finish after SIGTERM (``--drain-timeout-s``).
    drain_timeout_s: float = 10.0
    #: A worker that answers none of the front's pings this long is stopped and started again
    #: (``--worker-timeout-s``; 0: never; worker_liveness.py).
    worker_timeout_s: float = HUNG_AFTER_S
    #: The same for the engine process, whose loop answers the front's ``stats`` requests
    #: (``--engine-timeout-s``; 0: never).
    engine_timeout_s: float = ENGINE_HUNG_AFTER_S
    #: The event loop every process of the tree runs (``serve --loop``; event_loop.py).
    event_loop: str = "auto"

    @property
    def drain_limit_s(self) -> float:
        """How long a drain may take in all: responses finishing, the closing events written
        (``write_timeout_s``), and a margin. The front waits this long for its workers, and
        the engine process stays at most this long for theirs."""
        return self.drain_timeout_s + float(self.server_options.get("write_timeout_s", 10.0)) + 10.0

    @property
    def tls(self) -> bool:
        """Whether the workers serve TLS (each terminates it itself: tls_relay.py)."""
        return self.server_options.get("tls_cert") is not None

    @property
    def worker_options(self) -> dict[str, Any]:
        """``server_options`` as a worker applies them: without TLS the front counts the
        connect rates over every worker (FrontDoor.connect_rates), so a worker counting them
        too would charge each connection twice."""
        if self.tls:
            return self.server_options
        return {**self.server_options, "connect_rate_per_address": None, "connect_rate_per_key": None}

    def build_engine(self) -> EngineBackend:
        if self.engine_factory is not None:
            return self.engine_factory()
        from .cli_commands import EngineChoice, build_engine

        return build_engine(EngineChoice(self.engine), self.model, scripted_pace=self.scripted_pace)


# --------------------------------------------------------------------------- child processes


#: What the kernel sends a worker or the engine process when the front dies, even by SIGKILL
#: (parent_death.py): a drain, as SIGTERM asks, but never counted as an operator's signal. The
#: kernel may send it several times in a row (once per thread of the front as they exit); as
#: SIGTERM, the second was taken for an operator's second signal and cut the drain short, so
#: the responses in flight ended cancelled.
FRONT_GONE_SIGNAL = signal.SIGUSR2
#: Every signal a worker or the engine process takes as "stop": an operator's and the front's death.
_CHILD_STOP_SIGNALS = (*STOP_SIGNALS, FRONT_GONE_SIGNAL)


def _become_child(name: str) -> None:
    """Name this process (Linux: ``ps``, ``top`` and the benchmark show ``dx-worker0``,
    ``dx-engine``), and have the kernel send it FRONT_GONE_SIGNAL when the front dies, so no
    worker or engine process outlives it (until it handles the signal, the signal ends it).
    Elsewhere the front's shutdown still stops its children, and a worker also sees the front's
    end of its hand-off socket close."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    front = multiprocessing.parent_process()
    if front is not None and front.pid is not None:
        end_with_parent(FRONT_GONE_SIGNAL, front.pid)
    make_output_lossy()  # its output is the front's: lost together, and survived alike
    # A crash in a C extension, or the front's SIGABRT to a hung worker, then says on stderr
    # where each thread was.
    faulthandler.enable()


def _engine_main(settings: WorkerSettings, path: str, ready: Connection[int, Any]) -> None:
    _become_child("dx-engine")
    ensure_configured()  # a process of its own: its logging is set up as the front's is
    from ..engines.engine_process import serve_engine

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in _CHILD_STOP_SIGNALS:
            loop.add_signal_handler(signum, stop.set)
        try:
            # Stopped with the workers (every process got the signal), it stays while they are
            # connected, draining; the front stops it once they have exited, when none is.
            await serve_engine(
                settings.build_engine,
                path,
                ready=lambda: ready.send(os.getpid()),
                stop=stop,
                linger_s=settings.drain_limit_s,
            )
        finally:
            _ignore_stop_signals()
            _remove_folder_if_front_gone(os.path.dirname(path))

    run_loop(main(), settings.event_loop)


def _worker_main(
    index: int,
    generation: int,
    settings: WorkerSettings,
    engine_path: str,
    handoff_path: str,
    ready: Connection[tuple[int, int], Any],
) -> None:
    _become_child(f"dx-worker{index}")
    ensure_configured()  # a process of its own: its logging is set up as the front's is
    run_loop(_run_worker(index, generation, settings, engine_path, handoff_path, ready), settings.event_loop)


async def _run_worker(
    index: int,
    generation: int,
    settings: WorkerSettings,
    engine_path: str,
    handoff_path: str,
    ready: Connection[tuple[int, int], Any],
) -> None:
    from ..actors.runtime import Runtime
    from ..core.session_config import SessionConfig
    from ..engines.engine_process import EngineProcessClient
    from .app import RealtimeServer

    loop = asyncio.get_running_loop()
    # Its own signals (a Ctrl-C or a systemd stop reaches every process of the tree; a SIGTERM
    # to its pid recycles it) and the front's word (["d"], ["h"]) ask the same: drain, then
    # cut the drain short.
    requests = StopRequests()
    requests.install(loop)
    stop = requests.stop
    loop.add_signal_handler(FRONT_GONE_SIGNAL, stop.set)  # a drain, however many times it comes
    log_ = log.bind(worker=index, generation=generation, pid=os.getpid())
    from ..actors.gc_policy import GcPolicy
    from ..audio.transcription import default_transcriber

    backend = EngineProcessClient(engine_path)
    # As single-process serve: a session that asks for input transcription gets it here too
    # (loaded lazily on its first transcribed turn, let go when idle; None without the extra).
    transcriber = default_transcriber(
        settings.transcription_workers, idle_unload_s=settings.transcription_idle_s or None
    )
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        api_key=settings.api_key,
        max_connections=settings.max_connections,
        **({"limits": settings.limits} if settings.limits is not None else {}),
        **settings.worker_options,
    )
    # The same collector policy as single-process serve: without it a worker's full
    # collections run on its loop and stall every session it serves.
    gc_policy = GcPolicy(reclaim_interval_s=settings.gc_reclaim_s) if settings.gc_reclaim_s > 0 else None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(handoff_path)
    os.chmod(handoff_path, 0o600)
    listener.listen(1)
    listener.setblocking(False)
    folder = os.path.dirname(handoff_path)
    receiving: asyncio.Task[None] | None = None
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
                requests.on_hurry(server.hurry)
                server.lost_session = _LostWithAnotherProcess(index, generation)
                if settings.tls:
                    # The front cannot read an encrypted request line: a resume may reach any
                    # worker, which relays it here if the session is ours (tls_relay.py).
                    relay_path = relay_socket(folder, index)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(relay_path)  # left by this slot's previous process, if it died
                    await server.serve_relays(relay_path)
                    server.relay_path = _RelayRoutes(index, folder)
                ready.send((os.getpid(), server.port))
                front, _ = await loop.sock_accept(listener)
                front.setblocking(False)
                server.front_link = FrontLink(front)
                receiving = asyncio.create_task(_receive_connections(front, server, stop))
                stopping = asyncio.create_task(stop.wait())
                await asyncio.wait({receiving, stopping}, return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                if not stop.is_set():
                    # The front closed its end without a word: it died (killed, crashed; a
                    # front that stops tells its workers first). Its clients are still this
                    # worker's, so it drains for them as if told to. The kernel's
                    # FRONT_GONE_SIGNAL may come a moment later or, off Linux, not at all.
                    log_.warning("worker.front_gone")
                # Drain as single-process serve does. Sockets the front handed over meanwhile
                # are still adopted (and refused: no new session).
                log_.info("worker.draining")
                # For a SIGTERM to this worker alone (in the front's own drain, routing has
                # stopped already): without it, every other new client got a 503 from it while
                # the other workers had room.
                server.front_link.draining()
                await server.shutdown(settings.drain_timeout_s)
                # Receiving goes on until this process ends: it answers the front's pings,
                # and a worker silent while it closes down would be stopped as hung.
                log_.info("worker.stopping")
        # leaving the runtime closed every session with reason runtime_shutdown
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(handoff_path)
        if settings.tls:
            with contextlib.suppress(OSError):
                # Its slot's next process starts once this one has exited (a killed front's
                # folder is then left empty, and removed below).
                os.unlink(relay_socket(folder, index))
        await backend.aclose()
        if transcriber is not None:
            # This process ends with os._exit (multiprocessing's): no exit hook would stop the
            # recogniser's worker process, which outlived every worker that had transcribed.
            await asyncio.to_thread(transcriber.close, wait=True)
        if receiving is not None:
            receiving.cancel()
        _ignore_stop_signals()
        _remove_folder_if_front_gone(folder)


def _remove_folder_if_front_gone(folder: str) -> None:
    """The front removes the server's socket folder as it exits; a front killed (SIGKILL) left
    it in the temporary directory, one for each such death. Its children then remove it: each
    as it exits once its own socket is gone, which succeeds for the last one out (rmdir: only
    an empty folder). Never while the front lives, which starts children in that folder."""
    front = multiprocessing.parent_process()
    if front is not None and os.getppid() != front.pid:
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def _ignore_stop_signals() -> None:
    # Our work is done; a SIGTERM from the parent arriving while asyncio.run tears the loop down
    # would otherwise hit a closed wakeup fd and print a traceback, and a late FRONT_GONE_SIGNAL
    # would end the process by its default action.
    for signum in _CHILD_STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


async def _receive_connections(front: socket.socket, server: RealtimeServer, stop: asyncio.Event) -> None:
    """Adopt every socket the front passes, and take its news of the pool and its word to
    drain (``["d"]``: ``stop``) or to cut the drain short (``["h"]``), until the front goes
    away. Each socket is adopted by a task of its own: under TLS adopting one waits for its
    client's TLS handshake, which must not hold up the connections handed over after it."""
    loop = asyncio.get_running_loop()
    adopting: set[asyncio.Task[None]] = set()
    while True:
        try:
            message, fds, _flags, _addr = socket.recv_fds(front, 4096, 1)
        except BlockingIOError:
            await wait_io(loop, front, readable=True)
            continue
        if not message and not fds:
            return  # the front closed its end: it is shutting down
        try:
            kind, *args = unpack(message)
        except ValueError as exc:
            log.error("worker.bad_front_message", error=repr(exc))
            kind, args = "?", []
        if kind == "p" and args and server.front_link is not None:
            server.front_link.answer_ping(args[0])  # from this loop: it still turns
        elif kind == "m" and args and isinstance(args[0], dict):
            server.metrics.set_pool(args[0])
        elif kind == "d":
            stop.set()
        elif kind == "h":
            server.hurry()
        handed_id = args[0] if kind == "c" and args and isinstance(args[0], int) else None
        for fd in fds:
            sock = socket.socket(fileno=fd)
            sock.setblocking(False)
            task = loop.create_task(_adopt(server, sock, handed_id))
            adopting.add(task)
            task.add_done_callback(adopting.discard)


async def _adopt(server: RealtimeServer, sock: socket.socket, handed_id: int | None) -> None:
    try:
        await server.adopt(sock, handed_id)
    except Exception as exc:  # a connection that died in transit (or in its TLS handshake)
        log.warning("worker.adopt_failed", error=repr(exc))
        sock.close()
        if handed_id is not None and server.front_link is not None:
            server.front_link.released(handed_id)


# --------------------------------------------------------------------------- the parent


def _session_quota(edge: ServerConfig, keys: tuple[str, ...]) -> SessionQuota | None:
    """The quotas the front keeps over every worker, as a worker keeps them: per client, the
    explicit ``max_sessions_per_address`` (exempt networks counted, as a worker counts them) or
    else the default one (not counting them); per API key (of ``keys``),
    ``max_sessions_per_key``. None when none is set."""
    per_key = edge.max_sessions_per_key if keys else None
    if edge.max_sessions_per_address is not None:
        limit: int | None = edge.max_sessions_per_address
        exempt = exempt_from(())  # an explicit limit counts every client, as a worker does
    else:
        limit = edge.default_sessions_per_address
        exempt = exempt_from(edge.exempt_networks)
    if limit is None and per_key is None:
        return None
    return SessionQuota(limit, exempt, per_key=per_key)


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
    engine = _EngineSupervisor(
        ctx, settings, os.path.join(folder, "engine.sock"), startup_timeout_s, main=_engine_main
    )
    supervisor = _WorkerSupervisor(ctx, settings, engine.path, folder, startup_timeout_s, main=_worker_main)
    try:
        engine_pid = engine.start()
        supervisor.start_all(workers)
        run_loop(
            _run_front(supervisor, host, port, settings, engine, engine_pid, on_ready), settings.event_loop
        )
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
    # The same queue a single-process serve listens with (ServerConfig.listen_backlog): the
    # front takes each connection at once, but a mass reconnect arrives all together.
    backlog = attrs.fields(ServerConfig).listen_backlog.default
    listener = socket.create_server((host, port), family=family, backlog=backlog)
    listener.setblocking(False)
    bound = listener.getsockname()[1]
    netloc = f"[{host}]:{bound}" if ipv6 else f"{host}:{bound}"
    tls = settings.tls
    # The limits a worker puts on connections in their handshake, on those the front holds
    # while it reads their request line (ServerConfig's defaults, or serve's flags).
    edge = ServerConfig(**settings.server_options)
    keys = ((settings.api_key,) if settings.api_key else ()) + edge.api_keys
    front = FrontDoor(
        pool,
        listener,
        tls=tls,
        handshakes=PendingHandshakes(
            per_address=edge.max_handshakes_per_address,
            total=edge.max_handshakes,
            exempt=exempt_from(edge.exempt_networks + edge.trusted_proxies),
        ),
        session_quota=_session_quota(edge, keys),
        # Under TLS the front reads no request: each worker keeps its own rates then.
        connect_rates=None if tls else connect_rates(edge),
        path=edge.path,
        keys=keys,
        trusted=exempt_from(edge.trusted_proxies) if edge.trusted_proxies else None,
    )
    for worker in pool:
        front.listen_to(worker)
    auth = "on" if settings.api_key else "off"
    ws, http = ("wss", "https") if tls else ("ws", "http")
    print(
        f"duplex-actors serving {ws}://{netloc}/v1/realtime (engine={settings.engine}, auth={auth}, "
        f"workers={len(pool)}, loop={resolve_loop(settings.event_loop).value}); health {http}://{netloc}/health (answered by one worker)",
        flush=True,
    )
    for worker in pool:
        print(
            f"worker {worker.index} pid={worker.pid} {ws}://127.0.0.1:{worker.port}/v1/realtime", flush=True
        )
    print(f"engine pid={engine_pid} socket={engine.path}", flush=True)
    if on_ready is not None:
        on_ready(bound)
    loop = asyncio.get_running_loop()
    requests = StopRequests()
    requests.install(loop)
    stop = requests.stop
    loop.add_signal_handler(FRONT_GONE_SIGNAL, stop.set)  # a drain, however many times it comes

    def tell_workers(kind: str) -> None:
        """``["d"]`` (drain) or ``["h"]`` (cut the drain short) to each living worker, or
        SIGTERM where its hand-off socket will not take the message (full: a hung worker)."""
        for worker in pool:
            if not (worker.alive and worker.process.is_alive()):
                continue
            try:
                if worker.handoff is None:
                    raise ConnectionError("no hand-off socket")
                worker.handoff.send(pack(kind))
            except OSError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGTERM)

    def tell_pool() -> None:
        news = front.pool_news(engine.restarts, supervisor.restarts, engine.hangs)
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
        recycled = worker.recycled
        (log.info if recycled else log.error)(
            "front.worker_exited", worker=worker.index, exitcode=process.exitcode, connections_ended=ended
        )
        how = (
            "drained and exited (SIGTERM to its pid)"
            if recycled
            else f"exited (exit code {process.exitcode})"
        )
        print(f"worker {worker.index} {how}; {ended} connections ended", file=sys.stderr, flush=True)
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
            front._spawn(on_worker_exit(worker), lasting=True)

        loop.add_reader(sentinel, exited)

    def stop_hung(worker: _Worker) -> None:
        """``worker`` answered no ping for ``--worker-timeout-s``: no connection, not even a
        resume, goes to it any more, and it is stopped (its exit is then on_worker_exit's)."""
        silent = 0.0 if worker.liveness is None else worker.liveness.silence(front.clock())
        worker.liveness = None  # stopped once
        worker.alive = False
        worker.hangs += 1
        stop_hung_process(worker.process, f"worker {worker.index}", silent, "--worker-timeout-s")

    async def watch_liveness() -> None:
        # On during a drain too: a hung worker would otherwise hold the front for the drain's
        # whole limit, and its clients would never be told.
        told = dict(front.refusals)
        while True:
            for worker in front.ping(front.clock()):
                stop_hung(worker)
            if front.refusals != told:  # the workers' /metrics show the front's refusals
                told = dict(front.refusals)
                tell_pool()
            await asyncio.sleep(PING_PASS_S)

    for worker in pool:
        watch(worker)
    tell_pool()
    serving = asyncio.create_task(front.serve())
    watching = asyncio.create_task(
        _watch_engine(engine, tell_pool, hung_after_s=settings.engine_timeout_s or None)
    )
    pinging = asyncio.create_task(watch_liveness())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    failure = serving.exception() if serving.done() and not serving.cancelled() else None
    print("shutting down: draining the workers", file=sys.stderr, flush=True)
    supervisor.stopping = True
    serving.cancel()
    listener.close()
    # Each worker drains as single-process serve does; the front keeps reading their reports
    # (and closing the sockets they are done with) until the last one has exited. Told by a
    # message, not a signal: after a Ctrl-C or a systemd stop, which reach every process, a
    # SIGTERM from here would be a worker's second, which cuts its drain short.
    tell_workers("d")
    requests.on_hurry(lambda: tell_workers("h"))
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(settings.drain_limit_s):
            while any(worker.process.is_alive() for worker in pool):
                await asyncio.sleep(0.05)
    await asyncio.sleep(0)  # exit notices already due run before the sockets are let go
    # A worker stopped as hung during the drain has clients to tell (its exit notice waits up
    # to a second for the exit code, then the farewells up to FAREWELL_WAIT_S).
    await front.settle(FAREWELL_WAIT_S + 2.0)
    for task in (watching, stopping, pinging):
        task.cancel()
    front.close_held()
    for worker in pool:
        if worker.handoff is not None:
            worker.handoff.close()
    if failure is not None:  # the front itself broke: say so (serve_workers still stops the children)
        raise failure


__all__ = ["serve_workers", "WorkerSettings", "FrontDoor", "owner_of", "minted_by", "worker_session_id"]
