"""The one engine actor shared by every session.

It owns the backend, turns submissions into streams (one pump per request; the backend batches
the concurrent streams into shared decode steps), routes each output to the session that
registered its request id, and guarantees every request ends with exactly one terminal output:
if a backend stream ends without one, raises, is aborted or the engine is restarted, the actor
synthesises it (``Aborted`` or ``EngineFailure``).

Flow control: a session may say its listener is behind (it holds as much unsent output as it
may: core/session_config.py ``unsent_audio_bytes`` of audio, or half its outbox in events). The
request's pump then waits for it before it takes the next output from the stream, so a
response is produced no faster than its client takes it. A backend whose streams are pulled (the talker synthesises a phrase when it is
asked for the next packet) does no work meanwhile; the watchdog does not count the wait as a
stall.

Supervision: a watchdog restarts the backend when an in-flight request has produced nothing for
``stall_timeout_s``; a restart fails every request in flight (sessions answer with
``response.done`` status failed) and the next turn works on the fresh backend.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import anyio
import anyio.lowlevel
import attrs
import structlog

from ..core.clock import MONOTONIC, Clock
from ..core.engine_io import Aborted, EngineFailure, EngineOutput, ModelTurnRequest, is_terminal
from ..engines.base import EngineBackend, sync_abort
from .loop_event import OneShotEvent, event_class

log = structlog.get_logger("duplex_actors.engine")

Deliver = Callable[[EngineOutput], None]


class Listener(Protocol):
    """Who takes a request's output (its session), asked between two outputs."""

    def listener_behind(self) -> bool:
        """Whether the listener holds as much unsent output as it may."""
        ...

    async def listener_caught_up(self) -> None:
        """Return once the listener has taken enough to be sent more (or has gone for good)."""
        ...


#: Pump tasks kept parked for the next request once their stream ends; more than this exit.
MAX_IDLE_PUMPS = 256


@attrs.frozen(slots=True)
class EngineStatistics:
    in_flight: int
    routes: int
    submitted: int
    completed: int
    aborted: int
    failed: int
    unrouted: int
    restarts: int
    pending_abort_retries: int
    #: Pump tasks waiting for the next request (at most MAX_IDLE_PUMPS): reused, not leaked.
    parked_pumps: int = 0
    #: Requests in flight whose stream waits for its listener to take what it was sent.
    waiting_for_listeners: int = 0


class _Flight:
    __slots__ = (
        "request",
        "scope",
        "listener",
        "last_output",
        "waiting",
        "terminal_sent",
        "aborted",
        "failure",
    )

    def __init__(
        self, request: ModelTurnRequest, now: float, scope: anyio.CancelScope, listener: Listener | None
    ) -> None:
        self.request = request
        self.scope = scope
        self.listener = listener
        self.last_output = now
        self.waiting = False  # for its listener to catch up: not a stall
        self.terminal_sent = False
        self.aborted = False
        self.failure: str | None = None


class _Parked:
    """A pump task waiting for its next request: submit sets ``request``, then ``wake``."""

    __slots__ = ("wake", "request")

    def __init__(self, wake: OneShotEvent) -> None:
        self.wake = wake
        self.request: ModelTurnRequest | None = None


