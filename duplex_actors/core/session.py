"""SessionCore: one session's sans-IO logic, driven entirely by the statechart.

The core takes commands (:mod:`.commands`) and engine outputs (:mod:`.engine_io`), asks the
shared compiled statechart what to do, and performs the named effects on its own state. It
produces two things for the shell to carry out: server events (in its :class:`Outbox`, handed
to the client by :meth:`take_events`, which stamps ``server_event_seq``) and engine actions
(:meth:`take_actions`: submit a model turn, abort requests). It never does I/O and never reads
a clock it was not given.

This module is the driver: each trigger becomes one :class:`~.step.Step`, the chart resolves
it, and the branch's effects run with it. The guards and effects are methods of SessionCore,
so the chart's names resolve to them once and an append costs no extra indirection, but they
live with what they work on, in parts SessionCore is composed of (:mod:`.session_parts` says
how): the input (:mod:`.input_effects`), the model requests (:mod:`.turn_effects`), the
response (:mod:`.response_effects`), the conversation's items (:mod:`.item_effects`) and the
lease (:mod:`.lease_effects`). Their values live in their own modules: the settings
(:mod:`.session_config`), the actions (:mod:`.actions`), the response being assembled
(:mod:`.response`), the calls a function output may answer (:mod:`.function_calls`), the
audio the user heard (:mod:`.playback`).

Guarantees (property-tested in tests/core):
* an illegal command raises a typed error and changes nothing;
* closed is absorbing and produces no engine action after the close's own aborts;
* at most one response is active; every response.created gets exactly one response.done;
* the epoch moves exactly on cancel (barge-in, response.cancel); close does not move it (once
  closed, nothing is registered as in flight, so every output is stale anyway);
* output of an older fence is consumed and counted, never delivered;
* timing state is empty after end of response, barge-in and close.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import attrs
import structlog

from ..errors import (
    ClientError,
    DuplexError,
    EngineProtocolError,
    IllegalTransition,
)
from . import events as ev
from . import transcription_events as tev
from .actions import AbortRequests, EngineAction, InputTranscript, SubmitTurn, TranscribeInput
from .audio_budget import AudioAccount
from .clock import MONOTONIC, Clock
from .commands import (
    AppendAudio,
    Command,
    UpdateSession,
)
from .conversation import Conversation
from .engine_io import (
    Aborted,
    AudioPacket,
    Decision,
    EngineFailure,
    EngineOutput,
    FunctionCall,
    TextDelta,
    TurnDone,
    TurnKind,
    is_terminal,
)
from .function_calls import FunctionCallRegistry
from .input_buffer import InputBuffer
from .input_effects import InputEffects
from .item_effects import ItemEffects
from .journal import JournalBudget, ReplayJournal
from .lease import Lease
from .lease_effects import LeaseEffects
from .outbox import Outbox
from .playback import PlaybackLedger
from .response import ResponseAssembly
from .response_effects import ResponseEffects
from .session_config import SessionConfig, SessionCounters
from .statechart import CHART, CHECKS, CLOSED, RESPONDING, CompiledChart
from .step import Step
from .text_budget import TextAccount, settings_text_bytes
from .timing import CumulativeWindow, TimingLedger
from .turn_effects import TurnEffects
from .unit_holds import SharedWords, UnitHold

# Names that lived here before the split, re-exported so ``from duplex_actors.core.session
# import X`` keeps working; new code imports them from their own modules.
__all__ = [
    "AbortRequests",
    "EngineAction",
    "InputTranscript",
    "SessionConfig",
    "SessionCore",
    "SessionCounters",
    "SubmitTurn",
    "TranscribeInput",
]

log = structlog.get_logger("duplex_actors.session")

#: The function type a _FunctionTuples holds (an effect's or a check's).
_F = TypeVar("_F")


class _FunctionTuples(dict[tuple[str, ...], tuple[_F, ...]]):
    """Tuples of names as tuples of SessionCore functions, looked up once per distinct tuple
    instead of name by name on every step. Keyed by the tuple's value, never by object
    identity: charts built by tests come and go, and a recycled id() would hand one branch
    another's functions."""

    def __init__(self, function_of: Callable[[str], _F]) -> None:
        super().__init__()
        self._function_of = function_of

    def __missing__(self, names: tuple[str, ...]) -> tuple[_F, ...]:
        functions = self[names] = tuple(self._function_of(name) for name in names)
        return functions


