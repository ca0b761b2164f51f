"""The supervisors of ``serve --workers N`` (:mod:`.workers`): they start the engine process and
the worker processes, start each again when it dies (a worker after a backoff while it keeps
dying young), and stop them all at the end.

What runs in each child is :mod:`.workers`' business: the supervisors are given its entry point.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from .front_door import PING_PASS_S, FrontDoor, _Worker
from .worker_liveness import ENGINE_HUNG_AFTER_S, PING_INTERVAL_S, Liveness, time_away

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.context import SpawnContext

    from .workers import WorkerSettings

log = structlog.get_logger("duplex_actors.server.workers")

#: A worker that dies within this long of its start is restarted after a growing backoff.
RESTART_BACKOFF_MIN_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 30.0
#: How long a hung child has after SIGABRT (to write its threads' stacks) before SIGKILL.
HUNG_KILL_GRACE_S = 2.0


class _EngineSupervisor:
    """Starts the engine process, and starts it again if it dies (the workers reconnect on
    their next turn; the turns that were in flight end as failed)."""

    def __init__(
        self,
        ctx: SpawnContext,
        settings: WorkerSettings,
        path: str,
        startup_timeout_s: float,
        *,
        main: Callable[..., None],
    ) -> None:
        self.ctx = ctx
        #: The engine process's entry point: ``main(settings, path, ready)``.
        self.main = main
        self.settings = settings
        self.path = path
        self.startup_timeout_s = startup_timeout_s
        self.process: Any = None
        self.restarts = 0
        #: Times it was stopped for answering none of the front's pings (--engine-timeout-s).
        self.hangs = 0

    def spawn(self) -> Connection[Any, int]:
        """Start the process; returns the pipe its pid arrives on once its socket accepts.
        Call from the front's main thread: the child's parent-death signal is tied to the
        thread that started it."""
        ready, ready_send = self.ctx.Pipe(duplex=False)
        self.process = self.ctx.Process(
            target=self.main, args=(self.settings, self.path, ready_send), name="duplex-engine"
        )
        self.process.start()
        return ready

    def wait_ready(self, ready: Connection[Any, int]) -> int:
        if not ready.poll(self.startup_timeout_s):
            raise RuntimeError("the engine process did not start in time")
        return ready.recv()

    def start(self) -> int:
        return self.wait_ready(self.spawn())


class _WorkerSupervisor:
    """Starts the worker processes, and each again when it dies: at once if it had run a
    while, else after a backoff that doubles with each quick death (RESTART_BACKOFF_*)."""

    def __init__(
        self,
        ctx: SpawnContext,
        settings: WorkerSettings,
        engine_path: str,
        folder: str,
        timeout_s: float,
        *,
        main: Callable[..., None],
    ) -> None:
        self.ctx = ctx
        #: A worker process's entry point: ``main(index, generation, settings, engine_path,
        #: handoff_path, ready)``.
        self.main = main
        self.settings = settings
        self.engine_path = engine_path
        self.folder = folder
        self.startup_timeout_s = timeout_s
        self.pool: list[_Worker] = []
        self.restarts: list[int] = []
        self.stopping = False

    def spawn(self, worker: _Worker) -> tuple[Connection[Any, tuple[int, int]], str]:
        """Start ``worker``'s process (from the main thread, as _EngineSupervisor.spawn says);
        returns the pipe its (pid, port) arrives on and its hand-off socket's path."""
        path = os.path.join(self.folder, f"worker{worker.index}g{worker.generation}.sock")
        receive, send = self.ctx.Pipe(duplex=False)
        worker.process = self.ctx.Process(
            target=self.main,
            args=(worker.index, worker.generation, self.settings, self.engine_path, path, send),
            name=f"duplex-worker-{worker.index}",
        )
        worker.process.start()
        worker.started_at = time.monotonic()
        return receive, path

    def wait_ready(self, worker: _Worker, receive: Connection[Any, tuple[int, int]], path: str) -> None:
        """Block until the worker's server runs, then connect its hand-off socket."""
        if not receive.poll(self.startup_timeout_s):
            raise RuntimeError(f"worker {worker.index} did not start in time")
        worker.pid, worker.port = receive.recv()
        handoff = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        handoff.connect(path)
        handoff.setblocking(False)
        worker.handoff = handoff
        timeout = self.settings.worker_timeout_s
        worker.liveness = Liveness(time.monotonic(), hung_after_s=timeout if timeout > 0 else None)
        worker.draining = False
        worker.alive = True

    def start_all(self, workers: int) -> None:
        self.pool = [_Worker(index, None) for index in range(workers)]
        self.restarts = [0] * workers
        started = [(worker, *self.spawn(worker)) for worker in self.pool]
        for worker, receive, path in started:
            self.wait_ready(worker, receive, path)

    def backoff(self, worker: _Worker) -> float:
        """How long to wait before starting ``worker`` again, given how long it had run. One
        that drained when told to (SIGTERM to its pid: a recycle) and exited cleanly is no
        crash: it starts again at once."""
        if worker.recycled or time.monotonic() - worker.started_at >= STABLE_AFTER_S:
            worker.quick_deaths = 0
            return 0.0
        worker.quick_deaths += 1
        # int ** int is typed Any (a negative exponent gives a float)
        delay: float = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_MIN_S * 2 ** (worker.quick_deaths - 1))
        return delay

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