class EngineActor:
    def __init__(
        self,
        backend: EngineBackend,
        *,
        clock: Clock = MONOTONIC,
        stall_timeout_s: float | None = None,
        watchdog_interval_s: float = 0.5,
    ) -> None:
        self.backend = backend
        self.clock = clock
        self.stall_timeout_s = stall_timeout_s
        self.watchdog_interval_s = watchdog_interval_s
        self._routes: dict[str, Deliver] = {}
        self._flights: dict[str, _Flight] = {}
        #: ("submit", ModelTurnRequest) or ("abort", request id), waiting for the task group.
        self._inbox: deque[tuple[str, Any]] = deque()
        #: Pump tasks waiting for a request (see submit).
        self._idle_pumps: list[_Parked] = []
        self._new_event: Callable[[], OneShotEvent] = anyio.Event
        self._new_scope: Callable[[], anyio.CancelScope] = anyio.CancelScope
        self._wake: OneShotEvent | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._abort_retry: set[str] = set()
        self._restarting = False
        self.submitted = self.completed = self.aborted = self.failed = 0
        self.unrouted = 0
        self.restarts = 0

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await self.backend.start()
        # The backend's one-shot event and CancelScope classes, made directly: anyio.Event()
        # and anyio.CancelScope() look the backend up each time (a scope is made per request);
        # on asyncio the event is the leaner LoopEvent (actors/loop_event.py).
        self._new_event = event_class()
        self._new_scope = type(anyio.CancelScope())
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                # Always: besides stalls (only with stall_timeout_s) it retries failed aborts.
                tg.start_soon(self._watchdog)
                task_status.started()
                try:
                    await self._loop()
                finally:
                    tg.cancel_scope.cancel()
        finally:
            # A stopped task group starts nothing: submissions and aborts go back to the inbox.
            self._tg = None
            # The runtime stops us by cancellation, so closing the backend must be in a
            # finally, shielded, or a remote engine (Ray actor, vLLM) would outlive the runtime.
            with anyio.CancelScope(shield=True):
                await self.backend.aclose()

    async def _loop(self) -> None:
        while True:
            while self._inbox:
                op, arg = self._inbox.popleft()
                if op == "submit":
                    self._task_group().start_soon(self._pump, arg)
                elif op == "abort":
                    self._abort_now(arg)
            self._wake = self._new_event()
            await self._wake.wait()

    def _task_group(self) -> anyio.abc.TaskGroup:
        # Only called from the actor's own tasks, which run inside run()'s task group.
        assert self._tg is not None, "the engine actor is not running"
        return self._tg

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # -- what sessions call (synchronously, from the dispatcher) ----------------------------

    def submit(self, request: ModelTurnRequest, deliver: Deliver, listener: Listener | None = None) -> None:
        """Start ``request``; its outputs go to ``deliver``, and between two outputs its stream
        waits while ``listener`` (if any) is behind."""
        self._routes[request.request_id] = deliver
        self._flights[request.request_id] = _Flight(request, self.clock.now(), self._new_scope(), listener)
        self.submitted += 1
        if self._tg is not None:
            # Straight to a pump task (synchronously), not through the inbox: the actor loop's
            # wake-up was one loop hop, and the pump then queued behind everything that woke
            # meanwhile (the writer sending the response's first events), so the engine started
            # late on every turn (docs/benchmarks.md, wire). An abort that comes before
            # the pump runs marks the flight, and _pump answers it with Aborted without
            # starting the stream, as it did for queued submissions.
            idle = self._idle_pumps
            if idle:
                # A parked pump, woken as a new task would be scheduled (the same loop hop):
                # anyio's start_soon costs several times a wake-up (docs/benchmarks.md).
                parked = idle.pop()
                parked.request = request
                parked.wake.set()
            else:
                self._tg.start_soon(self._pumps, request)
            return
        self._inbox.append(("submit", request))
        self._poke()

    def abort(self, request_ids: Iterable[str]) -> None:
        if self._tg is not None:
            # Straight away, not through the inbox: a barge-in's stop should not wait a loop
            # iteration for the engine task to wake (one hop less; docs/benchmarks.md). The
            # flight is registered synchronously by submit, so nothing can be missed.
            for rid in request_ids:
                self._abort_now(rid)
            return
        for rid in request_ids:
            self._inbox.append(("abort", rid))
        self._poke()

    # -- routing ----------------------------------------------------------------------------

    def _route(self, output: EngineOutput, terminal: bool) -> None:
        rid = output.request_id
        deliver = self._routes.get(rid)
        if deliver is None:
            # Never creates state: an output nobody registered is counted and dropped.
            self.unrouted += 1
            return
        if terminal:
            # The route goes only once the terminal is handed over, so late output of a
            # closing session is still consumed by it.
            del self._routes[rid]
        deliver(output)

    # -- streams ----------------------------------------------------------------------------

    async def _pumps(self, request: ModelTurnRequest) -> None:
        """A pump task: runs ``request``'s stream, then parks for the next one submit hands it
        (at most MAX_IDLE_PUMPS park; the rest end)."""
        idle = self._idle_pumps
        while True:
            await self._pump(request)
            del request  # a parked pump must not keep its last request's audio alive
            if len(idle) >= MAX_IDLE_PUMPS:
                return
            parked = _Parked(self._new_event())
            idle.append(parked)
            try:
                await parked.wake.wait()
            except BaseException:
                # Cancelled while parked (shutdown): a submit may have handed it a request in
                # the same step, which must still get its one terminal from a pump.
                handed = parked.request
                if handed is None:
                    idle.remove(parked)
                elif self._tg is not None:
                    self._tg.start_soon(self._pump, handed)
                raise
            handed = parked.request
            assert handed is not None  # submit hands one before it wakes the pump
            request = handed
            del handed, parked  # (nor through these, once it has run)

    async def _pump(self, request: ModelTurnRequest) -> None:
        rid = request.request_id
        flight = self._flights.get(rid)
        if flight is None:  # aborted before it started
            return
        try:
            if flight.aborted:
                # Aborted between submit and this task starting (a response.cancel processed
                # right after its response.create): never start the stream; the finally below
                # still answers with the request's one terminal (Aborted).
                return
            with flight.scope:
                stream = self.backend.generate(request)
                try:
                    async for output in stream:
                        flight.last_output = self.clock.now()
                        if output.request_id != rid:
                            continue  # a backend may not speak for other requests
                        terminal = is_terminal(output, request.kind)
                        if terminal:
                            flight.terminal_sent = True
                            if isinstance(output, EngineFailure):
                                flight.failure = output.message
                            elif isinstance(output, Aborted):
                                flight.aborted = True
                        self._route(output, terminal)
                        if terminal:
                            break
                        listener = flight.listener
                        if listener is not None and listener.listener_behind():
                            flight.waiting = True
                            try:
                                await listener.listener_caught_up()
                            finally:
                                flight.waiting = False
                                flight.last_output = self.clock.now()
                finally:
                    # aclose ends the backend's generator here, whichever way this block is
                    # left (contextlib.aclosing, written out: one object and two frames less
                    # per request).
                    await stream.aclose()
        except Exception as exc:  # a backend failure fails this request, never the runtime
            flight.failure = f"{type(exc).__name__}: {exc}"
            log.warning("engine_stream_failed", request_id=rid, error=flight.failure)
        finally:
            self._flights.pop(rid, None)
            if not flight.terminal_sent:
                flight.terminal_sent = True
                now = self.clock.now()
                if flight.failure is not None:
                    self._route(EngineFailure(rid, flight.failure, produced_at=now), True)
                elif flight.aborted:
                    self._route(Aborted(rid, produced_at=now), True)
                else:
                    flight.failure = "stream ended without a terminal output"
                    self._route(EngineFailure(rid, flight.failure, produced_at=now), True)
            # Count what the session was told, so these statistics and the responses agree.
            if flight.failure is not None:
                self.failed += 1
            elif flight.aborted:
                self.aborted += 1
            else:
                self.completed += 1

    def _abort_now(self, rid: str) -> None:
        flight = self._flights.get(rid)
        if flight is None:
            return
        flight.aborted = True
        flight.scope.cancel()
        nowait = sync_abort(self.backend)
        if nowait is None:
            self._task_group().start_soon(self._backend_abort, rid)
            return
        # A backend that can abort synchronously is told now, not one loop iteration later in
        # a task: that iteration was the runtime's whole share of a barge-in's abort latency.
        try:
            nowait(rid)
            self._abort_retry.discard(rid)
        except Exception as exc:
            self._abort_retry.add(rid)  # retried by the watchdog through abort(), as below
            log.warning("engine_abort_failed", request_id=rid, error=str(exc))

    async def _backend_abort(self, rid: str) -> None:
        try:
            await self.backend.abort(rid)
            self._abort_retry.discard(rid)
        except Exception as exc:
            # The stream is already cancelled on our side; the backend's copy is retried by the
            # watchdog so its slot is not leaked.
            self._abort_retry.add(rid)
            log.warning("engine_abort_failed", request_id=rid, error=str(exc))

    # -- supervision ------------------------------------------------------------------------

    async def restart(self, reason: str = "engine restarted") -> None:
        if self._restarting:
            return
        self._restarting = True
        try:
            self.restarts += 1
            log.warning("engine_restart", reason=reason, in_flight=len(self._flights))
            for flight in list(self._flights.values()):
                flight.failure = reason
                flight.scope.cancel()
            await anyio.lowlevel.checkpoint()
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    await self.backend.aclose()
            # A backend that does not come back at once is retried with backoff; an exception
            # here would otherwise take the whole runtime down with the watchdog.
            delay = 0.05
            while True:
                try:
                    with anyio.CancelScope(shield=True):
                        await self.backend.start()
                    break
                except Exception as exc:
                    log.error("engine_start_failed", error=f"{type(exc).__name__}: {exc}")
                    await anyio.sleep(delay)
                    delay = min(delay * 2, 5.0)
        finally:
            self._restarting = False

    async def _watchdog(self) -> None:
        while True:
            await anyio.sleep(self.watchdog_interval_s)
            for rid in list(self._abort_retry):
                self._task_group().start_soon(self._backend_abort, rid)
            now = self.clock.now()
            stalled = [
                f
                for f in self._flights.values()
                if not f.waiting and now - f.last_output > (self.stall_timeout_s or math.inf)
            ]
            if stalled:
                await self.restart(f"engine stalled: no output for {self.stall_timeout_s}s")

    def cleanup_pending(self, request_ids: Iterable[str]) -> bool:
        """Whether any of these requests still holds engine resources: a live stream, a route
        waiting for its terminal, or a backend abort that failed and is being retried."""
        return any(
            rid in self._flights or rid in self._routes or rid in self._abort_retry for rid in request_ids
        )

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            len(self._flights),
            len(self._routes),
            self.submitted,
            self.completed,
            self.aborted,
            self.failed,
            self.unrouted,
            self.restarts,
            len(self._abort_retry),
            len(self._idle_pumps),
            sum(1 for flight in self._flights.values() if flight.waiting),
        )