#: A chart branch's effects (Resolution.effects) as functions.
_EFFECT_FUNCTIONS: _FunctionTuples[Callable[[SessionCore, Step], None]] = _FunctionTuples(
    lambda name: getattr(SessionCore, "_fx_" + name)
)


class _GuardFunctions(dict[str, Callable[["SessionCore", Step], bool]]):
    """Guard names as SessionCore functions, looked up once each, for the same reason, and one
    more: getattr with a name built per call leaves each new string in CPython's type attribute
    cache (up to 4096 of them), which a memory trace of a long run shows as slow growth (3.11;
    bounded, but noise). The chart calls them directly (resolve_on): one call per guard."""

    def __missing__(self, name: str) -> Callable[[SessionCore, Step], bool]:
        function: Callable[[SessionCore, Step], bool]
        function = self[name] = getattr(SessionCore, "_g_" + name)
        return function

    @staticmethod
    def facts(name: str, core: SessionCore, step: Step) -> dict[str, object] | None:
        """What the refusal of check ``name`` says (its message's fields), if it says more
        than its fixed words: the core's ``_facts_<name>``. Only asked when refusing."""
        facts = getattr(SessionCore, "_facts_" + name, None)
        return None if facts is None else facts(core, step)


_GUARD_FUNCTIONS = _GuardFunctions()

#: An append row's checks (CompiledChart.append_buffers_in) as functions.
_CHECK_FUNCTIONS = _FunctionTuples(_GUARD_FUNCTIONS.__getitem__)


#: Accepted commands that do not show the client has its last resume's answer: the resume
#: itself, and the detach the server sends when the resumed connection drops.
_NOT_AN_ANSWER = frozenset({"resume", "detach"})

_new_step = tuple.__new__

#: Writes an event's ``seq`` slot (ServerEvent's, shared by every event class): what
#: ``object.__setattr__(event, "seq", n)`` does on a frozen event, without its attribute lookup.
_stamp_seq = vars(ev.ServerEvent)["seq"].__set__


def _debug_logging() -> bool:
    """Whether structlog, as configured now, would emit a transition's debug event: never while
    it is unconfigured (its defaults would print every one; the library configures nothing).
    Asked once per session, at its first transition (get_config() copies the configuration)."""
    return structlog.is_configured() and _debug_enabled(structlog.get_config()["wrapper_class"])


@functools.lru_cache(maxsize=8)
def _debug_enabled(wrapper_class: type) -> bool:
    # structlog's filtering loggers replace methods below their level with a no-op.
    debug = getattr(wrapper_class, "debug", None)
    return debug is None or getattr(debug, "__name__", "") != "_nop"


