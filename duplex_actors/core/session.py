"""SessionCore: one session's sans-IO logic, driven entirely by the statechart.

The core takes commands (:mod:`.commands`) and engine outputs (:mod:`.engine_io`), asks the
shared compiled statechart what to do, and performs the named effects on its own state. It
produces two things for the shell to carry out: server events (in its :class:`Outbox`, handed
to the client by :meth:`take_events`, which stamps ``server_event_seq``) and engine actions
(:meth:`take_actions`: submit a model turn, abort requests). It never does I/O and never reads
a clock it was not given.

This module is the driver: the guards and effects stay methods of SessionCore, so the chart's
names resolve to them once and an append costs no extra indirection. What they work on lives
next to it: the settings (:mod:`.session_config`), the actions (:mod:`.actions`), the response
being assembled (:mod:`.response`), the calls a function output may answer
(:mod:`.function_calls`), the audio the user heard (:mod:`.playback`).

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
from collections.abc import Callable, Iterable
from typing import cast

import attrs
import structlog

from ..errors import (
    ClientError,
    DuplexError,
    EngineProtocolError,
    IllegalTransition,
    InvalidItem,
    ItemNotFound,
)
from . import events as ev
from . import function_events as fev
from . import transcription_events as tev
from .actions import AbortRequests, EngineAction, InputTranscript, SubmitTurn, TranscribeInput
from .clock import MONOTONIC, Clock
from .commands import (
    AddFunctionOutput,
    AppendAudio,
    Command,
    CreateItem,
    CreateResponse,
    DeleteItem,
    PlaybackAck,
    Resume,
    RetrieveItem,
    SpeechStartedSignal,
    SpeechStoppedSignal,
    TruncateItem,
    UpdateSession,
)
from .conversation import ContentPart, Conversation, Item
from .engine_io import (
    Aborted,
    AudioPacket,
    Decision,
    EngineFailure,
    EngineOutput,
    FunctionCall,
    FunctionTool,
    ModelTurnRequest,
    SamplingOverrides,
    TextDelta,
    TurnDone,
    TurnKind,
    is_terminal,
)
from .fence import Fence
from .function_calls import FunctionCallRegistry
from .input_buffer import InputBuffer
from .journal import JournalBudget, ReplayJournal
from .lease import Lease
from .outbox import Outbox
from .overlap import OverlapPolicy, OverlapVerdict
from .playback import PlaybackLedger
from .response import ResponseAssembly
from .session_config import SessionConfig, SessionCounters
from .statechart import CHART, CHECKS, CLOSED, RESPONDING, CompiledChart
from .step import Step
from .timing import CumulativeWindow, TimingLedger

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


# Effect-name tuples as SessionCore functions, looked up once per distinct tuple instead of by
# name on every event. Keyed by the tuple's value, never by object identity: charts built by
# tests come and go, and a recycled id() would hand one branch another's effects.
_EFFECT_FUNCTIONS: dict[tuple[str, ...], tuple] = {}


class _GuardFunctions(dict):
    """Guard names as SessionCore functions, looked up once each, for the same reason, and one
    more: getattr with a name built per call leaves each new string in CPython's type attribute
    cache (up to 4096 of them), which a memory trace of a long run shows as slow growth (3.11;
    bounded, but noise). The chart calls them directly (resolve_on): one call per guard."""

    def __missing__(self, name: str) -> Callable[[SessionCore, Step], bool]:
        function = self[name] = getattr(SessionCore, "_g_" + name)
        return function

    @staticmethod
    def facts(name: str, core: SessionCore, step: Step) -> dict[str, object] | None:
        """What the refusal of check ``name`` says (its message's fields), if it says more
        than its fixed words: the core's ``_facts_<name>``. Only asked when refusing."""
        facts = getattr(SessionCore, "_facts_" + name, None)
        return None if facts is None else facts(core, step)


_GUARD_FUNCTIONS = _GuardFunctions()


def _effect_functions(resolution) -> tuple:
    effects = resolution.effects
    functions = _EFFECT_FUNCTIONS.get(effects)
    if functions is None:
        functions = tuple(getattr(SessionCore, "_fx_" + e) for e in effects)
        _EFFECT_FUNCTIONS[effects] = functions
    return functions


#: Accepted commands that do not show the client has its last resume's answer: the resume
#: itself, and the detach the server sends when the resumed connection drops.
_NOT_AN_ANSWER = frozenset({"resume", "detach"})


def _debug_logging() -> bool:
    """Whether structlog, as configured now, would emit a transition's debug event: never while
    it is unconfigured (its defaults would print every one; the library configures nothing).
    Asked once per session, at its first transition (get_config() copies the configuration)."""
    return structlog.is_configured() and _debug_enabled(structlog.get_config()["wrapper_class"])


@functools.lru_cache(maxsize=8)
def _debug_enabled(wrapper_class) -> bool:
    # structlog's filtering loggers replace methods below their level with a no-op.
    debug = getattr(wrapper_class, "debug", None)
    return debug is None or getattr(debug, "__name__", "") != "_nop"


def _answered_call(command: Command) -> str | None:
    """The call_id a command answers with a function output, if it does."""
    if isinstance(command, AddFunctionOutput):
        return command.call_id
    if isinstance(command, CreateItem) and command.item.type == "function_call_output":
        return command.item.call_id or ""
    return None


class SessionCore:
    """One session, sans-IO: the statechart's state and everything its guards and effects read and
    write (input buffer, conversation, lease, journal, outbox, timing).

    Commands go in through :meth:`handle`, engine outputs through :meth:`on_engine_output`; events
    come out through :meth:`take_events` and engine work through :meth:`take_actions`. No I/O, and
    the clock is injected.
    """

    __slots__ = (
        "session_id",
        "tenant",
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
    ) -> None:
        self.session_id = session_id
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
        self._input = InputBuffer()
        self._input_ms = 0.0  # audio ms received since the session opened (VAD timeline)
        self._committed = InputBuffer()  # committed, not yet sent with a model turn
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
        self._units: set[str] | None = None  # model-native unit requests in flight
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
        self._conversation = Conversation(self.config.max_items, self.config.max_conversation_chars)
        self._item_seq = 0
        self._next_input_item: str | None = None  # the item the buffered audio will become
        # User/system words not yet answered by a response, by item id: a deleted item's words,
        # or words a replayed assistant item already answered, are forgotten by id.
        self._pending_text: dict[str, str] = {}
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
        # Bound on first use: binding costs ~6 us, a third of opening a session, and an idle
        # session never logs (docs/benchmarks.md).
        self._log = None
        #: Whether this session logs its transitions (debug): decided at its first one.
        self._debug_log: bool | None = None
        self._emit(ev.SessionCreated, config=self.config.public(), resume_token=self.lease.token)

    @property
    def _logger(self):
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
    def fence(self) -> Fence:
        return Fence(self.session_id, self.epoch, self.turn_id)

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
    def response_id(self) -> str | None:
        return None if self._response is None else self._response.response_id

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
        step = Step("append", now, command, received_at=now if received_at is None else received_at)
        try:
            for name in checks:
                if not _GUARD_FUNCTIONS[name](self, step):
                    raise CHECKS[name].refusal(state, "append", _GUARD_FUNCTIONS.facts(name, self, step))
            self._fx_buffer_audio(step)
        except DuplexError as err:
            self.counters.rejected += 1
            err.with_event_id(command.event_id)
            raise
        if self._transition_logging():
            self._log_transition("append", state, state)
        self._after_accepted(now, "append", command)

    def on_engine_output(self, output: EngineOutput) -> None:
        """Route one engine output through the chart: deliver, count as stale, or end a turn."""
        rid = output.request_id
        trigger = self._classify(output)
        try:
            self._fire(Step(trigger, self.clock.now(), output=output))
        except IllegalTransition as err:
            # The engine produced something its request may not produce in this state: the
            # output is consumed and counted, the session carries on; it is never the client's
            # fault and never delivered.
            self.counters.invalid_outputs += 1
            self._logger.warning("engine_output_refused", request_id=rid, trigger=trigger, state=err.state)
        if self._state != CLOSED:
            self.lease.touch(self.clock.now())
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
            self.chart.resolve_on(self, _GUARD_FUNCTIONS, self._state, step.trigger, step)  # guards are pure
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
        return bool(self._replay) or bool(self._outbox)

    def take_events(self, limit: int | None = None) -> list[ev.ServerEvent]:
        """Hand pending events to the client, stamping server_event_seq and journaling them."""
        out: list[ev.ServerEvent] = []
        if self._replay:
            out, self._replay = self._replay, []
        now = self.clock.now()
        box = self._outbox
        while box and (limit is None or len(out) < limit):
            self._seq += 1
            event = box.popleft()
            # Stamped in place: the outbox held the only reference (events are created by
            # _emit with seq=0 and never shared before this point), so nobody can observe the
            # change, and it saves an attrs.evolve copy, the largest single cost of a turn
            # (profile in docs/benchmarks.md).
            object.__setattr__(event, "seq", self._seq)
            self._journal.record(event, now)
            out.append(event)
        return out

    def expire_journal(self) -> int:
        """Drop journaled events older than the journal's age limit; returns how many.

        The journal evicts as it records, so without this a session that went quiet would keep
        its last events (up to ``journal_max_events``) for as long as it stays open. The runtime
        calls it from its reaper; a resume that needed them gets ``ResyncRequired``, exactly as
        if the session had gone on talking."""
        return self._journal.expire(self.clock.now())

    def release_journal_budget(self) -> None:
        """The session has closed: its journal stops counting against the runtime's budget."""
        self._journal.release()

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

    # ------------------------------------------------------------------ the chart

    def _fire(self, step: Step) -> None:
        """One chart step: resolve ``step``'s trigger in the current state, enter the branch's
        destination and perform its effects in order, each given the step."""
        source = self._state
        trigger = step.trigger
        resolution = self.chart.resolve_on(self, _GUARD_FUNCTIONS, source, trigger, step)
        self._state = resolution.dest
        for effect in _effect_functions(resolution):
            effect(self, step)
        # Not for closed: session.closed says it, and it must stay the last event.
        if resolution.dest != source and self.config.state_events and resolution.dest != CLOSED:
            self._emit(ev.StateChanged, source=source, dest=resolution.dest, trigger=trigger)
        if (resolution.dest != source or resolution.effects) and self._transition_logging():
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
        if isinstance(output, Decision):
            return "speak" if output.speak else "listen"
        if isinstance(output, (TextDelta, AudioPacket, FunctionCall)):
            return "output"
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

    # ------------------------------------------------------------------ guards
    # Pure predicates over the core and the trigger's context: the chart may ask any of them
    # and, when nothing holds, ask again to name the refusal (statechart.CHECKS). Each one is
    # defined in every context (a tool may record all of them at every step): asked about a
    # trigger it does not belong to, it answers from what it has (False for the resume checks).

    # The two append checks run on every append: written for speed (a try costs nothing
    # unless it catches, and it only catches when asked outside an append).
    def _g_audio_at_session_rate(self, step: Step) -> bool:
        try:
            return cast(AppendAudio, step.command).sample_rate == self.config.sample_rate
        except AttributeError:
            return False

    def _g_input_fits(self, step: Step) -> bool:
        try:
            return len(self._input) + len(cast(AppendAudio, step.command).pcm) <= self.config.max_input_bytes
        except AttributeError:
            return True

    # The preconditions (statechart.PRECONDITIONS): every row of their triggers reads them first.
    def _g_epoch_not_stale(self, step: Step) -> bool:
        epoch = getattr(step.command, "epoch", None)
        return epoch is None or epoch >= self.epoch

    def _g_epoch_not_ahead(self, step: Step) -> bool:
        epoch = getattr(step.command, "epoch", None)
        return epoch is None or epoch <= self.epoch

    def _facts_epoch_not_stale(self, step: Step) -> dict[str, object]:
        return {"epoch": getattr(step.command, "epoch", None), "session_epoch": self.epoch}

    _facts_epoch_not_ahead = _facts_epoch_not_stale

    def _g_answers_known_call(self, step: Step) -> bool:
        call_id = None if step.command is None else _answered_call(step.command)
        return call_id is None or (self._calls is not None and call_id in self._calls)

    def _facts_answers_known_call(self, step: Step) -> dict[str, object]:
        return {"call_id": None if step.command is None else _answered_call(step.command)}

    def _g_input_items_known(self, step: Step) -> bool:
        return self._unknown_input_item(step) is None

    def _facts_input_items_known(self, step: Step) -> dict[str, object]:
        index, item_id = self._unknown_input_item(step) or (None, None)
        return {"index": index, "item_id": item_id}

    def _unknown_input_item(self, step: Step) -> tuple[int, str] | None:
        """The first item id (with its place) the response's own input names that the
        conversation does not hold, if any."""
        cmd = step.command
        if isinstance(cmd, CreateResponse) and cmd.input:
            for i, entry in enumerate(cmd.input):
                if isinstance(entry, str) and entry not in self._conversation:
                    return i, entry
        return None

    def _g_played_ms_monotonic(self, step: Step) -> bool:
        cmd = step.command
        return not (
            isinstance(cmd, PlaybackAck)
            and self._playback is not None
            and cmd.played_ms < self._playback.played_ms(cmd.response_id)
        )

    def _resume_command(self, step: Step) -> Resume | None:
        command = step.command
        return command if isinstance(command, Resume) else None

    def _g_resume_key_matches(self, step: Step) -> bool:
        c = self._resume_command(step)
        return c is not None and self.lease.owned_by(c.key_digest)

    def _g_replays_last_resume(self, step: Step) -> bool:
        c = self._resume_command(step)
        return c is not None and self.lease.replays(
            c.control_id, c.generation, c.resume_token, c.last_seq, step.now
        )

    def _g_no_takeover(self, step: Step) -> bool:
        c = self._resume_command(step)
        return c is not None and not c.takeover

    def _g_resume_generation_current(self, step: Step) -> bool:
        c = self._resume_command(step)
        return c is not None and c.generation == self.lease.generation

    def _g_resume_token_matches(self, step: Step) -> bool:
        c = self._resume_command(step)
        return c is not None and self.lease.token_matches(c.resume_token)

    def _g_journal_holds_last_seq(self, step: Step) -> bool:
        c = self._resume_command(step)
        return c is not None and self._journal.holds_after(c.last_seq, step.now)

    def _g_lease_expired(self, step: Step) -> bool:
        return self.lease.expiry(step.now) is not None

    def _g_idle_deadline_passed(self, step: Step) -> bool:
        deadline = self._idle_deadline
        return deadline is not None and step.now >= deadline

    def _g_has_buffered_audio(self, step: Step) -> bool:
        return len(self._input) > 0

    def _g_auto_respond(self, step: Step) -> bool:
        return self.config.auto_respond

    def _g_server_vad(self, step: Step) -> bool:
        return self.config.server_vad

    def _g_not_draining(self, step: Step) -> bool:
        return not self.draining

    def _g_model_native(self, step: Step) -> bool:
        return self.config.model_native

    def _g_respond_on_commit(self, step: Step) -> bool:
        return self.config.respond_on_commit

    def _g_names_active_response(self, step: Step) -> bool:
        wanted = getattr(step.command, "response_id", None)
        return wanted is None or wanted == self.response_id

    def _g_response_begun(self, step: Step) -> bool:
        return self._response is not None

    def _g_aborts_settled(self, step: Step) -> bool:
        # No abort outstanding besides the one whose end is being confirmed (if any is).
        aborting = self._aborting
        if not aborting:
            return True
        output = step.output
        return output is not None and len(aborting) == 1 and output.request_id in aborting

    def _g_interrupt_response(self, step: Step) -> bool:
        return self.config.interrupt_response

    def _g_holds_audio_on_speech(self, step: Step) -> bool:
        return self.config.hold_audio_on_speech

    def _g_audio_held(self, step: Step) -> bool:
        return self._hold_from is not None

    def _g_turn_end_held(self, step: Step) -> bool:
        return self._held_end is not None

    def _g_update_ends_overlap(self, step: Step) -> bool:
        # Total, as every guard: tools (the SCXML check) ask each guard on every step.
        cmd = step.command
        return isinstance(cmd, UpdateSession) and (
            cmd.server_vad is not None or cmd.interrupt_response is not None
        )

    def _g_overlap_is_interruption(self, step: Step) -> bool:
        overlap = self._overlap_ms
        if overlap is None:
            return False
        verdict = OverlapPolicy(self.config.min_interruption_ms).judge(overlap, still_speaking=True)
        return verdict is OverlapVerdict.BARGE_IN

    # ------------------------------------------------------------------ effects

    def _emit(self, cls, **fields) -> None:
        event = cls(seq=0, epoch=fields.pop("epoch", self.epoch), session_id=self.session_id, **fields)
        # A push that does not fit marks the outbox overflowed; the chart's outbox_overflow row
        # closes the session once the current step is done (_close_slow_consumer).
        self._outbox.push(event)

    def _fx_buffer_audio(self, step: Step) -> None:
        buffered = self._input
        buffered += cast(AppendAudio, step.command).pcm
        window = self._pre_speech_bytes
        # Under server VAD, audio before the user speaks is only the turn's prefix padding:
        # a microphone streaming quiet kept all of it, until appends were refused as
        # input_backpressure (after 120 s) and the next turn carried minutes of silence.
        if window is not None and not self._speaking and len(buffered) > window:
            buffered.keep_last(window)

    @staticmethod
    def _speech_window(config: SessionConfig) -> int | None:
        """Bytes of input kept while no speech is open: the prefix padding under server VAD,
        everything otherwise (the client commits what it sent; a model-native model hears
        every unit, quiet included, and decides for itself)."""
        if not config.server_vad or config.model_native:
            return None
        return int(config.speech_prefix_ms * config.sample_rate / 1000) * 2

    def _fx_open_speech(self, step: Step) -> None:
        self._speaking = True
        self._idle_deadline = None  # the user is not idle

    def _fx_close_speech(self, step: Step) -> None:
        self._speaking = False
        # Speech that became no turn (a backchannel over a response) is not kept past the
        # window either; the rows run this after any commit of the speech, so a turn is whole.
        window = self._pre_speech_bytes
        if window is not None and len(self._input) > window:
            self._input.keep_last(window)
        self._fx_start_idle_timer(step)

    def _fx_start_idle_timer(self, step: Step) -> None:
        """Set server VAD's idle timer, if the session has one: the quiet counts from when the
        last response's audio finishes playing (now, if it has), never while the user speaks
        or a turn is in flight."""
        config = self.config
        timeout = config.idle_timeout_ms
        if (
            timeout is None
            or not config.server_vad
            or self._speaking
            or self._turn_request is not None
            or self.lease.detached  # nobody to prompt: the timer starts again on resume
        ):
            return
        now = step.now
        self._idle_deadline = max(now, self._playing_until) + timeout / 1000.0
        self._idle_from_ms = self._input_ms

    def _fx_emit_timeout_triggered(self, step: Step) -> None:
        # The audio written since the quiet began (GA: audio_end_ms - audio_start_ms is about
        # the timeout when the client streams its microphone; equal when it sends nothing).
        timeout = self.config.idle_timeout_ms or 0
        end = self._input_ms
        start = max(self._idle_from_ms, end - timeout)
        self._emit(
            ev.InputTimeoutTriggered,
            audio_start_ms=int(start),
            audio_end_ms=int(end),
            item_id=self._input_item_id(),
        )

    def _fx_clear_input(self, step: Step) -> None:
        self._input = InputBuffer()
        self._next_input_item = None
        self._emit(ev.InputCleared)

    def _fx_emit_speech_started(self, step: Step) -> None:
        cmd = cast(SpeechStartedSignal, step.command)
        self._emit(ev.SpeechStarted, audio_start_ms=cmd.audio_ms, item_id=self._input_item_id())

    def _fx_emit_speech_stopped(self, step: Step) -> None:
        cmd = cast(SpeechStoppedSignal, step.command)
        self._emit(ev.SpeechStopped, audio_end_ms=cmd.audio_ms, item_id=self._input_item_id())

    def _fx_start_overlap(self, step: Step) -> None:
        self._overlap_ms = 0.0

    def _fx_end_overlap(self, step: Step) -> None:
        # The speech ended before the minimum: a backchannel; the response carries on.
        self._overlap_ms = None

    def _fx_hold_response_audio(self, step: Step) -> None:
        # From now on the client gets none of this response's audio until the overlap policy
        # decides. A response not begun yet is held by the id it will be given. A text-only
        # response talks over nobody: nothing is held. Text beside audio is held with it, so
        # the response's deltas still reach the client in the order they were made.
        r = self._response
        modalities = r.modalities if r is not None else self._response_modalities(step)
        if "audio" not in modalities:
            return
        self._hold_from = step.now
        rid = r.response_id if r is not None else self._next_response_id()
        self._outbox.hold(rid, text="text" in modalities)

    def _fx_release_held_audio(self, step: Step) -> None:
        if self._hold_from is None:
            return
        now = step.now
        self.counters.released_audio_events += self._outbox.release()
        # What was held plays from now: the idle timeout counts from its end.
        if self._playing_until > self._hold_from:
            self._playing_until += max(now - self._hold_from, 0.0)
        self._hold_from = None
        # A turn end that waited for this (_held_end) is completed by the row's next effects.

    def _fx_hold_turn_end(self, step: Step) -> None:
        self._held_end = step.output

    def _fx_commit_input(self, step: Step) -> None:
        # Audio committed but not yet answered accumulates: several commits before one
        # response.create all reach the engine (OpenAI's conversation keeps every user item),
        # within max_committed_bytes, the newest kept. Unbounded, a client that commits and
        # never asks for a response held all of it, and the bytes += copied it all each time.
        audio = bytes(self._input)
        self._input = InputBuffer()
        committed = self._committed
        committed += audio
        if len(committed) > self.config.max_committed_bytes:
            committed.keep_last(self.config.max_committed_bytes - self.config.max_committed_bytes % 2)
        ms = int(len(audio) / 2 / self.config.sample_rate * 1000)
        item = Item(
            id=self._input_item_id(), role="user", content=(ContentPart(type="input_audio", audio_ms=ms),)
        )
        self._next_input_item = None
        previous = self._conversation.add(item)
        self._emit(ev.InputCommitted, item_id=item.id, audio_ms=ms, previous_item_id=previous)
        self._emit(ev.ItemAdded, item=item, previous_item_id=previous)
        self._emit(ev.ItemDone, item=item, previous_item_id=previous)
        if self.config.transcription is not None:
            self._actions.append(
                TranscribeInput(item.id, audio, self.config.sample_rate, self.config.transcription_language)
            )

    def _new_item_id(self) -> str:
        self._item_seq += 1
        return f"item_{self.session_id[-8:]}_{self._item_seq}"

    def _input_item_id(self) -> str:
        """The id the buffered user audio will have once committed (speech events name it)."""
        if self._next_input_item is None:
            self._next_input_item = self._new_item_id()
        return self._next_input_item

    def _context_words(self, context: tuple[Item | str, ...]) -> str:
        """The words of a response's own context: its items, or the conversation's items by id
        (the chart's ``input_items_known`` refused unknown ids), in order; an assistant's audio by its transcript."""
        words = []
        for entry in context:
            item = self._conversation.get(entry) if isinstance(entry, str) else entry
            if item.type == "function_call_output":
                words.append(item.output or "")
            else:
                words.extend(p.text or p.transcript or "" for p in item.content)
        return " ".join(w for w in words if w)

    def _request(
        self, step: Step, kind: TurnKind, audio: bytes, request_id: str, words: str | None = None
    ) -> ModelTurnRequest:
        cmd = step.command
        instructions = getattr(cmd, "instructions", None) or self.config.instructions
        shown = self._response_modalities(step)
        tools, tool_choice, sampling = self._response_options(step)
        return ModelTurnRequest(
            request_id=request_id,
            fence=self.fence,
            kind=kind,
            audio=audio,
            sample_rate=self.config.sample_rate,
            output_sample_rate=self.config.output_sample_rate,
            speed=self.config.output_speed,
            instructions=instructions,
            sampling=sampling,
            # The engine always writes the words: an audio response's transcript is its text.
            modalities=("text", "audio") if "audio" in shown else ("text",),
            submitted_at=step.now,
            input_text=" ".join(self._pending_text.values()) if words is None else words,
            tools=tools,
            tool_choice=tool_choice,
            tenant=self.tenant,
        )

    def _response_options(self, step: Step) -> tuple[tuple[FunctionTool, ...], str, SamplingOverrides]:
        """Tools, tool_choice and sampling for the response being created: the session's,
        unless its response.create set them for itself."""
        config = self.config
        tools, tool_choice, sampling = config.tools, config.tool_choice, config.sampling
        cmd = step.command
        if isinstance(cmd, CreateResponse):
            if cmd.tools is not None:
                tools = cmd.tools
            tool_choice = cmd.tool_choice or tool_choice
            if cmd.max_tokens is not None:
                sampling = attrs.evolve(sampling, max_tokens=cmd.max_tokens or None)
        return tools, tool_choice, sampling

    def _response_modalities(self, step: Step) -> tuple[str, ...]:
        override = getattr(step.command, "modalities", None)
        if isinstance(step.command, CreateResponse) and override:
            return override
        return self.config.modalities

    def _fx_submit_model_turn(self, step: Step) -> None:
        cmd = step.command
        asked = cmd if isinstance(cmd, CreateResponse) else None
        results: tuple = ()
        if asked is not None and asked.input is not None:
            # Its own context (GA response.input): the pending turn waits for its response.
            audio, words = b"", self._context_words(asked.input)
        else:
            audio, words = bytes(self._committed), " ".join(self._pending_text.values())
        # Out of band, or on its own context, a response leaves the pending turn (read, not
        # taken) for the default conversation's next response.
        if asked is None or (asked.input is None and not asked.out_of_band):
            self._committed = InputBuffer()
            results = () if self._calls is None else self._calls.take_results()
            self._pending_text = {}
            self._pending_chars = 0
        request = self._request(step, TurnKind.RESPONSE, audio, self.fence.request_id(), words)
        if results:
            request = attrs.evolve(request, function_results=results)
        self._turn_request = request.request_id
        self._turn_kind = TurnKind.RESPONSE
        self._overlap_ms = None
        self._idle_deadline = None  # a turn is in flight: nobody waits on the user
        self._timing.note_request_start(request.fence, step.now, self.epoch)
        self.lease.in_flight += 1
        self._actions.append(SubmitTurn(request))
        # The response exists as soon as it is accepted (OpenAI sends response.created then,
        # not at the first token), so a cancel right after it still gets its created + done.
        self._fx_begin_response(step)

    def _fx_submit_unit(self, step: Step) -> None:
        unit_bytes = self.config.unit_samples * 2
        audio = bytes(self._input[:unit_bytes])
        del self._input[:unit_bytes]
        self._unit_seq += 1
        request = self._request(step, TurnKind.UNIT, audio, self.fence.request_id(self._unit_seq))
        if self._units is None:
            self._units = set()
        self._units.add(request.request_id)
        # While the turn is pending, the latest accepted unit owns the request start.
        self._timing.note_request_start(request.fence, step.now, self.epoch)
        self.lease.in_flight += 1
        self._actions.append(SubmitTurn(request))

    def _fx_promote_unit(self, step: Step) -> None:
        rid = cast(EngineOutput, step.output).request_id
        assert self._units is not None  # the chart promotes only a registered unit (model_native)
        self._units.discard(rid)
        self._turn_request = rid
        self._turn_kind = TurnKind.UNIT
        # Other units still deciding would answer for a turn that has already begun; they no
        # longer hold the lease, only the promoted turn does.
        self._fx_abort_units(step)

    def _fx_emit_decision(self, step: Step) -> None:
        out = step.output
        speak = isinstance(out, Decision) and out.speak
        self._emit(ev.DecisionEvent, decision="speak" if speak else "listen", turn_id=self.turn_id)

    def _fx_finish_unit(self, step: Step) -> None:
        rid = cast(EngineOutput, step.output).request_id
        if self._units and rid in self._units:
            self._units.discard(rid)
            self.lease.in_flight -= 1

    def _next_response_id(self) -> str:
        return f"resp_{self.session_id[-6:]}_{self.epoch}_{self.turn_id}"

    def _fx_begin_response(self, step: Step) -> None:
        now = step.now
        if self._turn_request is None:  # model-native promotion already set it
            self._turn_request = cast(EngineOutput, step.output).request_id
            self._turn_kind = TurnKind.RESPONSE
        rid = self._next_response_id()
        cmd = step.command
        asked = cmd if isinstance(cmd, CreateResponse) else None
        metadata = asked.metadata if asked is not None else None
        out_of_band = asked is not None and asked.out_of_band
        r = self._response = ResponseAssembly(
            rid,
            self._new_item_id(),
            self.epoch,
            self.turn_id,
            self._response_modalities(step),
            metadata,
            in_conversation=not out_of_band,
        )
        r.max_output_tokens = self._response_options(step)[2].max_tokens
        self._timing.bind(self.turn_id, rid, now)
        self.counters.responses += 1
        self._emit(
            ev.ResponseCreated,
            response_id=rid,
            item_id=r.item_id,
            turn_id=self.turn_id,
            metrics=self._timing.snapshot(),
            modalities=r.modalities,
            metadata=metadata,
            max_output_tokens=r.max_output_tokens,
            out_of_band=out_of_band,
        )
        # The assistant message is opened by its first words or audio (_open_message): a
        # response that only calls functions carries only its function_call items (GA).

    def _open_message(self, r: ResponseAssembly) -> None:
        """Open the response's assistant message as its next output item."""
        r.open_message()
        # Under the response's epoch: a cancel (which moved the session's) may open it.
        ids = {
            "response_id": r.response_id,
            "item_id": r.item_id,
            "output_index": r.message_index,
            "epoch": r.epoch,
        }
        item = r.item("in_progress")
        self._emit(ev.OutputItemAdded, item=item, **ids)
        if r.in_conversation:
            previous = self._conversation.add(item)
            self._emit(ev.ItemAdded, item=item, previous_item_id=previous, epoch=r.epoch)
        self._emit(ev.ContentPartAdded, part_type=r.part_type, **ids)

    def _fx_deliver_output(self, step: Step) -> None:
        out = step.output
        now = step.now
        r = self._response
        assert r is not None  # the chart's deliver rows run only once the response has begun
        if isinstance(out, FunctionCall):
            self._deliver_function_call(out, r)
            return
        if isinstance(out, TextDelta):
            if not out.text:
                return
            if r.message_index is None:
                self._open_message(r)
            first = self._timing.on_text(now, out.token_count)
            r.output_tokens += out.token_count
            metrics = self._timing.snapshot() if first else None
            # The words of an audio response go out once, as its transcript.
            words, event = (
                (r.transcript, ev.TranscriptDeltaEvent) if r.spoken else (r.text, ev.TextDeltaEvent)
            )
            words.append(out.text)
            self._emit(
                event,
                response_id=r.response_id,
                item_id=r.item_id,
                output_index=r.message_index,
                delta=out.text,
                metrics=metrics,
            )
        else:
            if "audio" not in r.modalities:
                return  # a text-only response: audio the engine sent anyway is not the client's
            out = cast(AudioPacket, out)  # the chart's deliver rows: text, audio or a call
            if r.message_index is None:
                self._open_message(r)
            first = self._timing.on_audio(now, out.duration_s)
            r.audio = True
            r.audio_ms += out.duration_s * 1000.0
            # The client plays packets back to back from the first: the idle timeout counts
            # from the end of what it was sent.
            self._playing_until = max(self._playing_until, now) + out.duration_s
            self._emit(
                ev.AudioDeltaEvent,
                response_id=r.response_id,
                item_id=r.item_id,
                output_index=r.message_index,
                pcm=out.pcm,
                sample_rate=out.sample_rate,
                metrics=self._timing.snapshot() if first else None,
            )
            if out.transcript and not r.spoken:
                r.transcript.append(out.transcript)
                self._emit(
                    ev.TranscriptDeltaEvent,
                    response_id=r.response_id,
                    item_id=r.item_id,
                    output_index=r.message_index,
                    delta=out.transcript,
                )

    def _deliver_function_call(self, out: FunctionCall, r: ResponseAssembly) -> None:
        call = r.add_call(self._new_item_id(), out.call_id, out.name, out.arguments)
        r.output_tokens += out.token_count  # the model's tokens that wrote the call
        self._call_registry().remember(out.call_id, out.name)
        ids = {"response_id": r.response_id, "call": call}
        self._emit(fev.FunctionCallItemAdded, **ids)
        # A call is a conversation item of its own (GA): retrievable, what an output answers,
        # and announced like every item a response adds (conversation.item.added now, .done
        # with its arguments), so a client mirroring the conversation (livekit) knows it. Not
        # an out-of-band response's: its output stays the client's.
        if r.in_conversation:
            previous = self._conversation.add(call.to_item())
            self._emit(ev.ItemAdded, item=call.to_item("in_progress"), previous_item_id=previous)
        if out.arguments:
            self._emit(fev.FunctionArgumentsDelta, delta=out.arguments, **ids)
        self._emit(fev.FunctionArgumentsDone, **ids)
        self._emit(fev.FunctionCallItemDone, **ids)
        if r.in_conversation:
            self._emit(ev.ItemDone, item=call.to_item(), previous_item_id=previous)

    def _call_registry(self) -> FunctionCallRegistry:
        calls = self._calls
        if calls is None:
            calls = self._calls = FunctionCallRegistry(self.config.max_conversation_chars)
        return calls

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

    def _fx_record_function_output(self, step: Step) -> None:
        cmd = cast(AddFunctionOutput, step.command)
        item = Item(id=cmd.item_id or "", type="function_call_output", call_id=cmd.call_id, output=cmd.output)
        self._add_item(item, None)

    def _close_parts(self, status: str, reason: str | None, stop_latency_s: float | None = None) -> None:
        r = self._response
        if r is None:
            return
        if r.message_index is None:
            if r.calls:  # a call-only response: its function_call items are its whole output
                self._emit_response_done(r, status, reason, stop_latency_s, r.output_items(None))
                return
            self._open_message(r)  # a response with nothing in it still answers with a message
        ids = {
            "response_id": r.response_id,
            "item_id": r.item_id,
            "epoch": r.epoch,
            "output_index": r.message_index,
        }
        if not r.spoken:
            self._emit(ev.TextDone, text="".join(r.text), **ids)
        if r.spoken or r.audio:
            self._emit(ev.AudioDone, **ids)
            self._emit(ev.TranscriptDone, transcript="".join(r.transcript), **ids)
        item_status = "completed" if status == "completed" else "incomplete"
        item = r.item(item_status)
        self._emit(
            ev.ContentPartDone,
            part_type=r.part_type,
            text=item.content[0].transcript or item.content[0].text or "",
            **ids,
        )
        self._emit(ev.OutputItemDone, status=item_status, item=item, **ids)
        self._conversation.replace(item)
        if r.item_id in self._conversation:
            self._emit(
                ev.ItemDone,
                item=item,
                previous_item_id=self._conversation.previous_of(r.item_id),
                epoch=r.epoch,
            )
        self._emit_response_done(r, status, reason, stop_latency_s, r.output_items(item))

    def _emit_response_done(
        self,
        r: ResponseAssembly,
        status: str,
        reason: str | None,
        stop_latency_s: float | None,
        output: tuple[Item, ...],
    ) -> None:
        self._emit(
            ev.ResponseDone,
            status=status,
            reason=reason,
            turn_id=r.turn_id,
            metrics=self._timing.snapshot(stop_latency_s=stop_latency_s),
            modalities=r.modalities,
            metadata=r.metadata,
            output=output,
            output_tokens=r.output_tokens,
            input_usage=r.input_usage,
            max_output_tokens=r.max_output_tokens,
            out_of_band=not r.in_conversation,
            response_id=r.response_id,
            item_id=r.item_id,
            epoch=r.epoch,
        )
        self._response = None

    def _ensure_begun(self, step: Step) -> None:
        # A RESPONSE turn that ends before any output still answers its request: the client
        # gets one created/done pair rather than silence.
        if self._response is None:
            self._fx_begin_response(step)

    def _fx_emit_response_completed(self, step: Step) -> None:
        # The engine's end, or, after a backchannel, the end that waited while audio was held.
        out = self._held_end if step.output is None else step.output
        self._held_end = None
        self._ensure_begun(step)
        if isinstance(out, TurnDone) and out.metrics is not None:
            if self._windows is None:
                self._windows = CumulativeWindow()
            self._timing.on_engine_metrics(self._windows.window(out.request_id, out.metrics))
        if isinstance(out, TurnDone) and self._response is not None:
            self._response.input_usage = out.input
        status = "completed" if getattr(out, "reason", "completed") != "length" else "incomplete"
        self._close_parts(status, None if status == "completed" else "max_output_tokens")

    def _fx_emit_response_failed(self, step: Step) -> None:
        out = step.output
        self._ensure_begun(step)
        self.counters.failed += 1
        message = getattr(out, "message", "the engine ended the request")
        self._close_parts("failed", "engine_error")
        self._emit(
            ev.ErrorEvent,
            code="engine_error",
            message=message,
            error_type="server_error",
            error_class="EngineFailed",
        )

    def _fx_emit_engine_error(self, step: Step) -> None:
        out = step.output
        self._emit(
            ev.ErrorEvent,
            code="engine_error",
            error_type="server_error",
            error_class="EngineFailed",
            message=getattr(out, "message", "engine request ended"),
        )

    def _fx_finish_turn(self, step: Step) -> None:
        if self._windows is not None and self._turn_request is not None:
            self._windows.forget(self._turn_request)
        self._timing.prune(self.turn_id)
        self._turn_request = None
        # However the turn ended (a failure may follow an end that waited on held audio), no end
        # waits any more: a stale one would take the next turn's barge-in for ended (no abort).
        self._held_end = None
        self.turn_id += 1
        self.lease.in_flight = max(self.lease.in_flight - 1, 0)
        self._overlap_ms = None

    @property
    def aborted_request_ids(self) -> tuple[str, ...]:
        """The last requests this session aborted: the engine may still hold resources for
        them after the session closed (the runtime keeps the admission slot until it does not)."""
        return tuple(self._aborted_ids or ())

    def _fx_advance_epoch(self, step: Step) -> None:
        self.epoch += 1

    def _abort(self, requests: dict[str, TurnKind], reason: str) -> None:
        """Abort these requests (id -> kind). The kind is kept until each one ends, because
        what counts as its end depends on it (engine_io.is_terminal)."""
        if not requests:
            return
        request_ids = tuple(sorted(requests))
        # Remembered (bounded) so the runtime can keep this session's admission slot until the
        # engine has really let go of what we aborted.
        if self._aborted_ids is None:
            self._aborted_ids = []
        self._aborted_ids.extend(request_ids)
        del self._aborted_ids[:-16]
        if self._aborting is None:
            self._aborting = {}
        self._aborting.update(requests)
        self._actions.append(AbortRequests(request_ids, reason))

    def _fx_abort_units(self, step: Step) -> None:
        # Unregistered first, so their later output classifies as stale; each one's end still
        # settles its abort (engine_io.is_terminal), which is what releases the engine's slot.
        units = self._units
        if not units:
            return
        self._units = None
        self.lease.in_flight = max(self.lease.in_flight - len(units), 0)
        self._abort(dict.fromkeys(units, TurnKind.UNIT), "superseded")

    def _fx_abort_engine_requests(self, step: Step) -> None:
        requests = dict.fromkeys(self._units or (), TurnKind.UNIT)
        if self._held_end is not None:
            # The engine already ended this turn (its end waited on a held response): there is
            # nothing to abort, and no abort would ever be confirmed.
            if self._windows is not None and self._turn_request is not None:
                self._windows.forget(self._turn_request)
        elif self._turn_request:
            requests[self._turn_request] = self._turn_kind
        self._turn_request = None
        self._units = None
        self.lease.in_flight = 0
        self._abort(requests, self._reason(step))

    def _fx_settle_abort(self, step: Step) -> None:
        if self._aborting is not None:
            self._aborting.pop(cast(EngineOutput, step.output).request_id, None)

    def _fx_drop_undelivered_audio(self, step: Step) -> None:
        self._playing_until = 0.0  # a cancelled response stops playing (clients cut it short)
        if self._response is not None:
            self.counters.dropped_audio_events += self._outbox.purge_audio(self._response.response_id)
        # Held audio, of a response begun or not, is never heard: the hold ends with it.
        if self._outbox.holding is not None:
            self.counters.dropped_audio_events += self._outbox.purge_audio(self._outbox.holding)
        self._hold_from = None
        self._held_end = None

    def _reason(self, step: Step) -> str:
        cmd = step.command
        return getattr(cmd, "reason", None) or step.reason or "cancelled"

    def _fx_emit_response_cancelled(self, step: Step) -> None:
        if self._response is None:
            return
        self.counters.cancelled += 1
        received = step.received_at
        stop = None if received is None else max(self.clock.now() - received, 0.0)
        reason = self._reason(step)
        if self._state == CLOSED and reason not in ("turn_detected", "client_cancelled"):
            reason = "session_closed"
        self._close_parts("cancelled", reason, stop)

    def _fx_reset_timing(self, step: Step) -> None:
        self._timing.reset()
        self._overlap_ms = None

    def _fx_count_stale_output(self, step: Step) -> None:
        self.counters.stale_outputs += 1

    def _fx_mark_draining(self, step: Step) -> None:
        self.draining = True

    def _fx_touch_lease(self, step: Step) -> None:
        self._emit(ev.HeartbeatAck)

    def _fx_record_playback(self, step: Step) -> None:
        cmd = cast(PlaybackAck, step.command)
        self._playback_ledger().acknowledge(cmd.response_id, cmd.played_ms)

    def _playback_ledger(self) -> PlaybackLedger:
        ledger = self._playback
        if ledger is None:
            ledger = self._playback = PlaybackLedger()
        return ledger

    def _fx_detach_lease(self, step: Step) -> None:
        self.lease.detach(step.now)
        # A detached session prompts nobody: responses made for an absent user would cost the
        # engine and fill the journal for the whole disconnect grace.
        self._idle_deadline = None

    def _fx_resume_lease(self, step: Step) -> None:
        # The chart accepted it (credentials or a replay of them, and a journal that holds
        # what the client missed): the lease performs the compare-and-swap.
        cmd = cast(Resume, step.command)
        now = step.now
        replay = self._journal.since(cmd.last_seq, now)
        generation, token = self.lease.resume(
            now, cmd.generation, cmd.resume_token, cmd.control_id, cmd.last_seq
        )
        # Replaces a replay not yet taken: the journal still holds all of it after last_seq
        # (else the chart refused the resume), and what came before, the client says it has.
        # Prepended, two resumes before any read sent those events twice.
        self._replay = replay
        self._emit(ev.SessionResumed, generation=generation, resume_token=token, replayed=len(replay))
        if self._idle_deadline is None and self.counters.responses:
            self._fx_start_idle_timer(step)  # back after a response: the quiet counts from now

    # --- conversation items ---------------------------------------------------------------

    def _fx_add_item(self, step: Step) -> None:
        cmd = cast(CreateItem, step.command)
        self._add_item(cmd.item, cmd.previous_item_id, cmd.audio)

    def _add_item(self, item: Item, previous_item_id: str | None, audio: bytes = b"") -> None:
        if not item.id:
            item = attrs.evolve(item, id=self._new_item_id())
        if audio:
            # A user's recorded turn: its audio part says how long it is (audio is not kept in
            # the conversation, as a committed turn's is not).
            ms = int(len(audio) / 2 / self.config.sample_rate * 1000)
            parts = tuple(
                attrs.evolve(p, audio_ms=ms) if p.type == "input_audio" else p for p in item.content
            )
            item = attrs.evolve(item, content=parts)
        if item.type == "function_call" and not item.call_id:
            item = attrs.evolve(item, call_id=f"call_{item.id}")
        previous = self._conversation.add(item, previous_item_id)  # checks before changing
        if item.type == "function_call_output":
            # It answers one of this session's calls (``answers_known_call`` refused any other): the next
            # model turn receives it.
            self._call_registry().answer(item.call_id or "", item.output or "", item.id)
        elif item.type == "function_call":
            # A call the client replays (its own history): its output may answer it, as
            # OpenAI accepts an output for any call in the conversation.
            self._call_registry().remember(item.call_id or "", item.name or "")
        elif item.role != "assistant" and (words := _words_of(item)):
            # Words the next response answers (user text, system/developer notes, the
            # transcript a client gave with its audio).
            self._pend_text(item.id, words)
        if audio:
            self._hear_item_audio(item.id, audio)
        if item.role == "assistant" or item.type == "function_call":
            # The model's own words or call, written by the client (history it replays, e.g.
            # livekit after every reconnect): what comes before them was already answered.
            # Otherwise the next response read the whole replayed history as new input, and
            # got function outputs that had been answered long ago.
            self._forget_pending(self._conversation.ids_before(item.id))
        self._emit(ev.ItemAdded, item=item, previous_item_id=previous)
        self._emit(ev.ItemDone, item=item, previous_item_id=previous)

    def _hear_item_audio(self, item_id: str, audio: bytes) -> None:
        """A created item's audio joins the committed audio the next response hears (within
        max_committed_bytes, the newest kept), and is transcribed as a commit is."""
        committed = self._committed
        committed += audio
        if len(committed) > self.config.max_committed_bytes:
            committed.keep_last(self.config.max_committed_bytes - self.config.max_committed_bytes % 2)
        if self.config.transcription is not None:
            self._actions.append(
                TranscribeInput(item_id, audio, self.config.sample_rate, self.config.transcription_language)
            )

    def _pend_text(self, item_id: str, text: str) -> None:
        """Keep ``text`` for the next response, within the conversation's bounds: a client that
        creates items and never asks for a response held every one of their texts here, without
        limit (100 items of 65,536 four-byte characters: +25 MiB, growing)."""
        pending = self._pending_text
        pending[item_id] = text
        self._pending_chars += len(text)
        budget = self.config.max_conversation_chars
        while len(pending) > 1 and (
            len(pending) > self.config.max_items or (budget is not None and self._pending_chars > budget)
        ):
            self._pending_chars -= len(pending.pop(next(iter(pending))))

    def _forget_pending(self, item_ids: Iterable[str]) -> None:
        """The next response no longer reads these items (deleted, or already answered)."""
        pending = self._pending_text
        ids = set(item_ids)
        for item_id in ids & pending.keys():
            self._pending_chars -= len(pending.pop(item_id))
        if self._calls is not None:
            self._calls.withdraw(ids)

    def _held_item(self, item_id: str, operation: str) -> Item:
        """The conversation's item ``item_id``, or the refusal OpenAI gives ``operation``."""
        if item_id not in self._conversation:
            raise ItemNotFound.during(operation, item_id)
        return self._conversation.get(item_id)

    def _fx_remove_item(self, step: Step) -> None:
        item_id = cast(DeleteItem, step.command).item_id
        self._held_item(item_id, "delete")
        item = self._conversation.delete(item_id)
        # A deleted item is not read either: its words, or its function output, stay unsaid.
        self._forget_pending((item.id,))
        self._emit(ev.ItemDeleted, item_id=item.id)

    def _fx_send_item(self, step: Step) -> None:
        self._emit(
            ev.ItemRetrieved,
            item=self._held_item(cast(RetrieveItem, step.command).item_id, "retrieve"),
        )

    def _fx_cut_item_audio(self, step: Step) -> None:
        cmd = cast(TruncateItem, step.command)
        item = self._held_item(cmd.item_id, "truncate")
        r = self._response
        live = r is not None and item.id == r.item_id
        if r is not None and live:
            # The response still streams (a client truncates as soon as the user speaks, before
            # response.done): its stored item is the in_progress snapshot, so range-check against
            # the audio produced so far.
            item = r.streaming_item()
        if item.role != "assistant":
            raise InvalidItem("item_id", "only assistant messages can be truncated")
        if cmd.content_index >= len(item.content):
            raise InvalidItem("content_index", f"the item has {len(item.content)} content part(s)")
        part = item.content[cmd.content_index]
        if part.type != "output_audio":
            raise InvalidItem("content_index", "only audio content can be truncated")
        if cmd.audio_end_ms > part.audio_ms:
            raise InvalidItem("audio_end_ms", f"is past the end of the item's audio ({part.audio_ms} ms)")
        parts = list(item.content)
        parts[cmd.content_index] = attrs.evolve(part, audio_ms=cmd.audio_end_ms)
        self._conversation.replace(attrs.evolve(item, content=tuple(parts)))
        if r is not None and live:
            r.heard_ms = cmd.audio_end_ms  # kept when the response ends (_close_parts)
        self._playback_ledger().truncated(item.id, cmd.audio_end_ms)
        self._emit(
            ev.ItemTruncated, item_id=item.id, content_index=cmd.content_index, audio_end_ms=cmd.audio_end_ms
        )

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
        self._pre_speech_bytes = self._speech_window(config)
        if cmd.server_vad is not None:
            # New turn detection settings start a new detector (the server builds one per
            # update): any speech the old one had open is not going to close.
            self._speaking = False
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
        self._input = InputBuffer()
        self._committed = InputBuffer()
        self._pending_text = {}
        self._pending_chars = 0
        self._conversation.clear()
        if self._windows is not None:
            self._windows.clear()
        self._emit(ev.SessionClosedEvent, reason=reason)


def _words_of(item: Item) -> str:
    """What an engine reads of an item: its text, else the transcripts its audio came with."""
    return item.text or " ".join(
        p.transcript for p in item.content if p.type == "input_audio" and p.transcript
    )
