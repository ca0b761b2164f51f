"""``RuntimeMachine``: a hypothesis state machine that drives the real
:class:`~duplex_actors.Runtime` on an engine backend and checks every session invariant after
every step, and the engine contract on the backend (:class:`RecordingBackend`); subclass it to
check your own backend. Overview and use: :mod:`duplex_actors.testing.machine`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import anyio
import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ..actors.runtime import Runtime
from ..actors.session_handle import SessionHandle
from ..core import commands as cmd
from ..core.actions import EngineAction, SubmitTurn
from ..core.clock import Clock
from ..core.commands import Lane
from ..core.engine_io import EngineOutput, ModelTurnRequest, TurnKind, is_terminal
from ..core.events import ServerEvent
from ..core.session import SessionCore
from ..core.session_config import SessionConfig
from ..engines.base import EngineBackend
from ..engines.scripted import Script, ScriptedEngine
from ..errors import DuplexError, MailboxFull, SessionClosed
from . import strategies as dst
from .core_machine import (
    _ANY_OUTPUT,
    _BURST_KINDS,
    _COMMAND_KINDS,
    TEST_CONFIG,
    _check_actions,
    check_lease_accounting,
)
from .model import CLOSED, EventStreamChecker, SessionModel

T = TypeVar("T")

# =============================================================================================
# The real runtime
# =============================================================================================


@attrs.define
class TraceEntry:
    tick: int
    kind: str  # command | output | expire | fail
    item: Any  # the command, the output, or the reason
    error: BaseException | None = None
    actions: list[EngineAction] = attrs.Factory(list)


class _Trace:
    def __init__(self, tick: Iterator[int]) -> None:
        self.tick = tick
        self.entries: list[TraceEntry] = []
        self.by_event_id: dict[str, TraceEntry] = {}
        self.submitted: dict[str, int] = {}  # request id -> tick the core asked for it
        self.kinds: dict[str, TurnKind] = {}  # request id -> its kind (what ends its stream)

    def add(self, entry: TraceEntry) -> None:
        self.entries.append(entry)
        if entry.kind == "command" and entry.item.event_id is not None:
            self.by_event_id.setdefault(entry.item.event_id, entry)
        for action in entry.actions:
            if isinstance(action, SubmitTurn):
                self.submitted[action.request.request_id] = entry.tick
                self.kinds[action.request.request_id] = action.request.kind


class _TracingCore(SessionCore):
    """A SessionCore that records every input it processes, with its outcome and actions."""

    __slots__ = ("trace",)

    def __init__(self, session_id: str, config: SessionConfig, clock: Clock, trace: _Trace) -> None:
        super().__init__(session_id, config, clock)
        self.trace = trace

    def _record(self, kind: str, item: object, run: Callable[[], T]) -> T:
        n = len(self._actions)
        error: BaseException | None = None
        try:
            return run()
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.trace.add(TraceEntry(next(self.trace.tick), kind, item, error, list(self._actions[n:])))

    def handle(self, command: cmd.Command, *, received_at: float | None = None) -> None:
        return self._record(
            "command", command, lambda: SessionCore.handle(self, command, received_at=received_at)
        )

    def on_engine_output(self, output: EngineOutput) -> None:
        return self._record("output", output, lambda: SessionCore.on_engine_output(self, output))

    def expire(self) -> None:
        # Recorded with what the lease said when the expiry ran: the model closes only then.
        verdict = self.lease.expiry(self.clock.now())
        return self._record("expire", verdict, lambda: SessionCore.expire(self))

    def fail(self, reason: str = "session_failed") -> None:
        return self._record("fail", reason, lambda: SessionCore.fail(self, reason))


@attrs.define
class StreamRecord:
    request_id: str
    started: int
    outputs: int = 0
    terminal: bool = False
    ended: int | None = None
    end: str | None = None  # normal | closed | cancelled | raised


class RecordingBackend:
    """Wraps any engine backend and checks the backend contract as outputs flow through.

    Contract (see :mod:`duplex_actors.engines.base`): a stream yields only its own request's
    outputs, nothing after its terminal, ends normally only after a terminal, yields nothing
    after ``abort(request_id)``, and ends once aborted or cancelled. Breaks are collected in
    ``violations``; nothing is raised inside the engine.
    """

    def __init__(self, inner: EngineBackend, tick: Iterator[int] | None = None) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)
        self.capabilities = inner.capabilities
        self.tick = tick or itertools.count(1)
        self.streams: dict[str, StreamRecord] = {}
        self.aborted_at: dict[str, int] = {}
        self.violations: list[str] = []

    async def start(self) -> None:
        await self.inner.start()

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def abort(self, request_id: str) -> None:
        self.aborted_at.setdefault(request_id, next(self.tick))
        await self.inner.abort(request_id)

    def generate(self, request: ModelTurnRequest) -> AsyncGenerator[EngineOutput, None]:
        rid = request.request_id
        if rid in self.streams:
            self.violations.append(f"{rid}: generate() called twice for one request")
        record = self.streams[rid] = StreamRecord(rid, next(self.tick))
        return self._stream(request, record)

    async def _stream(
        self, request: ModelTurnRequest, record: StreamRecord
    ) -> AsyncGenerator[EngineOutput, None]:
        rid = request.request_id
        inner = self.inner.generate(request)
        try:
            async for output in inner:
                if rid in self.aborted_at:
                    self.violations.append(f"{rid}: output {output!r} after abort()")
                if record.terminal:
                    self.violations.append(f"{rid}: output {output!r} after the terminal output")
                if output.request_id != rid:
                    self.violations.append(f"{rid}: output for another request: {output!r}")
                record.outputs += 1
                record.terminal = record.terminal or is_terminal(output, request.kind)
                yield output
            record.end = "normal"
            if not record.terminal:
                self.violations.append(f"{rid}: stream ended without a terminal output")
        except GeneratorExit:
            record.end = "closed"
            raise
        except BaseException as exc:
            record.end = "cancelled" if isinstance(exc, anyio.get_cancelled_exc_class()) else "raised"
            raise
        finally:
            aclose = getattr(inner, "aclose", None)
            if aclose is not None:
                await aclose()
            record.ended = next(self.tick)

    def open_streams(self) -> list[str]:
        return [rid for rid, r in self.streams.items() if r.ended is None]


class RuntimeMachine(RuleBasedStateMachine):
    """Drives a real Runtime (actors, mailbox, engine actor, your backend) with one session.

    Subclass and override :meth:`make_engine` to check your own backend; ``TestCase`` is the
    pytest/unittest test. Class attributes tune the run.
    """

    #: messages per client lane of the session mailbox (small, so bursts reach the bound).
    mailbox_capacity = 8
    #: what the default engine plays when no drawn script is queued: a response that lasts
    #: long enough (about 15 ms) for commands to land in the middle of it.
    default_script = Script(
        tokens=("Hi", " there", ",", " how", " are", " you"),
        audio_packets=3,
        packet_ms=20,
        first_latency_s=0.002,
        token_latency_s=0.001,
        packet_latency_s=0.001,
    )
    #: seconds an ask may take, and the settle deadline at the end of a run.
    ask_timeout_s = 5.0
    settle_timeout_s = 2.0
    #: Backend contract breaks usually depend on timing (an abort landing mid-stream), so by
    #: default they are reported once, at the end of the run: the failing step is then the
    #: same on every replay, which hypothesis needs to shrink. True reports them at once.
    engine_contract_each_step = False

    def __init__(self) -> None:
        super().__init__()
        self.tick = itertools.count(1)
        self.trace = _Trace(self.tick)
        self.book = dst.ScriptBook(default=self.default_script)
        self.received: list[ServerEvent] = []
        self.fed = 0
        self.replayed = 0
        self.sent: dict[Lane, list[str]] = {Lane.CONTROL: [], Lane.DATA: []}
        self.lane_of: dict[str, Lane] = {}  # event id -> the lane its command was queued on
        self.trigger_of: dict[str, str] = {}
        self.ids = itertools.count(1)
        self.handle: SessionHandle  # set below, or __init__ raises
        self._checked_in_step = False
        self._consumer: Future[None] | None = None
        self._rt_cm = None
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        try:
            config = self.session_config()
            self.backend = RecordingBackend(self.make_engine(), self.tick)
            self.runtime = Runtime(
                self.backend,
                config=config,
                reaper_interval_s=0,
                mailbox_capacity=self.mailbox_capacity,
                **self.runtime_options(),
            )
            self._rt_cm = self.portal.wrap_async_context_manager(self.runtime)
            self._rt_cm.__enter__()
            self.handle = self.portal.call(self._open)
            self.model = self.make_model(self.handle.id, config)
            self.checker = EventStreamChecker()
            self._consumer = self.portal.start_task_soon(self._consume)
        except BaseException:
            self._shutdown()
            raise

    # -- hooks ------------------------------------------------------------------------------

    def make_engine(self) -> EngineBackend:
        """The backend under test. Default: a ScriptedEngine playing ``self.book``, a
        :class:`~.strategies.ScriptBook` the ``next_script`` rule fills with drawn scripts."""
        return ScriptedEngine(self.book)

    def session_config(self) -> SessionConfig:
        return TEST_CONFIG

    def runtime_options(self) -> dict[str, Any]:
        """Extra keyword arguments for :class:`~duplex_actors.Runtime`."""
        return {}

    def make_model(self, session_id: str, config: SessionConfig) -> SessionModel:
        """The reference model the session is compared with (see SessionCoreMachine)."""
        return SessionModel(session_id, config)

    # -- plumbing (runs on the machine's event loop) ----------------------------------------

    def _open(self) -> SessionHandle:
        handle = self.runtime.open_session_nowait()
        actor = handle._actor
        # Observe exactly what the session processes: swap in a recording core before the
        # session has processed anything (the dispatcher only runs it once it has mail).
        old = actor.core
        actor.core = _TracingCore(old.session_id, old.config, old.clock, self.trace)
        return handle

    async def _consume(self) -> None:
        async for event in self.handle.events():
            self.received.append(event)

    def _shutdown(self) -> None:
        try:
            if self._consumer is not None and not self._consumer.done():
                self._consumer.cancel()
            if self._rt_cm is not None:
                self._rt_cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def _accepts(self, command: cmd.Command) -> bool:
        # Mirrors the actor: a finished session still takes close (closing twice is harmless).
        actor = self.handle._actor
        lane = self._lane_for(command)
        open_ = not actor._finished or command.TRIGGER == "close"
        return open_ and actor.mailbox.lane_depth(lane) < actor.mailbox.capacity

    def _lane_for(self, command: cmd.Command) -> Lane:
        """The lane the command must be queued on: its own, except that a cancel queues behind
        a response.create (or a commit) still waiting, so it cannot overtake what it cancels."""
        if isinstance(command, cmd.CancelResponse):
            waiting = [
                e
                for e in self.sent[Lane.DATA]
                if e not in self.trace.by_event_id and self.trigger_of[e] in ("create_response", "commit")
            ]
            if waiting:
                return Lane.DATA
        return command.LANE

    def _record_sent(self, eid: str, command: cmd.Command, lane: Lane) -> None:
        self.sent[lane].append(eid)
        self.lane_of[eid] = lane
        self.trigger_of[eid] = command.TRIGGER

    def _tell(self, step: dst.FencedCommand) -> None:
        eid = f"m{next(self.ids)}"
        command = step.bind(self.handle.epoch, eid)
        lane = self._lane_for(command)
        try:
            self.handle.tell(command)
        except (MailboxFull, SessionClosed):
            return
        self._record_sent(eid, command, lane)
        self._check_mailbox()

    async def _ask(self, step: dst.FencedCommand) -> None:
        eid = f"m{next(self.ids)}"
        command = step.bind(self.handle.epoch, eid)
        accepted = self._accepts(command)
        if accepted:
            self._record_sent(eid, command, self._lane_for(command))
        outcome: BaseException | None = None
        try:
            await self.handle.ask(command, timeout=self.ask_timeout_s)
        except DuplexError as err:
            outcome = err
        where = f"ask {command!r}"
        if not accepted:
            assert isinstance(outcome, (MailboxFull, SessionClosed)), (
                f"{where}: expected a refusal, got {outcome!r}"
            )
            return
        entry = self.trace.by_event_id.get(eid)
        if entry is None:  # queued, then refused because the session closed meanwhile
            assert isinstance(outcome, SessionClosed), f"{where}: never processed, yet answered {outcome!r}"
        else:
            assert outcome is entry.error, (
                f"{where}: the asker got {outcome!r}, the session raised {entry.error!r}"
            )
        self._check_mailbox()

    def _check_mailbox(self) -> None:
        stats = self.handle.mailbox_statistics()
        assert stats.control <= stats.capacity and stats.data <= stats.capacity, (
            f"mailbox above its bound: {stats}"
        )

    def _burst(self, program: Iterable[dst.FencedCommand]) -> None:
        for step in program:  # no await in between: the mailbox fills
            self._tell(step)

    def _inject(self, which: str, index: int, spec: dst.OutputSpec) -> None:
        issued = list(self.trace.submitted)
        if which == "issued" and issued:
            rid = issued[index % len(issued)]
        else:
            rid = f"{self.handle.id}/e{self.handle.epoch + 5}/t0"
        # A terminal for a request whose stream is still running is something no backend can
        # produce (the engine actor stops a stream after its terminal), so it is not injected:
        # it would end the turn in the session while the engine keeps the stream.
        output = spec(rid)
        terminal = is_terminal(output, self.trace.kinds.get(rid, TurnKind.RESPONSE))
        if terminal and rid in self.runtime.engine._flights:
            return
        self.runtime.engine._route(output, terminal)

    # -- rules ------------------------------------------------------------------------------
    # Each rule is one round trip to the loop: its action, then the full check, so the state
    # is checked after every step without paying a second thread hand-off per step.

    def step(self, func: Callable[..., object], *args: object) -> None:
        """Run ``func(*args)`` (sync or async) on the machine's loop, then check everything."""

        async def run() -> None:
            result = func(*args)
            if hasattr(result, "__await__"):
                await result
            self._check_now()

        self.portal.call(run)
        self._checked_in_step = True

    async def _send(self, step: dst.FencedCommand, ask: bool) -> None:
        if ask:
            await self._ask(step)
        else:
            self._tell(step)

    @rule(pcm=dst.pcm16_chunks(), fence=dst.fences(), ask=st.booleans())
    def append(self, pcm: bytes, fence: dst.FenceChoice, ask: bool) -> None:
        self.step(self._send, dst.FencedCommand("append", fence, pcm), ask)

    @rule(
        kind=st.sampled_from(_COMMAND_KINDS),
        fence=dst.fences(),
        ask=st.booleans(),
        item=st.integers(0, len(dst.ITEM_IDS) - 1),
    )
    def command(self, kind: str, fence: dst.FenceChoice, ask: bool, item: int) -> None:
        self.step(self._send, dst.FencedCommand(kind, fence, item=item), ask)

    @rule(
        pcm=dst.pcm16_chunks(60, 200),
        interrupt=st.sampled_from((None, "barge_in", "cancel", "close")),
        ms=st.sampled_from((0, 1, 3, 8)),
    )
    def user_turn(self, pcm: bytes, interrupt: str | None, ms: int) -> None:
        """The common conversation step: speak, commit (asked), maybe interrupt after ``ms``."""

        async def turn() -> None:
            self._tell(dst.FencedCommand("append", pcm=pcm))
            await self._ask(dst.FencedCommand("commit"))
            if interrupt is not None:
                await anyio.sleep(ms / 1000)
                await self._ask(dst.FencedCommand(interrupt, dst.FenceChoice.CURRENT))

        self.step(turn)

    @rule(program=dst.command_programs(_BURST_KINDS, max_size=12, audio=dst.pcm16_chunks(20, 60)))
    def burst(self, program: list[dst.FencedCommand]) -> None:
        """Many commands told back to back, with no chance for the session to run between."""
        self.step(self._burst, program)

    @rule(script=dst.engine_scripts())
    def next_script(self, script: Script) -> None:
        self.book.push(script)

    @rule(ms=st.sampled_from((0, 1, 2, 5, 15)))
    def wait(self, ms: int) -> None:
        self.step(anyio.sleep, ms / 1000)

    @rule(which=st.sampled_from(("issued", "unknown")), index=st.integers(0, 50), spec=_ANY_OUTPUT)
    def inject_engine_output(self, which: str, index: int, spec: dst.OutputSpec) -> None:
        """Output routed as if the engine sent it: for an earlier request (stale, or an aborted
        one whose stream is still open), or for a request no session registered."""
        self.step(self._inject, which, index, spec)

    # -- checks -----------------------------------------------------------------------------

    def _replay(self, entry: TraceEntry) -> None:
        where = f"{entry.kind} {entry.item!r}"
        if entry.kind == "fail":
            raise AssertionError(f"the session failed ({entry.item}): an internal error in the runtime")
        if entry.kind == "expire":
            exp = self.model.lease_ran_out(entry.item)
        elif entry.kind == "command":
            if entry.error is not None and not isinstance(entry.error, DuplexError):
                raise AssertionError(f"{where}: the session raised {entry.error!r}") from entry.error
            exp = self.model.command(entry.item)
            got = None if entry.error is None else type(entry.error)
            assert got is exp.error, (
                f"{where} in model state {self.model.state}: session answered {got}, model expects {exp.error}"
            )
        else:
            if entry.error is not None:
                raise AssertionError(f"{where}: the session raised {entry.error!r}") from entry.error
            exp = self.model.output(entry.item)
        _check_actions(entry.actions, exp, where)

    def _check_now(self) -> None:
        entries = self.trace.entries
        while self.replayed < len(entries):
            entry = entries[self.replayed]
            self.replayed += 1
            self._replay(entry)
        core = self.handle.core
        problems = self.model.mismatches(core)
        assert not problems, "session differs from the model:\n  " + "\n  ".join(problems)
        check_lease_accounting(core, f"after {self.replayed} processed messages")
        new, self.fed = self.received[self.fed :], len(self.received)
        self.checker.feed(new)
        n = len(self.checker.terminals)
        assert self.checker.terminals == self.model.terminals[:n], (
            f"terminal events differ from the model:\n  got      {self.checker.terminals}\n"
            f"  expected {self.model.terminals[:n]}"
        )
        processed: dict[Lane, list[str]] = {Lane.CONTROL: [], Lane.DATA: []}
        for entry in entries:
            if entry.kind == "command" and entry.item.event_id is not None:
                processed[self.lane_of.get(entry.item.event_id, entry.item.LANE)].append(entry.item.event_id)
        for lane, ids in processed.items():
            assert ids == self.sent[lane][: len(ids)], (
                f"{lane.name} lane: processed {ids}, accepted in order {self.sent[lane]}"
            )
        self._check_mailbox()
        if self.engine_contract_each_step:
            self._check_engine_contract()
        for rid, _record in self.backend.streams.items():
            assert rid in self.trace.submitted, f"the engine got {rid}, which the session never submitted"

    @invariant()
    def runtime_matches_model(self) -> None:
        # Rules check on the loop as part of their step (see ``step``); this covers the
        # initial state and rules a subclass adds without using ``step``.
        if self._checked_in_step:
            self._checked_in_step = False
        else:
            self.portal.call(self._check_now)

    # -- the end of a run -------------------------------------------------------------------

    async def _settle(self) -> None:
        if not self.handle._actor._finished:
            await self._ask(dst.FencedCommand("close"))
        deadline = time.monotonic() + self.settle_timeout_s
        while (self._consumer is not None and not self._consumer.done()) or self.backend.open_streams():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not settled {self.settle_timeout_s}s after close: events ended="
                    f"{self._consumer is None or self._consumer.done()}, "
                    f"streams still open={self.backend.open_streams()}"
                )
            await anyio.sleep(0.001)

    def _check_engine_contract(self) -> None:
        assert not self.backend.violations, "engine contract broken:\n  " + "\n  ".join(
            self.backend.violations
        )

    def _final_checks(self) -> None:
        self._check_now()
        self._check_engine_contract()
        self.checker.assert_complete()
        assert self.checker.terminals == self.model.terminals, (
            f"terminal events differ from the model:\n  got      {self.checker.terminals}\n"
            f"  expected {self.model.terminals}"
        )
        assert self.handle.core.closed, "the session is not closed after close"
        inner = self.backend.inner
        if isinstance(inner, ScriptedEngine):
            leaked = [r for r in inner.active if r.startswith(self.handle.id)]
            assert not leaked, f"requests still active in the engine after close: {leaked}"
        close_tick = next(
            (
                e.tick
                for e in self.trace.entries
                if self.model.state == CLOSED
                and e.kind in ("command", "expire")
                and (
                    (e.kind == "expire" and e.item is not None)
                    or (e.kind == "command" and e.item.TRIGGER == "close" and e.error is None)
                )
            ),
            None,
        )
        if close_tick is not None:
            late = [rid for rid, tick in self.trace.submitted.items() if tick > close_tick]
            assert not late, f"requests submitted after close: {late}"

    def teardown(self) -> None:
        try:
            self.portal.call(self._settle)
            self.portal.call(self._final_checks)
        finally:
            self._shutdown()
