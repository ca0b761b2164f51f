"""SessionParts: the state one session's guards and effects share, declared once.

:class:`~.session.SessionCore` is composed of parts, one concept each: the input
(:mod:`.input_effects`), the model requests (:mod:`.turn_effects`), the response
(:mod:`.response_effects`), the conversation's items (:mod:`.item_effects`) and the lease
(:mod:`.lease_effects`), with the driver and the public surface in :mod:`.session`. Each part
is a mixin over this class: it declares (for the type checker) the state the core holds in its
slots, and the few helpers every part uses. The parts add no slots and no per-session objects:
a session is one object, as before the split, and the chart's names resolve to plain
functions of it once (``SessionCore._g_<name>``, ``SessionCore._fx_<name>``).

Guards are pure predicates over the core and the trigger's :class:`~.step.Step`: the chart may
ask any of them and, when nothing holds, ask again to name the refusal (statechart.CHECKS).
Each one is defined for every step (a tool may record all of them at every step): asked about
a trigger it does not belong to, it answers from what it has (False for the resume checks).
Effects change the core, in the order the chart's row lists them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .fence import Fence
from .function_calls import FunctionCallRegistry

if TYPE_CHECKING:
    from . import events as ev
    from .actions import EngineAction
    from .audio_budget import AudioAccount
    from .clock import Clock
    from .conversation import Conversation, Item
    from .engine_io import EngineOutput, FunctionTool, SamplingOverrides, TurnKind
    from .input_buffer import InputBuffer
    from .journal import ReplayJournal
    from .lease import Lease
    from .outbox import Outbox
    from .playback import PlaybackLedger
    from .response import ResponseAssembly
    from .session_config import SessionConfig, SessionCounters
    from .statechart import CompiledChart
    from .step import Step
    from .text_budget import TextAccount
    from .timing import CumulativeWindow, TimingLedger
    from .unit_holds import SharedWords, UnitHold


class SessionParts:
    """What the parts of a :class:`~.session.SessionCore` share: its state (held in the
    core's slots; see ``SessionCore.__init__`` for what each field means) and the helpers
    every part uses."""

    if not TYPE_CHECKING:
        # No slots of its own, nor its parts: the fields are SessionCore's slots. Hidden from
        # the type checker, which would otherwise refuse a part's assignment to a field it
        # only declares.
        __slots__ = ()

    session_id: str
    tenant: str | None
    sends_history: bool
    config: SessionConfig
    clock: Clock
    chart: CompiledChart
    epoch: int
    turn_id: int
    counters: SessionCounters
    lease: Lease
    draining: bool
    _state: str
    _input: InputBuffer
    _input_ms: float
    _committed: InputBuffer
    _audio_account: AudioAccount | None
    _text_account: TextAccount | None
    _outbox: Outbox
    _actions: list[EngineAction]
    _seq: int
    _journal: ReplayJournal
    _replay: list[ev.ServerEvent]
    _timing: TimingLedger
    _windows: CumulativeWindow | None
    _turn_request: str | None
    _turn_kind: TurnKind
    _units: dict[str, UnitHold] | None
    _promoted_unit: UnitHold | None
    _offered_words: SharedWords | None
    _unit_seq: int
    _aborting: dict[str, TurnKind] | None
    _response: ResponseAssembly | None
    _overlap_ms: float | None
    _hold_from: float | None
    _held_end: EngineOutput | None
    _close_reason: str | None
    _aborted_ids: list[str] | None
    _log: Any
    _playback: PlaybackLedger | None
    _calls: FunctionCallRegistry | None
    _conversation: Conversation
    _item_seq: int
    _next_input_item: str | None
    _pending_text: dict[str, tuple[str, ...]]
    _pending_chars: int
    _pre_speech_bytes: int | None
    _speaking: bool
    _playing_until: float
    _idle_deadline: float | None
    _idle_from_ms: float

    if TYPE_CHECKING:
        # What one part asks of another (the core has them all).
        def _fx_begin_response(self, step: Step) -> None: ...
        def _fx_start_idle_timer(self, step: Step) -> None: ...
        def _next_response_id(self) -> str: ...
        def _response_modalities(self, step: Step) -> tuple[str, ...]: ...
        def _response_options(
            self, step: Step
        ) -> tuple[tuple[FunctionTool, ...], str, SamplingOverrides]: ...
        def _context_words(self, context: tuple[Item | str, ...]) -> str: ...
        def _withdraw_offered_words(self) -> None: ...
        def _drop_carrier(self, words: SharedWords) -> None: ...

    @property
    def fence(self) -> Fence:
        """The session's current fence: its id, epoch and turn (what new requests carry)."""
        return Fence(self.session_id, self.epoch, self.turn_id)

    @property
    def response_id(self) -> str | None:
        """The id of the response the client is being sent, if one has begun."""
        return None if self._response is None else self._response.response_id

    def _emit(self, cls: type[ev.ServerEvent], epoch: int | None = None, **fields: Any) -> None:
        """Queue an event of ``cls`` for the client, under ``epoch`` (None: the session's now;
        a response's closing events carry the epoch it was created under)."""
        event = cls(seq=0, epoch=self.epoch if epoch is None else epoch, session_id=self.session_id, **fields)
        # A push that does not fit marks the outbox overflowed; the chart's outbox_overflow row
        # closes the session once the current step is done (_close_slow_consumer).
        self._outbox.push(event)

    def _new_item_id(self) -> str:
        self._item_seq += 1
        return f"item_{self.session_id[-8:]}_{self._item_seq}"

    def _input_item_id(self) -> str:
        """The id the buffered user audio will have once committed (speech events name it)."""
        if self._next_input_item is None:
            self._next_input_item = self._new_item_id()
        return self._next_input_item

    def _call_registry(self) -> FunctionCallRegistry:
        calls = self._calls
        if calls is None:
            calls = self._calls = FunctionCallRegistry(self.config.max_conversation_chars)
        return calls

    def _reason(self, step: Step) -> str:
        """Why the step cancels or closes: the command's reason, else the trigger's."""
        cmd = step.command
        return getattr(cmd, "reason", None) or step.reason or "cancelled"
