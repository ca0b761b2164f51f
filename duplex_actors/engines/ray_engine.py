"""RayEngine: any engine backend, hosted in a Ray actor in another process or on another machine.

What this module owns, and what it does not:

* :class:`RayEngine` is an :class:`~duplex_actors.engines.base.EngineBackend` on the runtime's
  side. ``start()`` creates one Ray *async* actor (:class:`EngineHost`) that calls
  ``factory()`` inside the actor's process, so the real backend (its weights, its threads, its
  GPU) lives there and only requests and outputs cross the wire. The factory must be picklable
  (a lambda or a module-level function; cloudpickle carries closures).
* ``generate(request)`` is one Ray *streaming generator* call (``num_returns="streaming"``):
  the actor iterates the hosted backend's stream and yields, as one small inlined Ray item,
  every output that is ready at that moment (never waiting to fill a batch: a paced engine
  sends one output per item, a burst shares one). Outputs come back in order. The engine actor
  above still does routing, fencing and the one-terminal guarantee; this class only carries
  the stream.
* Stopping: when the consuming task is cancelled, or ``abort(request_id)`` is called, the
  streaming call is ``ray.cancel``-ed, which cancels the actor-side task, which closes the
  hosted backend's stream (its ``finally`` frees the request); ``abort`` is then also forwarded
  to the hosted backend's own ``abort``.
* A dead actor becomes explicit outputs, never a hang: every in-flight stream ends with a
  retryable :class:`EngineFailure`, the handle is dropped, and the next ``generate()`` starts a
  fresh actor (``restart_on_death=True``, the default) or ``start()`` can be called again.
  A hung but living actor is the engine actor's watchdog's business (``stall_timeout_s``): its
  restart calls ``aclose()`` (which kills the actor) and ``start()``.
* It does not own the Ray cluster. ``start()`` calls ``ray.init`` only if nobody has yet
  (``ray_address`` and ``init_options`` are passed through); call ``ray.init`` yourself to
  choose where that cost lands. A local cluster it started that way is guarded for the rest
  of the process's life (orphan_guard.py): Ray ends most of its processes with the process
  that started them, but its dashboard and runtime-env agents outlived a SIGKILL.

Timestamps (``produced_at``) are stamped by the hosted backend in the actor's process; on one
machine ``time.perf_counter`` is the same system-wide monotonic clock, across machines it is not.

Ray is imported only inside methods, so importing this module costs nothing where Ray is not
installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any

import anyio
import attrs
import structlog

from ..core.engine_io import Aborted, EngineFailure, EngineOutput, ModelTurnRequest, is_terminal
from ..errors import EngineFailed
from ..orphan_guard import OrphanGuard
from .base import EngineBackend, EngineCapabilities

log = structlog.get_logger(__name__)

BackendFactory = Callable[[], EngineBackend]

#: Concurrent calls one host actor accepts (streams + aborts + queries). Async actor calls are
#: coroutines on one loop, so a high limit costs nothing until it is used.
DEFAULT_MAX_CONCURRENCY = 10_000


# --------------------------------------------------------------------------- the remote side


class _Raised:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()


class EngineHost:
    """The body of the Ray actor: owns one backend made by ``factory()`` in its own process.

    Plain class on purpose: :class:`RayEngine` wraps it with ``ray.remote`` at start, so this
    module never imports Ray at import time. Every method is ``async`` so Ray runs the actor
    as an async actor (one event loop, many concurrent calls).
    """

    def __init__(self, factory: BackendFactory) -> None:
        self._factory = factory
        self.backend: EngineBackend | None = None

    async def start(self) -> tuple[str, EngineCapabilities, int]:
        self.backend = self._factory()
        await self.backend.start()
        return self.backend.name, self.backend.capabilities, os.getpid()

    def _started(self) -> EngineBackend:
        if self.backend is None:
            raise RuntimeError("the engine host has not been started")
        return self.backend

    async def generate(self, request: ModelTurnRequest) -> AsyncIterator[list[EngineOutput]]:
        """The hosted stream, in batches: each batch is every output ready at that moment.

        Never waits to fill a batch, so a paced engine (a token every few ms) still sends one
        output per item with no added latency; an engine that runs ahead of the transport
        (a burst of audio packets, a fast scripted engine) shares one Ray item among many
        outputs instead of paying a cross-process report for each.
        """
        ready: asyncio.Queue[Any] = asyncio.Queue()  # outputs, then a _Raised or _END

        async def feed() -> None:
            # aclosing: when this task is cancelled, the hosted stream is closed here, so the
            # backend's own cleanup runs in this process.
            try:
                async with contextlib.aclosing(self._started().generate(request)) as stream:
                    async for output in stream:
                        ready.put_nowait(output)
            except Exception as exc:
                ready.put_nowait(_Raised(exc))
            finally:
                ready.put_nowait(_END)

        feeder = asyncio.get_running_loop().create_task(feed())
        try:
            while True:
                batch = [await ready.get()]
                while not ready.empty():
                    batch.append(ready.get_nowait())
                ended = batch[-1] is _END
                if ended:
                    batch.pop()
                if batch and isinstance(batch[-1], _Raised):
                    if len(batch) > 1:
                        yield batch[:-1]
                    raise batch[-1].exc
                if batch:
                    yield batch
                if ended:
                    return
        finally:
            # Ray cancelled this call (abort, consumer gone) or the consumer stopped reading.
            if not feeder.done():
                feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(feeder)

    async def abort(self, request_id: str) -> None:
        await self._started().abort(request_id)

    async def aclose(self) -> None:
        if self.backend is not None:
            await self.backend.aclose()

    async def active_requests(self) -> list[str]:
        """The hosted backend's in-flight request ids (its ``active`` set, if it keeps one)."""
        return sorted(getattr(self.backend, "active", ()))

    async def inspect(self, fn: Callable[[EngineBackend], Any]) -> Any:
        """Run ``fn(backend)`` in the actor's process and return its (picklable) result."""
        result = fn(self._started())
        if inspect.isawaitable(result):
            result = await result
        return result