def stop_hung_process(process: Any, name: str, silent_s: float, option: str) -> None:
    """Stop a child whose loop answered none of the front's pings for ``silent_s``
    (worker_liveness.py). SIGABRT first, so that its faulthandler writes where each of its
    threads was (to stderr); SIGCONT, so that a stopped process takes it; SIGKILL if it is
    still there HUNG_KILL_GRACE_S later. Its exit is then handled as any death of it."""
    log.error("front.child_hung", child=name, pid=process.pid, silent_s=round(silent_s, 2))
    print(
        f"{name} pid={process.pid} answered nothing for {silent_s:.1f} s ({option}): stopping it",
        file=sys.stderr,
        flush=True,
    )
    for signum in (signal.SIGABRT, signal.SIGCONT):
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signum)

    def kill_if_still_there() -> None:
        if process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)

    asyncio.get_running_loop().call_later(HUNG_KILL_GRACE_S, kill_if_still_there)


class _EngineProbe:
    """Pings the engine process over its own channel: a ``stats`` request, which the engine
    process's loop answers (engine_process.py), read as worker_liveness.py reads a worker's
    answers. One pass (:meth:`hung`) per PING_PASS_S."""

    def __init__(self, path: str, hung_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        from ..engines.engine_process import EngineProcessClient

        # A hung process's socket still accepts (its backlog), and the hello never comes.
        self.client = EngineProcessClient(path, connect_timeout_s=PING_INTERVAL_S)
        self.hung_after_s = hung_after_s
        self.clock = clock
        self.liveness: Liveness | None = None
        self._process: Any = None
        self._asking: asyncio.Task[None] | None = None
        self._last_pass: float | None = None

    def hung(self, process: Any) -> bool:
        """One pass for the running engine ``process``: True once (then never again for this
        process) when it has answered nothing for ``hung_after_s``."""
        now = self.clock()
        away = time_away(self._last_pass, now, PING_PASS_S)
        self._last_pass = now
        if process is not self._process:  # a new process: a fresh record
            self._process = process
            self.liveness = Liveness(now, hung_after_s=self.hung_after_s)
            self._forget_question()
        liveness = self.liveness
        if liveness is None:  # this process was already found hung
            return False
        liveness.forgive(away)
        asking = self._asking
        if asking is not None and asking.done():
            self._asking = None
            if not asking.cancelled():
                asking.exception()  # a failed question (EngineFailed) is asked again below
        if liveness.hung(now):
            self.liveness = None
            self._forget_question()
            return True
        if self._asking is None:
            if liveness.outstanding_since is not None:
                # The last question failed (no hello in time, the channel lost): ask again,
                # while the silence runs on from the first.
                self._asking = asyncio.create_task(self._ask(liveness, liveness.sent))
            elif liveness.ping_due(now):
                self._asking = asyncio.create_task(self._ask(liveness, liveness.ping(now)))
        return False

    async def _ask(self, liveness: Liveness, number: int) -> None:
        # No timeout of its own worth the name: the silence is judged in hung().
        await self.client.remote_statistics(timeout_s=3600.0)
        liveness.answered(number, self.clock())  # when it came, not at the next pass

    def _forget_question(self) -> None:
        if self._asking is not None:
            self._asking.cancel()
            self._asking = None

    async def aclose(self) -> None:
        self._forget_question()
        await self.client.aclose()


async def _watch_engine(
    engine: _EngineSupervisor,
    restarted: Callable[[], None],
    *,
    hung_after_s: float | None = ENGINE_HUNG_AFTER_S,
) -> None:
    """Start the engine process again if it exits (at most once a second); stop it first if
    its loop answers none of the front's pings for ``hung_after_s`` (None: never)."""
    probe = None if hung_after_s is None else _EngineProbe(engine.path, hung_after_s)
    try:
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
            elif probe is not None and probe.hung(engine.process):
                engine.hangs += 1
                stop_hung_process(engine.process, "engine", probe.hung_after_s, "--engine-timeout-s")
            await asyncio.sleep(PING_PASS_S)
    finally:
        if probe is not None:
            await probe.aclose()


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
