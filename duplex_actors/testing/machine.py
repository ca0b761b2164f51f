"""Hypothesis state machines that check every session invariant; subclass them for your engine.

Two bases, both ``hypothesis.stateful.RuleBasedStateMachine``:

``SessionCoreMachine``
    drives the sans-IO :class:`~duplex_actors.SessionCore` synchronously, on a
    :class:`~duplex_actors.ManualClock`, next to a pure :class:`~.model.SessionModel`. Rules send
    commands (with current, missing and stale epoch fences), synthetic engine outputs (of the
    live request and of stale ones) and move the clock. Hooks: :meth:`session_config`,
    :meth:`make_core` (e.g. a core on your own compiled chart: a session *policy*).

``RuntimeMachine``
    drives the real :class:`~duplex_actors.Runtime` (session actor, mailbox, dispatcher,
    engine actor) on a backend from :meth:`make_engine` (a ScriptedEngine playing hypothesis-
    drawn scripts by default; return your own backend to check it). It owns one event loop per
    machine instance, in a thread behind an anyio blocking portal, because hypothesis rules
    cannot be async. Commands are told or asked, alone or in bursts that fill the mailbox;
    engine latencies, failures and hangs come from drawn scripts; stale output is injected at
    the engine router. Hooks: :meth:`make_engine`, :meth:`session_config`,
    :meth:`runtime_options`.

Checked after every step (issue 2, item 9):

* closed is absorbing and no engine action (nothing reaches the engine) after close;
* at most one active response; every response.created gets exactly one response.done, with
  deltas only in between;
* the epoch never decreases and moves exactly on barge-in / response.cancel (explicit or by
  the overlap policy); no event of an old epoch after its terminal event;
* the timing ledger is empty after end of response, barge-in and close (in fact whenever no
  model turn is in flight); TTFT / TTFP recorded at most once per response, never negative,
  and (on the manual clock) exactly what the clock says;
* an illegal command raises the typed error the model predicts and changes nothing;
* runtime only: every accepted command is processed exactly once, in order per lane (or, after
  a close, refused); the mailbox never holds more than its bound per lane; the engine backend
  honours its contract (only its own request id, nothing after a terminal, a normal end only
  after a terminal, nothing after ``abort``, every stream ends once aborted).

Use::

    from duplex_actors.testing import RuntimeMachine

    class MyEngineMachine(RuntimeMachine):
        def make_engine(self):
            return MyBackend(...)

    TestMyEngine = MyEngineMachine.TestCase   # pytest collects it
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from typing import Any

import anyio
import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ..actors.runtime import Runtime, SessionHandle
from ..core import commands as cmd
from ..core.actions import AbortRequests, SubmitTurn
from ..core.clock import ManualClock
from ..core.commands import Lane
from ..core.engine_io import EngineOutput, ModelTurnRequest, TurnKind, is_terminal
from ..core.session import SessionCore
from ..core.session_config import SessionConfig
from ..engines.base import EngineBackend
from ..engines.scripted import Script, ScriptedEngine
from ..errors import DuplexError, MailboxFull, SessionClosed
from ..logconfig import ensure_configured
from . import strategies as dst
from .model import CLOSED, EventStreamChecker, Expectation, SessionModel

#: A session config that makes the interesting paths reachable in a few dozen steps: small
#: input and committed-audio bounds (backpressure; commits past the bound keep the newest), a
#: short overlap threshold (barge-in by speech), and a lease and journal that run out within a
#: run (expiry, ResyncRequired).
TEST_CONFIG = SessionConfig(
    max_input_bytes=16000 * 2 * 2,
    max_committed_bytes=16000 * 2 * 3 // 10,
    min_interruption_ms=300,
    idle_ttl_s=20.0,
    disconnect_grace_s=10.0,
    journal_max_events=24,
    journal_max_age_s=30.0,
)

#: The API key digest the machines' sessions are bound to (as the server binds them).
OWNER_KEY = b"owner key digest"

_ANY_OUTPUT = dst.engine_output_specs()
_TERMINAL_OUTPUT = dst.engine_output_specs(terminal=True)
_STREAM = st.lists(dst.engine_output_specs(terminal=False), max_size=4)

# Weighted by repetition; close is rare so most runs spend their steps on an open session.
_COMMAND_KINDS = (
    "commit",
    "commit",
    "commit",
    "clear",
    "create_response",
    "create_response",
    "barge_in",
    "barge_in",
    "barge_in",
    "cancel",
    "cancel",
    "heartbeat",
    "speech_started",
    "speech_started",
    "speech_stopped",
    "close",
    "cancel_other",
    "create_item",
    "delete_item",
    "retrieve_item",
)
_BURST_KINDS = (
    "append",
    "commit",
    "clear",
    "create_response",
    "barge_in",
    "cancel",
    "heartbeat",
    "speech_started",
    "speech_stopped",
    "cancel_other",
    "create_item",
    "delete_item",
    "retrieve_item",
)


def _check_actions(actions: list, exp: Expectation, where: str) -> None:
    submits = [(a.request.request_id, len(a.request.audio)) for a in actions if isinstance(a, SubmitTurn)]
    aborts = [tuple(a.request_ids) for a in actions if isinstance(a, AbortRequests)]
    assert submits == exp.submits, f"{where}: engine submissions {submits}, expected {exp.submits}"
    assert aborts == exp.aborts, f"{where}: engine aborts {aborts}, expected {exp.aborts}"
    for a in actions:
        if isinstance(a, SubmitTurn):
            assert a.request.kind is TurnKind.RESPONSE, f"{where}: unexpected {a.request.kind}"


def check_lease_accounting(core: SessionCore, where: str = "") -> None:
    """The lease counts exactly the requests the session has registered as in flight.

    A count with no request behind it pins the session against idle expiry for ever (a turn
    that ended without releasing the lease); a request with no count lets it expire mid-turn."""
    registered = core.in_flight_requests
    assert core.lease.in_flight == len(registered), (
        f"{where}: lease counts {core.lease.in_flight} in flight, the session has registered "
        f"{sorted(registered)}"
    )


def _snapshot(core: SessionCore) -> tuple:
    """Everything an illegal command must leave untouched."""
    counters = attrs.asdict(core.counters)
    counters.pop("commands"), counters.pop("rejected")
    return (
        core.state,
        core.epoch,
        core.turn_id,
        core.buffered_input_bytes,
        core.response_id,
        core.in_flight_requests,
        core.aborting_requests,
        core.timing.is_empty,
        core.timing.bound_start,
        core.pending_events,
        core.last_seq,
        tuple(counters.items()),
        core.lease.in_flight,
        core.lease.last_activity,
        core.lease.generation,
        core.lease.token,
        core.lease.detached_at,
        core.journaled_events,
        core.close_reason,
    )


# =============================================================================================
# The sans-IO core
# =============================================================================================


class SessionCoreMachine(RuleBasedStateMachine):
    """Drives one SessionCore next to a pure model; every invariant checked after every step."""

    session_id = "sess_testing0001"

    def __init__(self) -> None:
        super().__init__()
        ensure_configured()  # as Runtime does: per-transition debug lines must cost nothing
        self.clock = ManualClock(1000.0)
        config = self.session_config()
        self.core = self.make_core(self.session_id, config, self.clock)
        # The session is bound to the API key that opened it (as the server binds it).
        self.core.lease.owner = OWNER_KEY
        self.model = self.make_model(self.session_id, config)
        self.model.owner = OWNER_KEY
        self.model.token = self.core.lease.token  # what session.created told the client
        self.model.last_activity = self.clock.now()
        #: Every event the client was handed, by seq; the replays a resume still owes it.
        self.received: dict[int, Any] = {}
        self.owed_replay: list[int] = []
        #: (control_id, generation, token, last_seq) of the last accepted resume that had a
        #: control_id: what a client whose answer was lost sends again.
        self.last_resume: tuple[str, int, str, int] | None = None
        self.checker = EventStreamChecker()
        self.reading = True  # the client reads events after every step (a slow one does not)
        self.last_epoch = 0
        self.closed_seen = False
        self.steps = 0

    # -- hooks for subclasses ---------------------------------------------------------------

    def session_config(self) -> SessionConfig:
        """The config of the session under test (cascaded mode; model_native is not modelled)."""
        return TEST_CONFIG

    def make_model(self, session_id: str, config: SessionConfig) -> SessionModel:
        """The reference model the session is compared with: override to swap in your own
        (a SessionModel subclass that knows your policy's extra rules)."""
        return SessionModel(session_id, config)

    def make_core(self, session_id: str, config: SessionConfig, clock: ManualClock) -> SessionCore:
        """Build the core under test: override to check your own chart or core subclass."""
        return SessionCore(session_id, config, clock)

    # -- driving ----------------------------------------------------------------------------

    def send(self, command: cmd.Command) -> Expectation:
        """Apply one command to core and model and check the step. Returns the expectation."""
        core = self.core
        was_closed = core.state == CLOSED
        before = _snapshot(core)
        exp = self.model.command(command, self.clock.now())
        raised: DuplexError | None = None
        try:
            core.handle(command)
        except DuplexError as err:
            raised = err
        where = f"{command!r} in state {before[0]}"
        if exp.error is not None:
            assert raised is not None, f"{where}: accepted; expected {exp.error.__name__}"
            assert type(raised) is exp.error, (
                f"{where}: raised {type(raised).__name__}, expected {exp.error.__name__}"
            )
            assert raised.event_id == command.event_id, f"{where}: the error lost the client's event_id"
            after = _snapshot(core)
            assert after == before, f"{where}: refused, yet the session changed:\n{before}\n{after}"
        else:
            assert raised is None, f"{where}: raised {raised!r}, expected it to be accepted"
        actions = core.take_actions()
        if was_closed:
            assert not actions, f"{where}: engine actions after close: {actions}"
        _check_actions(actions, exp, where)
        self._after(exp, where)
        return exp

    def feed(self, output: EngineOutput) -> Expectation:
        """Deliver one engine output to core and model and check the step."""
        core = self.core
        was_closed = core.state == CLOSED
        where = f"{output!r} in state {core.state}"
        exp = self.model.output(output, self.clock.now())
        core.on_engine_output(output)
        actions = core.take_actions()
        if was_closed:
            assert not actions, f"{where}: engine actions after close: {actions}"
        _check_actions(actions, exp, where)
        self._after(exp, where)
        return exp

    def _after(self, exp: Expectation, where: str) -> None:
        self.steps += 1
        if exp.timing_reset:
            assert self.core.timing.is_empty, f"{where}: timing state left after end/barge-in/close"
        if exp.epoch_moved:
            assert self.core.epoch == self.last_epoch + 1, f"{where}: a cancel must move the epoch by one"

    # -- rules: commands --------------------------------------------------------------------

    @rule(pcm=dst.pcm16_chunks(), fence=dst.fences(), rate=st.sampled_from((16000, 16000, 16000, 8000)))
    def append(self, pcm, fence, rate):
        epoch = fence.resolve(self.core.epoch)
        self.send(cmd.AppendAudio(pcm=pcm, sample_rate=rate, epoch=epoch, event_id=f"c{self.steps}"))

    @rule(
        kind=st.sampled_from(_COMMAND_KINDS),
        fence=dst.fences(),
        audio_ms=st.integers(0, 10_000),
        item=st.integers(0, len(dst.ITEM_IDS) - 1),
    )
    def command(self, kind, fence, audio_ms, item):
        epoch = fence.resolve(self.core.epoch)
        self.send(
            dst.make_command(kind, audio_ms=audio_ms, item=item, epoch=epoch, event_id=f"c{self.steps}")
        )

    @rule(pcm=dst.pcm16_chunks(60, 200))
    def user_turn(self, pcm):
        """The common conversation step: speak, then commit."""
        self.send(cmd.AppendAudio(pcm=pcm, event_id=f"c{self.steps}"))
        self.send(cmd.CommitInput(event_id=f"c{self.steps}"))

    @rule(
        fence=dst.fences(stale=True, ahead=True),
        reason=st.sampled_from(("turn_detected", "client_cancelled")),
    )
    def barge_in_with_reason(self, fence, reason):
        self.send(cmd.BargeIn(reason=reason, epoch=fence.resolve(self.core.epoch)))

    # -- rules: engine outputs --------------------------------------------------------------

    @precondition(lambda self: self.model.turn_request is not None)
    @rule(data=st.data())
    def engine_output(self, data):
        """Output of the live request (current fence)."""
        rid = self.model.turn_request
        self.feed(data.draw(_ANY_OUTPUT, label="output")(rid))

    @precondition(lambda self: self.model.turn_request is not None)
    @rule(data=st.data())
    def engine_streams(self, data):
        """A typical stream: several deltas, sometimes a terminal."""
        rid = self.model.turn_request
        for spec in data.draw(_STREAM, label="stream"):
            self.clock.advance(0.01)
            self.feed(spec(rid))
        if data.draw(st.booleans(), label="ends"):
            self.feed(data.draw(_TERMINAL_OUTPUT, label="terminal")(rid))

    @rule(data=st.data(), which=st.sampled_from(("issued", "aborting", "unknown")))
    def stale_engine_output(self, data, which):
        """Output of a request that is not (or no longer) the live one."""
        pool = {
            "issued": [r for r in self.model.issued if r != self.model.turn_request],
            "aborting": sorted(self.model.aborting),
        }.get(which) or []
        unknown = f"{self.session_id}/e{self.model.epoch + 7}/t{self.model.turn_id}"
        rid = pool[data.draw(st.integers(0, len(pool) - 1), label="index")] if pool else unknown
        self.feed(data.draw(_ANY_OUTPUT, label="output")(rid))

    # -- rules: the lease -------------------------------------------------------------------

    @rule()
    def detach(self):
        self.send(cmd.Detach(event_id=f"c{self.steps}"))

    @rule(
        credentials=st.sampled_from(
            (
                "current",
                "current",
                "stale_generation",
                "wrong_token",
                "replay",
                "replay_forged",
                "replay_for_more",
            )
        ),
        key=st.sampled_from(("owner", "owner", "other", "none")),
        missed=st.sampled_from(("nothing", "some", "everything")),
        control_id=st.sampled_from((None, "ctl-1", "ctl-2")),
        takeover=st.booleans(),
    )
    def resume(self, credentials, key, missed, control_id, takeover):
        generation, token = self.core.lease.generation, self.model.token or "?"
        if credentials == "stale_generation":
            generation = max(generation - 1, 0) if generation else generation + 1
        elif credentials == "wrong_token":
            token = "not-the-token"
        seen = max(self.received, default=0)
        last_seq = {"nothing": seen, "some": seen // 2, "everything": 0}[missed]
        if credentials.startswith("replay") and self.last_resume is not None:
            # The same frame again (a retry), with a forged token, or asking for more of the
            # journal than the original did (a captured frame, edited).
            control_id, generation, token, last_seq = self.last_resume
            if credentials == "replay_forged":
                token = "forged"
            elif credentials == "replay_for_more":
                last_seq = max(last_seq - 1, 0)
        command = cmd.Resume(
            generation=generation,
            resume_token=token,
            last_seq=last_seq,
            control_id=control_id,
            key_digest={"owner": OWNER_KEY, "other": b"another key", "none": None}[key],
            takeover=takeover,
            event_id=f"c{self.steps}",
        )
        lease_before = (self.core.lease.generation, self.core.lease.token)
        exp = self.send(command)
        if not exp.resumed:
            return
        if exp.replayed_resume:
            # The same answer again: nothing rotates.
            assert (self.core.lease.generation, self.core.lease.token) == lease_before, (
                "a replayed resume moved the lease"
            )
        else:
            assert self.core.lease.token != lease_before[1], "an accepted resume kept the old token"
            self.model.learn_token(self.core.lease.token)
            self.last_resume = None if control_id is None else (control_id, generation, token, last_seq)
        # The journal's events after last_seq are re-sent, ahead of anything still pending; a
        # replay not yet read is replaced (the new one holds all of it after last_seq).
        self.owed_replay = exp.replay_seqs

    @rule()
    def reaper(self):
        """The reaper's expiry is processed now: only a lease that has run out closes."""
        core = self.core
        where = f"expiry in state {core.state}"
        before = _snapshot(core)
        exp = self.model.expire(self.clock.now())
        core.expire()
        actions = core.take_actions()
        if not exp.terminals:  # the lease holds (or the session is closed): a stale expiry
            assert _snapshot(core) == before, f"{where}: a stale expiry changed the session"
        _check_actions(actions, exp, where)
        self._after(exp, where)

    # -- rules: time and the client ---------------------------------------------------------

    @rule(dt=st.sampled_from((0.0, 0.001, 0.02, 0.25, 1.5, 12.0)))
    def advance_clock(self, dt):
        self.clock.advance(dt)

    @rule(reading=st.booleans())
    def client_reads(self, reading):
        self.reading = reading

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def matches_model(self):
        problems = self.model.mismatches(self.core)
        assert not problems, "session differs from the model:\n  " + "\n  ".join(problems)

    @invariant()
    def in_flight_count_matches_registered_requests(self):
        check_lease_accounting(self.core, f"after step {self.steps}")

    @invariant()
    def epoch_never_decreases(self):
        assert self.core.epoch >= self.last_epoch, f"epoch went back {self.last_epoch} -> {self.core.epoch}"
        self.last_epoch = self.core.epoch

    @invariant()
    def closed_is_absorbing(self):
        if self.closed_seen:
            assert self.core.state == CLOSED, f"left closed for {self.core.state}"
        self.closed_seen = self.core.state == CLOSED

    @invariant()
    def event_stream(self):
        if not self.reading:
            return
        events = self.core.take_events()
        # A resume re-sends the journaled events the client said it missed, first and in
        # order; a client drops what it already has (seq not above the highest it holds).
        replayed = [e for e in events if e.seq in self.received]
        assert [e.seq for e in replayed] == self.owed_replay, (
            f"resume replayed seqs {[e.seq for e in replayed]}, expected {self.owed_replay}"
        )
        assert all(e is self.received[e.seq] for e in replayed), "a replay re-sent another event"
        self.owed_replay = []
        fresh = [e for e in events if e.seq not in self.received]
        self.received.update((e.seq, e) for e in fresh)
        self.model.journaled(fresh, self.clock.now())
        self.checker.feed(fresh)
        assert self.checker.terminals == self.model.terminals, (
            f"terminal events differ from the model:\n  got      {self.checker.terminals}\n"
            f"  expected {self.model.terminals}"
        )
        for rid, ttft in self.checker.ttft.items():
            assert abs(ttft - self.model.ttft[rid]) < 1e-6, (
                f"{rid}: TTFT {ttft}, clock says {self.model.ttft[rid]}"
            )
        for rid, ttfp in self.checker.ttfp.items():
            assert abs(ttfp - self.model.ttfp[rid]) < 1e-6, (
                f"{rid}: TTFP {ttfp}, clock says {self.model.ttfp[rid]}"
            )


# =============================================================================================
# The real runtime
# =============================================================================================


@attrs.define
class TraceEntry:
    tick: int
    kind: str  # command | output | expire | fail
    item: Any  # the command, the output, or the reason
    error: BaseException | None = None
    actions: list = attrs.Factory(list)


class _Trace:
    def __init__(self, tick) -> None:
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

    def __init__(self, session_id, config, clock, trace: _Trace) -> None:
        super().__init__(session_id, config, clock)
        self.trace = trace

    def _record(self, kind, item, run):
        n = len(self._actions)
        error = None
        try:
            return run()
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.trace.add(TraceEntry(next(self.trace.tick), kind, item, error, list(self._actions[n:])))

    def handle(self, command, *, received_at=None):
        return self._record(
            "command", command, lambda: SessionCore.handle(self, command, received_at=received_at)
        )

    def on_engine_output(self, output):
        return self._record("output", output, lambda: SessionCore.on_engine_output(self, output))

    def expire(self):
        # Recorded with what the lease said when the expiry ran: the model closes only then.
        verdict = self.lease.expiry(self.clock.now())
        return self._record("expire", verdict, lambda: SessionCore.expire(self))

    def fail(self, reason="session_failed"):
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

    def __init__(self, inner: EngineBackend, tick=None) -> None:
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

    def generate(self, request: ModelTurnRequest):
        rid = request.request_id
        if rid in self.streams:
            self.violations.append(f"{rid}: generate() called twice for one request")
        record = self.streams[rid] = StreamRecord(rid, next(self.tick))
        return self._stream(request, record)

    async def _stream(self, request: ModelTurnRequest, record: StreamRecord):
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
        self.received: list = []
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

    def runtime_options(self) -> dict:
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

    def _burst(self, program) -> None:
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

    def step(self, func, *args) -> None:
        """Run ``func(*args)`` (sync or async) on the machine's loop, then check everything."""

        async def run():
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
    def append(self, pcm, fence, ask):
        self.step(self._send, dst.FencedCommand("append", fence, pcm), ask)

    @rule(
        kind=st.sampled_from(_COMMAND_KINDS),
        fence=dst.fences(),
        ask=st.booleans(),
        item=st.integers(0, len(dst.ITEM_IDS) - 1),
    )
    def command(self, kind, fence, ask, item):
        self.step(self._send, dst.FencedCommand(kind, fence, item=item), ask)

    @rule(
        pcm=dst.pcm16_chunks(60, 200),
        interrupt=st.sampled_from((None, "barge_in", "cancel", "close")),
        ms=st.sampled_from((0, 1, 3, 8)),
    )
    def user_turn(self, pcm, interrupt, ms):
        """The common conversation step: speak, commit (asked), maybe interrupt after ``ms``."""

        async def turn():
            self._tell(dst.FencedCommand("append", pcm=pcm))
            await self._ask(dst.FencedCommand("commit"))
            if interrupt is not None:
                await anyio.sleep(ms / 1000)
                await self._ask(dst.FencedCommand(interrupt, dst.FenceChoice.CURRENT))

        self.step(turn)

    @rule(program=dst.command_programs(_BURST_KINDS, max_size=12, audio=dst.pcm16_chunks(20, 60)))
    def burst(self, program):
        """Many commands told back to back, with no chance for the session to run between."""
        self.step(self._burst, program)

    @rule(script=dst.engine_scripts())
    def next_script(self, script):
        self.book.push(script)

    @rule(ms=st.sampled_from((0, 1, 2, 5, 15)))
    def wait(self, ms):
        self.step(anyio.sleep, ms / 1000)

    @rule(which=st.sampled_from(("issued", "unknown")), index=st.integers(0, 50), spec=_ANY_OUTPUT)
    def inject_engine_output(self, which, index, spec):
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
    def runtime_matches_model(self):
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

    def teardown(self):
        try:
            self.portal.call(self._settle)
            self.portal.call(self._final_checks)
        finally:
            self._shutdown()