# --------------------------------------------------------------------------- the local side


@attrs.frozen(slots=True)
class RayEngineStatistics:
    #: Streams open on this side (one per in-flight ``generate``).
    streams: int
    #: Actors started (the first start included).
    actors_started: int
    #: Times an actor was found dead (killed, crashed, node lost).
    actor_deaths: int
    #: Process id of the current actor; None when no actor is alive.
    actor_pid: int | None


class _Host:
    """One live actor: its handle and what it told us at start."""

    __slots__ = ("handle", "generate", "pid")

    def __init__(self, handle: Any, pid: int) -> None:
        self.handle = handle
        # Options resolved once per actor, not once per request.
        self.generate = handle.generate.options(num_returns="streaming")
        self.pid = pid


def _child_pids() -> set[int]:
    try:
        import psutil
    except ImportError:
        return set()
    return {child.pid for child in psutil.Process().children()}


#: The guard over the local Ray cluster this process started (one for the process's life).
_cluster_guard: OrphanGuard | None = None


def _guard_local_cluster(children_before: set[int]) -> None:
    """Guard the processes ``ray.init`` started here (a local cluster: children of this
    process then) and their children, known now, so none outlives this process."""
    global _cluster_guard
    if _cluster_guard is not None:
        return
    try:
        import psutil
    except ImportError:
        return
    pids: set[int] = set()
    for child in psutil.Process().children():
        if child.pid in children_before:
            continue
        with contextlib.suppress(psutil.Error):  # one that ended meanwhile needs no guard
            pids.update(p.pid for p in (child, *child.children(recursive=True)))
    _cluster_guard = OrphanGuard.start(pids, label="the local Ray cluster it started")


