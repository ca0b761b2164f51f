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

from .front_door import FrontDoor, _Worker
from .worker_liveness import Liveness

if TYPE_CHECKING:
    from .workers import WorkerSettings

log = structlog.get_logger("duplex_actors.server.workers")

#: A worker that dies within this long of its start is restarted after a growing backoff.
RESTART_BACKOFF_MIN_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 30.0


class _EngineSupervisor:
    """Starts the engine process, and starts it again if it dies (the workers reconnect on
    their next turn; the turns that were in flight end as failed)."""

    def __init__(
        self, ctx, settings: WorkerSettings, path: str, startup_timeout_s: float, *, main: Callable[..., None]
    ) -> None:
        self.ctx = ctx
        #: The engine process's entry point: ``main(settings, path, ready)``.
        self.main = main
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
            target=self.main, args=(self.settings, self.path, ready_send), name="duplex-engine"
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
        self,
        ctx,
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

    def spawn(self, worker: _Worker):
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

    def wait_ready(self, worker: _Worker, receive, path: str) -> None:
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
