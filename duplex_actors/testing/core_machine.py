"""``SessionCoreMachine``: a hypothesis state machine that drives the sans-IO
:class:`~duplex_actors.SessionCore` next to its pure model and checks every session invariant
after every step; subclass it to check a session policy of your own. The checks shared with
:class:`~.runtime_machine.RuntimeMachine` (the engine actions a step must produce, the lease's
accounting) and the configuration both machines run are here too. Overview and use:
:mod:`duplex_actors.testing.machine`.
"""

from __future__ import annotations

from typing import Any, cast

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ..core import commands as cmd
from ..core.actions import AbortRequests, EngineAction, SubmitTurn
from ..core.clock import ManualClock
from ..core.engine_io import EngineOutput, TurnKind
from ..core.session import SessionCore
from ..core.session_config import SessionConfig
from ..errors import DuplexError
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
#: Bursts fill the mailbox with every kind of command but close, which would end the session
#: the burst is meant to fill.
_BURST_KINDS = tuple(kind for kind in dst.COMMAND_KINDS if kind != "close")


def _check_actions(actions: list[EngineAction], exp: Expectation, where: str) -> None:
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


def _snapshot(core: SessionCore) -> tuple[object, ...]:
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
        return self._settle(exp, where, was_closed)

    def feed(self, output: EngineOutput) -> Expectation:
        """Deliver one engine output to core and model and check the step."""
        core = self.core
        was_closed = core.state == CLOSED
        where = f"{output!r} in state {core.state}"
        exp = self.model.output(output, self.clock.now())
        core.on_engine_output(output)
        return self._settle(exp, where, was_closed)

    def _settle(self, exp: Expectation, where: str, was_closed: bool) -> Expectation:
        """The step's engine actions (none once closed) and every invariant after it."""
        actions = self.core.take_actions()
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
    def append(self, pcm: bytes, fence: dst.FenceChoice, rate: int) -> None:
        epoch = fence.resolve(self.core.epoch)
        self.send(cmd.AppendAudio(pcm=pcm, sample_rate=rate, epoch=epoch, event_id=f"c{self.steps}"))

    @rule(
        kind=st.sampled_from(_COMMAND_KINDS),
        fence=dst.fences(),
        audio_ms=st.integers(0, 10_000),
        item=st.integers(0, len(dst.ITEM_IDS) - 1),
    )
    def command(self, kind: str, fence: dst.FenceChoice, audio_ms: int, item: int) -> None:
        epoch = fence.resolve(self.core.epoch)
        self.send(
            dst.make_command(kind, audio_ms=audio_ms, item=item, epoch=epoch, event_id=f"c{self.steps}")
        )

    @rule(pcm=dst.pcm16_chunks(60, 200))
    def user_turn(self, pcm: bytes) -> None:
        """The common conversation step: speak, then commit."""
        self.send(cmd.AppendAudio(pcm=pcm, event_id=f"c{self.steps}"))
        self.send(cmd.CommitInput(event_id=f"c{self.steps}"))

    @rule(
        fence=dst.fences(stale=True, ahead=True),
        reason=st.sampled_from(("turn_detected", "client_cancelled")),
    )
    def barge_in_with_reason(self, fence: dst.FenceChoice, reason: str) -> None:
        self.send(cmd.BargeIn(reason=reason, epoch=fence.resolve(self.core.epoch)))

    # -- rules: engine outputs --------------------------------------------------------------

    @precondition(lambda self: self.model.turn_request is not None)
    @rule(data=st.data())
    def engine_output(self, data: st.DataObject) -> None:
        """Output of the live request (current fence)."""
        rid = cast(str, self.model.turn_request)  # the precondition: not None
        self.feed(data.draw(_ANY_OUTPUT, label="output")(rid))

    @precondition(lambda self: self.model.turn_request is not None)
    @rule(data=st.data())
    def engine_streams(self, data: st.DataObject) -> None:
        """A typical stream: several deltas, sometimes a terminal."""
        rid = cast(str, self.model.turn_request)  # the precondition: not None
        for spec in data.draw(_STREAM, label="stream"):
            self.clock.advance(0.01)
            self.feed(spec(rid))
        if data.draw(st.booleans(), label="ends"):
            self.feed(data.draw(_TERMINAL_OUTPUT, label="terminal")(rid))

    @rule(data=st.data(), which=st.sampled_from(("issued", "aborting", "unknown")))
    def stale_engine_output(self, data: st.DataObject, which: str) -> None:
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
    def detach(self) -> None:
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
    )
    def resume(self, credentials: str, key: str, missed: str, control_id: str | None) -> None:
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
    def reaper(self) -> None:
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
    def advance_clock(self, dt: float) -> None:
        self.clock.advance(dt)

    @rule(reading=st.booleans())
    def client_reads(self, reading: bool) -> None:
        self.reading = reading

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        problems = self.model.mismatches(self.core)
        assert not problems, "session differs from the model:\n  " + "\n  ".join(problems)

    @invariant()
    def in_flight_count_matches_registered_requests(self) -> None:
        check_lease_accounting(self.core, f"after step {self.steps}")

    @invariant()
    def epoch_never_decreases(self) -> None:
        assert self.core.epoch >= self.last_epoch, f"epoch went back {self.last_epoch} -> {self.core.epoch}"
        self.last_epoch = self.core.epoch

    @invariant()
    def closed_is_absorbing(self) -> None:
        if self.closed_seen:
            assert self.core.state == CLOSED, f"left closed for {self.core.state}"
        self.closed_seen = self.core.state == CLOSED

    @invariant()
    def event_stream(self) -> None:
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