class RayEngine:
    """An engine backend whose real backend runs in a Ray actor.

    ``factory`` builds the real backend *inside* the actor process. ``actor_options`` go to
    ``ray.remote(...).options`` (``num_gpus=1``, ``num_cpus``, ``runtime_env``, scheduling,
    ``name``...); ``max_concurrency`` defaults to :data:`DEFAULT_MAX_CONCURRENCY`.
    ``capabilities`` is what :attr:`capabilities` says before the first start; afterwards it is
    the hosted backend's own.
    """

    name = "ray"

    def __init__(
        self,
        factory: BackendFactory,
        *,
        ray_address: str | None = None,
        actor_options: Mapping[str, Any] | None = None,
        init_options: Mapping[str, Any] | None = None,
        capabilities: EngineCapabilities | None = None,
        restart_on_death: bool = True,
        start_timeout_s: float = 120.0,
        close_timeout_s: float = 5.0,
        abort_timeout_s: float = 5.0,
    ) -> None:
        self.factory = factory
        self.ray_address = ray_address
        self.actor_options = dict(actor_options or {})
        self.init_options = dict(init_options or {})
        self.capabilities = capabilities or EngineCapabilities()
        self.restart_on_death = restart_on_death
        self.start_timeout_s = start_timeout_s
        self.close_timeout_s = close_timeout_s
        self.abort_timeout_s = abort_timeout_s
        #: Name of the hosted backend, once started.
        self.backend_name: str | None = None
        self._host: _Host | None = None
        self._wanted = False  # between start() and aclose(): a dead actor may be replaced
        self._start_lock: anyio.Lock | None = None
        self._streams: dict[str, Any] = {}  # request id -> ObjectRefGenerator
        self._aborting: set[str] = set()
        self.actors_started = 0
        self.actor_deaths = 0

    # -- introspection ----------------------------------------------------------------------

    @property
    def actor(self) -> Any:
        """The current Ray actor handle (None when no actor is alive)."""
        return None if self._host is None else self._host.handle

    @property
    def actor_pid(self) -> int | None:
        return None if self._host is None else self._host.pid

    @property
    def running(self) -> bool:
        return self._host is not None

    @property
    def active(self) -> frozenset[str]:
        """Request ids with a stream open on this side (the remote side: :meth:`remote_active`)."""
        return frozenset(self._streams)

    async def remote_active(self) -> frozenset[str]:
        """The hosted backend's in-flight request ids, asked of the actor."""
        host = self._require_host()
        return frozenset(await host.handle.active_requests.remote())

    async def call(self, fn: Callable[[EngineBackend], Any]) -> Any:
        """Run ``fn(backend)`` inside the actor (``fn`` and its result must be picklable)."""
        host = self._require_host()
        return await host.handle.inspect.remote(fn)

    def statistics(self) -> RayEngineStatistics:
        return RayEngineStatistics(len(self._streams), self.actors_started, self.actor_deaths, self.actor_pid)

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the actor and start the hosted backend; a no-op while an actor is alive."""
        if self._start_lock is None:
            self._start_lock = anyio.Lock()
        async with self._start_lock:
            self._wanted = True
            if self._host is not None:
                return
            import ray

            started_cluster = not ray.is_initialized()
            if started_cluster:
                children_before = _child_pids()
                # Blocks this loop for the cluster start (seconds); nothing else runs yet.
                ray.init(address=self.ray_address, **self.init_options)
            options = {"max_concurrency": DEFAULT_MAX_CONCURRENCY, **self.actor_options}
            # Any, as _Host keeps it: ray types the handle ActorHandle[T] | type[T], whose methods
            # have no .remote to a type checker.
            handle: Any = ray.remote(EngineHost).options(**options).remote(self.factory)
            try:
                with anyio.fail_after(self.start_timeout_s):
                    name, capabilities, pid = await handle.start.remote()
            except BaseException:
                with contextlib.suppress(Exception):
                    ray.kill(handle, no_restart=True)
                raise
            self._host = _Host(handle, pid)
            if started_cluster:
                # Once the actor runs, the cluster's agents have started too.
                _guard_local_cluster(children_before)
            self.backend_name = name
            self.capabilities = capabilities
            self.actors_started += 1
            log.info("ray_engine_started", backend=name, actor_pid=pid, actors_started=self.actors_started)

    async def aclose(self) -> None:
        """Close the hosted backend (bounded by ``close_timeout_s``) and kill the actor."""
        self._wanted = False
        host, self._host = self._host, None
        if host is None:
            return
        import ray

        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.close_timeout_s):
                with contextlib.suppress(Exception):
                    await host.handle.aclose.remote()
            with contextlib.suppress(Exception):
                ray.kill(host.handle, no_restart=True)
        log.info("ray_engine_closed", actor_pid=host.pid)

    # -- the stream -------------------------------------------------------------------------

    async def generate(self, request: ModelTurnRequest) -> AsyncGenerator[EngineOutput, None]:
        import ray
        from ray.exceptions import (
            ActorUnavailableError,
            RayActorError,
            RayError,
            RayTaskError,
            TaskCancelledError,
        )

        host = await self._live_host()
        rid = request.request_id
        stream = host.generate.remote(request)
        self._streams[rid] = stream
        done = False  # the remote stream ended on its own: nothing to cancel
        try:
            try:
                async for ref in stream:
                    for output in await ref:
                        if is_terminal(output, request.kind):
                            done = True
                            yield output
                            return
                        yield output
                done = True  # ended without a terminal: the engine actor synthesises one
            except TaskCancelledError:
                done = True
                if rid in self._aborting:
                    yield Aborted(rid)
                else:
                    yield EngineFailure(rid, "remote request was cancelled", retryable=True)
            except ActorUnavailableError as exc:
                # Unreachable for now (network, restarting node): this request is lost, the
                # actor may still come back, so it is not declared dead.
                yield EngineFailure(rid, f"ray actor unavailable: {_first_line(exc)}", retryable=True)
            except RayActorError as exc:
                done = True
                self._lost(host, exc)
                yield EngineFailure(rid, f"ray actor died: {_first_line(exc)}", retryable=True)
            except RayTaskError as exc:
                done = True
                cause = exc.cause if exc.cause is not None else exc
                yield EngineFailure(
                    rid, f"remote backend raised {type(cause).__name__}: {cause}", retryable=True
                )
            except RayError as exc:  # object lost, owner died, ...
                yield EngineFailure(
                    rid, f"ray error {type(exc).__name__}: {_first_line(exc)}", retryable=True
                )
        finally:
            self._streams.pop(rid, None)
            self._aborting.discard(rid)
            if not done:
                # Cancelled, closed early or failed in transit: stop the actor-side task so the
                # hosted backend frees the request.
                with contextlib.suppress(Exception):
                    ray.cancel(stream)

    async def abort(self, request_id: str) -> None:
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        stream = self._streams.get(request_id)
        if stream is not None:
            self._aborting.add(request_id)
            ray.cancel(stream)
        host = self._host
        if host is None:
            return  # no actor, nothing holds the request
        try:
            with anyio.fail_after(self.abort_timeout_s):
                await host.handle.abort.remote(request_id)
        except ActorUnavailableError:
            raise  # may come back: let the engine actor retry the abort
        except RayActorError as exc:
            self._lost(host, exc)  # a dead actor holds nothing

    # -- helpers ----------------------------------------------------------------------------

    async def _live_host(self) -> _Host:
        host = self._host
        if host is not None:
            return host
        if not self._wanted:
            raise EngineFailed("RayEngine is not started")
        if not self.restart_on_death:
            raise EngineFailed("the Ray engine actor is dead; call start() to replace it")
        await self.start()
        return self._require_host()

    def _require_host(self) -> _Host:
        if self._host is None:
            raise EngineFailed("RayEngine has no live actor")
        return self._host

    def _lost(self, host: _Host, exc: BaseException) -> None:
        """Forget a dead actor, once, however many streams notice it."""
        if self._host is not host:
            return
        self._host = None
        self.actor_deaths += 1
        log.warning(
            "ray_engine_actor_died", actor_pid=host.pid, error=_first_line(exc), in_flight=len(self._streams)
        )
        import ray

        with contextlib.suppress(Exception):
            ray.kill(host.handle, no_restart=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