class SessionCore(InputEffects, TurnEffects, ResponseEffects, ItemEffects, LeaseEffects):
    """One session, sans-IO: the statechart's state and everything its guards and effects read and
    write (input buffer, conversation, lease, journal, outbox, timing).

    Commands go in through :meth:`handle`, engine outputs through :meth:`on_engine_output`; events
    come out through :meth:`take_events` and engine work through :meth:`take_actions`. No I/O, and
    the clock is injected.
    """

    __slots__ = (
        "session_id",
        "tenant",
        "sends_history",
        "config",
        "clock",
        "chart",
        "epoch",
        "turn_id",
        "counters",
        "lease",
        "_state",
        "_input",
        "_input_ms",
        "_committed",
        "_audio_account",
        "_text_account",
        "_settings_bytes",
        "_outbox",
        "_actions",
        "_seq",
        "_journal",
        "_replay",
        "_timing",
        "_windows",
        "_turn_request",
        "_turn_kind",
        "_units",
        "_promoted_unit",
        "_offered_words",
        "_unit_seq",
        "_aborting",
        "_response",
        "_overlap_ms",
        "_hold_from",
        "_held_end",
        "_close_reason",
        "_aborted_ids",
        "_log",
        "_debug_log",
        "_playback",
        "_calls",
        "__weakref__",
        "_conversation",
        "_item_seq",
        "_next_input_item",
        "_pending_text",
        "_pending_chars",
        "_pre_speech_bytes",
        "_speaking",
        "_playing_until",
        "_idle_deadline",
        "_idle_from_ms",
        "draining",
    )

    def __init__(
        self,
        session_id: str,
        config: SessionConfig | None = None,
        clock: Clock = MONOTONIC,
        *,
        chart: CompiledChart = CHART,
        owner: bytes | None = None,
        tenant: str | None = None,
        journal_budget: JournalBudget | None = None,
        audio_account: AudioAccount | None = None,
        text_account: TextAccount | None = None,
        history: bool = False,
    ) -> None:
        self.session_id = session_id
        #: Whether its responses' requests carry the conversation's earlier items (the engine
        #: reads them: EngineCapabilities.reads_history).
        self.sends_history = history
        #: Whom the session's work counts against at shared resources (the engine's slots,
        #: the synthesiser, the recogniser); None: the session alone (core/fair_share.py).
        self.tenant = tenant
        self.config = config or SessionConfig()
        self.clock = clock
        self.chart = chart
        self.epoch = 0
        self.turn_id = 0
        self.counters = SessionCounters()
        now = clock.now()
        # owner: digest of the API key that opened the session; resumes must present it.
        self.lease = Lease(now, self.config.idle_ttl_s, self.config.disconnect_grace_s, owner)
        self._state = "idle"
        # Both buffers count against the runtime's audio budget through the client's account.
        self._audio_account = audio_account
        self._input = InputBuffer(audio_account)
        self._input_ms = 0.0  # audio ms received since the session opened (VAD timeline)
        self._committed = InputBuffer(audio_account)  # committed, not yet sent with a model turn
        self._outbox = Outbox(self.config.outbox_capacity, self.config.outbox_reserve)
        self._actions: list[EngineAction] = []
        self._seq = 0
        self._journal = ReplayJournal(
            self.config.journal_max_events,
            self.config.journal_max_bytes,
            self.config.journal_max_age_s,
            journal_budget,
        )
        self._replay: list[ev.ServerEvent] = []
        self._timing = TimingLedger()
        self._windows: CumulativeWindow | None = None
        self._turn_request: str | None = None  # request id of the active model turn
        self._turn_kind = TurnKind.RESPONSE  # its kind (a promoted unit stays a UNIT request)
        #: Model-native unit requests in flight, each with what it carries (unit_holds.py:
        #: counted in the budgets until it ends).
        self._units: dict[str, UnitHold] | None = None
        #: A unit just promoted to the turn: what it holds, counted as the response's once begun.
        self._promoted_unit: UnitHold | None = None
        #: The pending words joined for the units, offered to each until they change.
        self._offered_words: SharedWords | None = None
        self._unit_seq = 0
        self._aborting: dict[str, TurnKind] | None = None  # aborted, not yet confirmed ended
        self._response: ResponseAssembly | None = None
        self._overlap_ms: float | None = None  # audio ms of user speech over the response
        # Barge-in without talk-over: when the response's audio began to be held (the user
        # spoke over it), and the engine's end of a turn that came while it was held.
        self._hold_from: float | None = None
        self._held_end: EngineOutput | None = None
        self._close_reason: str | None = None
        self._aborted_ids: list[str] | None = None
        self._playback: PlaybackLedger | None = None  # None until the client reports any
        # What a function_call_output may answer, and the answers for the next model turn.
        # None until tools are used: most sessions never do, and opening one stays cheap.
        self._calls: FunctionCallRegistry | None = None
        # The conversation's text and the settings' count against the runtime's text budget
        # through the client's account.
        self._text_account = text_account
        self._conversation = Conversation(
            self.config.max_items, self.config.max_conversation_chars, text_account
        )
        self._settings_bytes = 0
        self._charge_settings()
        self._item_seq = 0
        self._next_input_item: str | None = None  # the item the buffered audio will become
        # User/system words not yet answered by a response, by item id: a deleted item's words,
        # or words a replayed assistant item already answered, are forgotten by id. Each item's
        # strings as the item holds them: joined here, an item of several parts kept a second
        # copy of its words, which the text budget did not count.
        self._pending_text: dict[str, tuple[str, ...]] = {}
        self._pending_chars = 0  # their length in all (bounded: see _pend_text)
        # Server VAD: the input window kept while no speech is open (None: keep everything),
        # whether speech is open, when the last response's audio finishes playing, and the
        # idle timer (deadline on this clock; the input's ms timeline when it was set).
        self._pre_speech_bytes = self._speech_window(self.config)
        self._speaking = False
        self._playing_until = 0.0
        self._idle_deadline: float | None = None
        self._idle_from_ms = 0.0
        #: Set by the drain trigger (server shutdown): the chart starts no new response.
        self.draining = False
        # Bound on first use: binding is a large part of opening a session, and an idle
        # session never logs (docs/benchmarks.md).
        self._log = None
        #: Whether this session logs its transitions (debug): decided at its first one.
        self._debug_log: bool | None = None
        self._emit(ev.SessionCreated, config=self.config.public(), resume_token=self.lease.token)

    @property
    def _logger(self) -> Any:  # structlog's get_logger() is typed Any: its class is the configuration's
        logger = self._log
        if logger is None:
            logger = self._log = log.bind(session_id=self.session_id)
        return logger

    def _transition_logging(self) -> bool:
        """Whether to build a debug event per transition (the session's first one decides)."""
        enabled = self._debug_log
        if enabled is None:
            enabled = self._debug_log = _debug_logging()
        return enabled

    # ------------------------------------------------------------------ public surface

    @property
    def state(self) -> str:
        return self._state

    @property
    def closed(self) -> bool:
        return self._state == CLOSED

    @property
    def close_reason(self) -> str | None:
        return self._close_reason

    @property
    def share_tenant(self) -> str:
        """The tenant to share by: :attr:`tenant`, else the session itself (a session no
        client was named for is a client of its own)."""
        return self.tenant or self.session_id

    @property
    def timing(self) -> TimingLedger:
        return self._timing

    @property
    def in_flight_requests(self) -> frozenset[str]:
        ids = set(self._units or ())
        if self._turn_request:
            ids.add(self._turn_request)
        return frozenset(ids)

    @property
    def aborting_requests(self) -> frozenset[str]:
        return frozenset(self._aborting or ())

    @property
    def buffered_input_bytes(self) -> int:
        return len(self._input)

    @property
    def received_audio_ms(self) -> float:
        """Audio accepted since the session opened (ms), committed, cleared or still buffered."""
        return self._input_ms

    def handle(self, command: Command, *, received_at: float | None = None) -> None:
        """Apply one client command. Raises a typed DuplexError and changes nothing if illegal."""
        trigger = command.TRIGGER
        if trigger == "append":
            checks = self.chart.append_buffers_in.get(self._state)
            if checks is not None:
                self._append_buffered(command, checks, received_at)  # type: ignore[arg-type]
                return
        now = self.clock.now()
        self.counters.commands += 1
        step = Step(trigger, now, command, received_at=now if received_at is None else received_at)
        try:
            self._fire(step)
        except DuplexError as err:
            self.counters.rejected += 1
            err.with_event_id(command.event_id)
            raise
        self._after_accepted(now, trigger, command)

    def _after_accepted(self, now: float, trigger: str, command: Command) -> None:
        """What follows every accepted client command, on either path: the lease sees
        activity, an append feeds overlap and model-native units, and an outbox that
        overflowed meanwhile closes the session as a slow consumer."""
        if self._state == CLOSED:
            return
        lease = self.lease
        lease.touch(now)
        if lease.last_resume is not None and trigger not in _NOT_AN_ANSWER:
            # The client acts on its resumed connection, so it has the resume's answer: a
            # replay of that resume is no longer its retry (Lease.answered).
            lease.answered()
        if trigger == "append":
            self._after_append(command)  # type: ignore[arg-type]
        if self._outbox.overflowed:
            self._close_slow_consumer()

    def _append_buffered(
        self, command: AppendAudio, checks: tuple[str, ...], received_at: float | None
    ) -> None:
        """An append in a state where the chart's append row is "check, then buffer": one
        branch, same state, its guards all checks, ``buffer_audio`` its only effect
        (:attr:`CompiledChart.append_buffers_in`, derived when the chart is compiled).

        Resolving that row per chunk could only repeat what the table already says, so this
        runs it directly: what :meth:`handle` does for the same append, in the same order (the
        fence, then the row's checks, each failure refused with the check's own error and
        nothing changed), the same effect, the same debug line, then the same after-steps
        (overlap, model-native units).
        """
        now = self.clock.now()
        self.counters.commands += 1
        state = self._state
        # Step's fields in order, built as the tuple it is: the generated keyword __new__ was
        # a measurable share of an append.
        step = _new_step(
            Step, ("append", now, command, None, None, None, now if received_at is None else received_at)
        )
        try:
            for check in _CHECK_FUNCTIONS[checks]:
                if not check(self, step):
                    # Refused: the row's checks asked again by name (they are pure), so the
                    # refusal is the first failing check's own, as resolving the row gives it.
                    self._run_append_checks(checks, state, step)
                    raise AssertionError("an append check failed, then passed: checks must be pure")
            self._fx_buffer_audio(step)
        except DuplexError as err:
            self.counters.rejected += 1
            err.with_event_id(command.event_id)
            raise
        debug = self._debug_log
        if debug is None:
            debug = self._transition_logging()
        if debug:
            self._log_transition("append", state, state)
        # _after_accepted, inline: these states are never closed and buffering left the state
        # as it was.
        lease = self.lease
        if now > lease.last_activity:  # Lease.touch
            lease.last_activity = now
        if lease.last_resume is not None:
            lease.answered()
        if self._overlap_ms is not None or self.config.model_native:
            self._after_append(command)
        else:
            self._input_ms += len(command.pcm) / 2 / self.config.sample_rate * 1000.0
        if self._outbox.overflowed:
            self._close_slow_consumer()

    def _run_append_checks(self, checks: tuple[str, ...], state: str, step: Step) -> None:
        """The chart's append row's checks in this state, in its order: each failure refused
        with the check's own error, as resolving the row would refuse it."""
        for name in checks:
            if not _GUARD_FUNCTIONS[name](self, step):
                raise CHECKS[name].refusal(state, "append", _GUARD_FUNCTIONS.facts(name, self, step))

    def on_engine_output(self, output: EngineOutput) -> None:
        """Route one engine output through the chart: deliver, count as stale, or end a turn."""
        rid = output.request_id
        trigger = self._classify(output)
        now = self.clock.now()
        try:
            self._fire(_new_step(Step, (trigger, now, None, output, None, None, None)))
        except IllegalTransition as err:
            # The engine produced something its request may not produce in this state: the
            # output is consumed and counted, the session carries on; it is never the client's
            # fault and never delivered.
            self.counters.invalid_outputs += 1
            self._logger.warning("engine_output_refused", request_id=rid, trigger=trigger, state=err.state)
        if self._state != CLOSED:
            # The activity is the output's step, at its time (as a command's is, in
            # _after_accepted): one clock read per output.
            lease = self.lease
            if now > lease.last_activity:  # Lease.touch, inline: every engine output passes here
                lease.last_activity = now
        # An aborted request ended (what counts as its end depends on its kind): the chart
        # settles its abort, and leaves barge_in once no other is outstanding.
        if self._aborting and rid in self._aborting and is_terminal(output, self._aborting[rid]):
            self._fire(Step("abort_confirmed", self.clock.now(), output=output))
        if self._outbox.overflowed and self._state != CLOSED:
            self._close_slow_consumer()

    def _close_slow_consumer(self) -> None:
        # After the step that overflowed, never inside it: its effects ran to completion.
        self._fire(Step("outbox_overflow", self.clock.now(), reason="slow_consumer"))

    def on_transcript(self, result: InputTranscript) -> None:
        """A committed turn's transcript arrived: the chart decides whether it is sent."""
        self._fire(Step("transcript", self.clock.now(), transcript=result))

    def expire(self) -> None:
        """The reaper saw the lease run out: the chart closes the session if it still has
        (``lease_expired``), with the lease's reason; a lease renewed since is left alone."""
        now = self.clock.now()
        self._fire(Step("expire", now, reason=self.lease.expiry(now)))

    def drain(self) -> None:
        """The server began to shut down: the response in flight may finish, and the chart
        starts no new one (``not_draining``; response.create gets ``ServerDraining``)."""
        self._fire(Step("drain", self.clock.now()))

    def idle_timeout(self) -> None:
        """The shell's idle timer ran out: the chart responds if the deadline it was set for
        still stands (``idle_deadline_passed``); speech or a turn since makes it stale."""
        self._fire(Step("idle_timeout", self.clock.now()))

    @property
    def idle_deadline(self) -> float | None:
        """When server VAD's idle timeout runs out, on this core's clock (None: no timer).
        The shell sets a timer for it and calls :meth:`idle_timeout` when it fires."""
        return self._idle_deadline

    def check(self, command: Command) -> None:
        """Raise the typed refusal ``command`` would meet now, changing nothing.

        For a shell that must know the chart's answer before an irreversible step of its own:
        the server pushes an attached connection out only for a resume the chart accepts. The
        command itself is then handled as usual, and the chart decides again."""
        step = Step(command.TRIGGER, self.clock.now(), command)
        try:
            # An append where the row is "check, then buffer" (server VAD asks about every
            # chunk before it hears it): the row's checks are all resolving it could do.
            checks = self.chart.append_buffers_in.get(self._state) if step.trigger == "append" else None
            if checks is not None:
                self._run_append_checks(checks, self._state, step)
            else:
                self.chart.resolve_on(
                    self, _GUARD_FUNCTIONS, self._state, step.trigger, step
                )  # guards are pure
        except DuplexError as err:
            err.with_event_id(command.event_id)
            raise

    def fail(self, reason: str = "session_failed") -> None:
        """The shell hit an unexpected error: close this session (and only it)."""
        self._fire(Step("fail", self.clock.now(), reason=reason))

    def emit_error(self, err: DuplexError) -> None:
        """Tell the client a command of theirs failed (for commands that were *told*)."""
        if self._state == CLOSED:
            return
        self._emit(
            ev.ErrorEvent,
            code=err.code,
            message=err.message,
            error_type="invalid_request_error" if isinstance(err, ClientError) else "server_error",
            error_class=type(err).__name__,
            client_event_id=err.event_id,
            param=getattr(err, "param", None),
        )

    def take_actions(self) -> list[EngineAction]:
        actions = self._actions
        if not actions:  # most messages produce none: leave the core's list in place
            return []
        self._actions = []
        return actions

    def has_events(self) -> bool:
        # The outbox's queue read directly: the shell asks after every dispatch.
        return bool(self._replay or self._outbox._q)

    def take_events(self, limit: int | None = None) -> list[ev.ServerEvent]:
        """Hand pending events to the client, stamping server_event_seq and journaling them."""
        out: list[ev.ServerEvent] = []
        if self._replay:
            out, self._replay = self._replay, []
        fresh = self._outbox.take(None if limit is None else limit - len(out))
        if not fresh:
            return out
        seq = self._seq
        for event in fresh:
            seq += 1
            # Stamped in place: the outbox held the only reference (events are created by
            # _emit with seq=0 and never shared before this point), so nobody can observe the
            # change, and it saves an attrs.evolve copy, the largest single cost of a turn
            # (profile in docs/benchmarks.md).
            _stamp_seq(event, seq)
        self._seq = seq
        # Only what the outbox held is journaled: a replay's events already are.
        self._journal.record_all(fresh, self.clock.now())
        if out:
            out.extend(fresh)
            return out
        return fresh

    def expire_journal(self) -> int:
        """Drop journaled events older than the journal's age limit; returns how many.

        The journal evicts as it records, so without this a session that went quiet would keep
        its last events (up to ``journal_max_events``) for as long as it stays open. The runtime
        calls it from its reaper; a resume that needed them gets ``ResyncRequired``, exactly as
        if the session had gone on talking."""
        return self._journal.expire(self.clock.now())

    def _g_settings_within_budget(self, step: Step) -> bool:
        # Total, as every guard: only an update that sets instructions or tools adds text.
        account = self._text_account
        command = step.command
        if account is None or not isinstance(command, UpdateSession):
            return True
        if command.instructions is None and command.tools is None:
            return True
        config = self.config
        after = settings_text_bytes(
            config.instructions if command.instructions is None else command.instructions,
            config.tools if command.tools is None else command.tools,
        )
        growth = after - self._settings_bytes
        return growth <= 0 or account.budget.allows(account, growth)

    def _charge_settings(self) -> None:
        """Count the settings' text (instructions, tools) as they are now in the text budget."""
        held = settings_text_bytes(self.config.instructions, self.config.tools)
        if self._text_account is not None:
            self._text_account.add(held - self._settings_bytes)
        self._settings_bytes = held

    @property
    def audio_account(self) -> AudioAccount | None:
        """The client's account in the runtime's audio budget (None: no budget, or closed):
        what else the session's audio occupies (its turns waiting for the recogniser) counts
        there too."""
        return self._audio_account

    def release_budgets(self) -> None:
        """The session has closed: its journal stops counting against the runtime's journal
        budget, and its input audio against the audio budget (its client's share is then split
        among one client fewer once it was the client's last session)."""
        self._journal.release()
        account, self._audio_account = self._audio_account, None
        if account is not None:
            self._input.detach()
            self._committed.detach()
            account.leave()
        text, self._text_account = self._text_account, None
        if text is not None:
            self._conversation.detach()
            response = self._response
            held = self._settings_bytes + (0 if response is None else response.held_text)
            text.add(-held)
            text.leave()

    @property
    def journaled_events(self) -> int:
        return len(self._journal)

    @property
    def journaled_bytes(self) -> int:
        """What the journal counts against ``journal_max_bytes`` (an estimate, see journal.py)."""
        return self._journal.bytes

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def pending_events(self) -> int:
        return len(self._outbox) + len(self._replay)

    @property
    def outbox_overflowed(self) -> bool:
        return self._outbox.overflowed

    @property
    def outbox_depth(self) -> int:
        """Events in the outbox, queued or held, not yet taken by the client."""
        return self._outbox.depth

    @property
    def outbox_audio_bytes(self) -> int:
        """Bytes of response audio in the outbox, queued or held, not yet taken by the client."""
        return self._outbox.audio_bytes

    # ------------------------------------------------------------------ the chart

    def _fire(self, step: Step) -> None:
        """One chart step: resolve ``step``'s trigger in the current state, enter the branch's
        destination and perform its effects in order, each given the step."""
        source = self._state
        trigger = step.trigger
        resolution = self.chart.resolve_on(self, _GUARD_FUNCTIONS, source, trigger, step)
        self._state = resolution.dest
        for effect in _EFFECT_FUNCTIONS[resolution.effects]:
            effect(self, step)
        # Not for closed: session.closed says it, and it must stay the last event.
        if resolution.dest != source and self.config.state_events and resolution.dest != CLOSED:
            self._emit(ev.StateChanged, source=source, dest=resolution.dest, trigger=trigger)
        if resolution.dest != source or resolution.effects:
            debug = self._debug_log
            if debug is None:
                debug = self._transition_logging()
            if debug:
                self._log_transition(trigger, source, resolution.dest)

    def _log_transition(self, trigger: str, source: str, dest: str) -> None:
        self._logger.debug(
            "transition", trigger=trigger, src=source, dest=dest, epoch=self.epoch, turn_id=self.turn_id
        )

    def _classify(self, output: EngineOutput) -> str:
        rid = output.request_id
        is_turn = rid == self._turn_request
        is_unit = self._units is not None and rid in self._units
        if not (is_turn or is_unit):
            return "stale_output"
        # The kinds a stream repeats first (the output classes are unrelated: order is only cost).
        if isinstance(output, AudioPacket):
            return "audio_packet"
        if isinstance(output, TextDelta):
            return "text_delta"
        if isinstance(output, Decision):
            return "speak" if output.speak else "listen"
        if isinstance(output, FunctionCall):
            return "function_call"
        if isinstance(output, TurnDone):
            return "turn_done" if is_turn else "listen"
        if isinstance(output, (EngineFailure, Aborted)):
            return "turn_failed"
        raise EngineProtocolError(f"unknown engine output {output!r}")

    def _after_append(self, command: AppendAudio) -> None:
        ms = len(command.pcm) / 2 / self.config.sample_rate * 1000.0
        self._input_ms += ms
        if self._overlap_ms is not None and self._state == RESPONDING and command.speech is not False:
            self._overlap_ms += ms
            # The chart decides (overlap_is_interruption): a long overlap cancels as a barge-in
            # does, with the reason a detected turn has.
            now = self.clock.now()
            self._fire(Step("overlap", now, reason="turn_detected", received_at=now))
        if self.config.model_native:
            unit_bytes = self.config.unit_samples * 2
            while len(self._input) >= unit_bytes and self._state != CLOSED:
                before = len(self._input)
                self._fire(Step("unit_ready", self.clock.now()))
                if len(self._input) == before:
                    break  # the chart chose to keep buffering

    # ------------------------------------------------------------------ guards and effects
    # Those of the session as a whole; the rest live with what they work on (the parts above).

    # The preconditions (statechart.PRECONDITIONS): every row of their triggers reads them first.
    # Every command has an epoch (Command's field); a step without a command has none. Read
    # directly rather than by getattr: these two run on every command, appends included.
    def _g_epoch_not_stale(self, step: Step) -> bool:
        command = step.command
        epoch = None if command is None else command.epoch
        return epoch is None or epoch >= self.epoch

    def _g_epoch_not_ahead(self, step: Step) -> bool:
        command = step.command
        epoch = None if command is None else command.epoch
        return epoch is None or epoch <= self.epoch

    def _facts_epoch_not_stale(self, step: Step) -> dict[str, object]:
        return {"epoch": getattr(step.command, "epoch", None), "session_epoch": self.epoch}

    _facts_epoch_not_ahead = _facts_epoch_not_stale

    def _fx_emit_transcript(self, step: Step) -> None:
        result = cast(InputTranscript, step.transcript)
        if result.error is not None:
            self._emit(tev.TranscriptionFailed, item_id=result.item_id, message=result.error)
            return
        delta = result.text if result.delta is None else result.delta
        if delta:
            self._emit(tev.TranscriptionDelta, item_id=result.item_id, delta=delta)
        if result.final:
            self._emit(tev.TranscriptionCompleted, item_id=result.item_id, transcript=result.text)

    def _fx_apply_session_update(self, step: Step) -> None:
        cmd = cast(UpdateSession, step.command)
        changes = {
            k: getattr(cmd, k)
            for k in (
                "auto_respond",
                "respond_on_commit",
                "model_native",
                "state_events",
                "server_vad",
                "instructions",
                "min_interruption_ms",
                "interrupt_response",
                "modalities",
                "tools",
                "tool_choice",
                "output_sample_rate",
                "output_speed",
            )
            if getattr(cmd, k) is not None
        }
        if cmd.sampling is not None or cmd.reset_sampling:
            # Knob by knob, as every other field of an update: a later update that sets only
            # max_output_tokens kept no temperature set earlier.
            knobs = (
                {} if cmd.sampling is None else attrs.asdict(cmd.sampling, filter=lambda _, v: v is not None)
            )
            knobs.update(dict.fromkeys(cmd.reset_sampling))
            changes["sampling"] = attrs.evolve(self.config.sampling, **knobs)
        if cmd.transcription is not None:
            changes["transcription"] = cmd.transcription or None  # False turns it off
        if cmd.transcription_language is not None:
            changes["transcription_language"] = cmd.transcription_language
        if cmd.speech_prefix_ms is not None:
            changes["speech_prefix_ms"] = cmd.speech_prefix_ms
        if cmd.idle_timeout_ms is not None:
            changes["idle_timeout_ms"] = cmd.idle_timeout_ms or None  # 0 turns it off
        self.config = config = attrs.evolve(self.config, **changes)
        if "instructions" in changes or "tools" in changes:
            self._charge_settings()
        self._pre_speech_bytes = self._speech_window(config)
        if cmd.server_vad is not None:
            # New turn detection settings start a new detector (the server builds one per
            # update): any speech the old one had open is not going to close.
            self._speaking = False
        if cmd.model_native is False:
            # Units still deciding were asked in a mode the client has left: a "speak" of theirs
            # now has no row (it was refused as the engine's fault) and a "listen" was reported.
            self._fx_abort_units(step)
        if config.idle_timeout_ms is None or not config.server_vad:
            self._idle_deadline = None
        elif cmd.idle_timeout_ms and self.counters.responses:
            self._fx_start_idle_timer(step)  # a new timeout counts from now, after a response
        self._emit(ev.SessionUpdated, config=config.public())
        if config.state_events and cmd.state_events:
            # Turned on (or again): where the chart is now, so the client starts from it.
            self._emit(ev.StateChanged, source=self._state, dest=self._state, trigger="update")

    def _fx_emit_session_closed(self, step: Step) -> None:
        reason = self._reason(step) if step.command is not None or step.reason else "closed"
        self._close_reason = reason
        self._idle_deadline = None
        self._input.clear()
        self._committed.clear()
        self._pending_text = {}
        self._pending_chars = 0
        self._withdraw_offered_words()
        self._conversation.clear()
        if self._windows is not None:
            self._windows.clear()
        self._emit(ev.SessionClosedEvent, reason=reason)
