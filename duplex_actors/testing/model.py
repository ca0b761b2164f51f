"""A pure, independent model of one session, and a checker for the event stream a client sees.

:class:`SessionModel` predicts, for every command and engine output, what a session must do:
the typed error of an illegal command, the new state, epoch and turn, the engine actions
(submit, abort), the response terminals and whether the timing ledger must be empty. It is
written from the domain rules, not from the statechart table, so a state machine test that
compares the two can fail when the chart (or the code behind it) is wrong. It covers the
cascaded mode (``model_native=False``), with or without ``respond_on_commit`` (OpenAI's GA
contract: a commit only adds audio to the conversation; committing during a response is
allowed), response.created at acceptance, cancels that name a response, the overlap
policy (speech over a response longer than ``min_interruption_ms`` is a barge-in), and the
lease: detach, resume (the API key that opened the session, the current generation and
token or a replay of the last resume's, the journal still holding what the client missed) and
expiry (disconnect grace, idle TTL with no turn in flight; an expiry the lease no longer
supports changes nothing).

:class:`EventStreamChecker` watches the events a client receives, in order, and raises
``AssertionError`` on the first one that breaks a stream invariant (one active response;
created -> deltas -> exactly one done; non-decreasing epochs; nothing of a cancelled epoch after
its terminal; TTFT/TTFP at most once and never negative; nothing after session.closed). It
needs no model, so it also checks streams recorded from real deployments.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import attrs

from ..core import commands as cmd
from ..core import events as ev
from ..core.commands import Command
from ..core.engine_io import (
    Aborted,
    AudioPacket,
    Decision,
    EngineFailure,
    EngineOutput,
    FunctionCall,
    TextDelta,
    TurnDone,
)
from ..core.lease import REPLAY_WINDOW_S
from ..core.session_config import SessionConfig
from ..core.timing import SERVER, ResponseMetrics
from ..errors import (
    Backpressure,
    DuplexError,
    FenceAhead,
    InputBufferEmpty,
    InvalidCommand,
    InvalidItem,
    ItemNotFound,
    NoActiveResponse,
    ResponseInProgress,
    ResponseNotFound,
    ResumeConflict,
    ResyncRequired,
    SessionClosed,
    StaleFence,
    UnknownSession,
)

if TYPE_CHECKING:
    from ..core.session import SessionCore

IDLE, LISTENING, RESPONDING, BARGE_IN, CLOSED = "idle", "listening", "responding", "barge_in", "closed"


@attrs.define
class Expectation:
    """What one input must do to the session, as the model predicts it."""

    trigger: str
    error: type[DuplexError] | None = None
    #: (request id, bytes of audio) for every SubmitTurn the input causes.
    submits: list[tuple[str, int]] = attrs.Factory(list)
    #: request ids of every AbortRequests the input causes.
    aborts: list[tuple[str, ...]] = attrs.Factory(list)
    epoch_moved: bool = False
    #: response.created / response.done (status, reason) / session.closed, in order.
    terminals: list[tuple[str | None, ...]] = attrs.Factory(list)
    #: the output was consumed as stale (or refused as invalid) and changed nothing visible.
    stale: bool = False
    invalid: bool = False
    #: the ledger must be empty after this input (end of response, barge-in, close).
    timing_reset: bool = False
    #: an accepted resume: whether it was the replay of the last one (same answer, no rotation)
    #: and the journaled seqs it must re-send.
    resumed: bool = False
    replayed_resume: bool = False
    replay_seqs: list[int] = attrs.Factory(list)


@attrs.define
class ModelResponse:
    response_id: str
    epoch: int
    turn_id: int
    start: float | None
    first_text: float | None = None
    first_audio: float | None = None

    @property
    def ttft_ms(self) -> float | None:
        if self.first_text is None or self.start is None:
            return None
        return (self.first_text - self.start) * 1000.0

    @property
    def ttfp_ms(self) -> float | None:
        if self.first_audio is None or self.start is None:
            return None
        return (self.first_audio - self.start) * 1000.0


class SessionModel:
    """The expected behaviour of one session, fed the same inputs as the real one."""

    def __init__(
        self,
        session_id: str,
        config: SessionConfig | None = None,
        *,
        opened_at: float | None = None,
        owner: bytes | None = None,
        token: str | None = None,
    ) -> None:
        """``opened_at`` (the clock when the session opened) lets the model decide expiries
        itself; ``owner`` is the API key digest the session is bound to; ``token`` the resume
        token of session.created (random, so the model is told it, as the client is)."""
        self.config = config or SessionConfig()
        if self.config.model_native:
            raise NotImplementedError("SessionModel covers the cascaded mode (model_native=False)")
        self.session_id = session_id
        self.state = IDLE
        self.epoch = 0
        self.turn_id = 0
        self.buffered = 0  # bytes of uncommitted user audio
        self.committed = 0  # bytes committed, not yet sent with a model turn
        self.turn_request: str | None = None
        self.request_start: float | None = None
        self.response: ModelResponse | None = None
        self.aborting: set[str] = set()
        self.overlap_ms: float | None = None
        # Barge-in without talk-over: the response's audio is held from speech_started until
        # the overlap is judged; an engine end that comes meanwhile waits (status, reason).
        self.held = False
        self.held_end: tuple[str, str | None] | None = None
        self.stale_outputs = 0
        self.invalid_outputs = 0
        self.issued: list[str] = []  # every request id ever submitted, in order
        self.terminals: list[tuple[str | None, ...]] = []  # every terminal ever expected, in order
        self.close_issued_at: int | None = None  # len(issued) when the session closed
        #: The conversation's item ids in order (items the session names itself are placeholders:
        #: only their count matters, for the oldest-first eviction at ``config.max_items``). The
        #: character budget (``config.max_conversation_chars``) is not modelled: the strategies'
        #: texts are a few words, 256 items of them far below it (tests/core/test_conversation_budget.py
        #: checks that bound on its own).
        self.items: list[str] = []
        self._auto_items = 0
        #: TTFT / TTFP (ms) each response must report, when the inputs carried times.
        self.ttft: dict[str, float] = {}
        self.ttfp: dict[str, float] = {}
        # The lease, from the domain rules (docs/architecture.md, core/lease.py's docstring).
        self.owner = owner
        self.generation = 0
        self.token = token  # None after a rotation until the client learns the new one
        #: (control_id, generation, token, last_seq, accepted at) the last accepted resume with
        #: a control_id presented, while its exact retry is still answered (core/lease.py: not
        #: after a later resume, a client command, or REPLAY_WINDOW_S)
        self.last_resume: tuple[str, int, str | None, int, float | None] | None = None
        self.detached_at: float | None = None
        self.last_activity = opened_at
        #: The replay journal: (taken at, seq, size) of every event handed to the client and
        #: still held, and the highest seq no longer held.
        self.journal: list[tuple[float, int, int]] = []
        self.evicted_through = 0

    # -- commands ---------------------------------------------------------------------------

    def command(self, command: Command, now: float | None = None) -> Expectation:
        trigger = command.TRIGGER
        exp = Expectation(trigger)
        if self.state == CLOSED:
            if trigger != "close":
                exp.error = SessionClosed
            return exp
        if command.epoch is not None and trigger != "close":
            if command.epoch < self.epoch:
                exp.error = StaleFence
                return exp
            if command.epoch > self.epoch:
                exp.error = FenceAhead
                return exp
        handler = getattr(self, "_c_" + trigger, None)
        if handler is None:
            raise NotImplementedError(f"SessionModel does not model {trigger!r}")
        handler(command, exp, now)
        self.terminals.extend(exp.terminals)
        if exp.error is None and self.state != CLOSED:
            self._touch(now)  # every accepted command is activity
            if trigger not in ("resume", "detach"):
                self.last_resume = None  # the client acts: it has its resume's answer
        return exp

    # -- the lease and the journal ----------------------------------------------------------

    def _touch(self, now: float | None) -> None:
        if now is not None and self.last_activity is not None and now > self.last_activity:
            self.last_activity = now

    def lease_expiry(self, now: float) -> str | None:
        """Why the lease has run out at ``now`` (None while it holds)."""
        if self.last_activity is None:
            raise NotImplementedError("the model was built without opened_at: it cannot time the lease")
        if self.detached_at is not None and now - self.detached_at >= self.config.disconnect_grace_s:
            return "disconnect_grace_expired"
        if self.turn_request is None and now - self.last_activity >= self.config.idle_ttl_s:
            return "idle_ttl_expired"
        return None

    def expire(self, now: float) -> Expectation:
        """The reaper's expiry is processed at ``now``: it closes only a lease that ran out."""
        return self.lease_ran_out(None if self.state == CLOSED else self.lease_expiry(now))

    def lease_ran_out(self, reason: str | None) -> Expectation:
        """An expiry processed when the lease said ``reason`` (None: it holds, nothing happens)."""
        exp = Expectation("expire")
        if reason is not None and self.state != CLOSED:
            self._close(exp, reason)
            self.terminals.extend(exp.terminals)
        return exp

    def journaled(self, events: Iterable[ev.ServerEvent], now: float) -> None:
        """The client was handed ``events`` at ``now``: each is journaled, the oldest forgotten
        past ``journal_max_events`` / ``journal_max_bytes`` (128 bytes plus its audio each)."""
        for e in events:
            pcm = getattr(e, "pcm", None)
            self.journal.append((now, e.seq, 128 + (len(pcm) if pcm is not None else 0)))
            self._age_journal(now)

    def _age_journal(self, now: float) -> None:
        c = self.config
        while self.journal and (
            len(self.journal) > c.journal_max_events
            or sum(size for _, _, size in self.journal) > c.journal_max_bytes
            or now - self.journal[0][0] > c.journal_max_age_s
        ):
            self.evicted_through = self.journal.pop(0)[1]

    def learn_token(self, token: str) -> None:
        """The client read its new resume token from session.resumed."""
        self.token = token

    def _c_detach(self, c: cmd.Detach, exp: Expectation, now: float | None) -> None:
        if self.detached_at is None:
            self.detached_at = now

    def _c_resume(self, c: cmd.Resume, exp: Expectation, now: float | None) -> None:
        # Authentication first (the key, then the credentials), then the journal.
        if self.owner is not None and c.key_digest != self.owner:
            exp.error = UnknownSession  # as an id nobody opened: no oracle for other keys
            return
        last = self.last_resume
        replay = (
            last is not None
            and c.control_id == last[0]
            and (c.generation, c.resume_token) == last[1:3]
            and c.last_seq >= last[3]  # no more of the journal than the original asked for
            and (now is None or last[4] is None or now - last[4] <= REPLAY_WINDOW_S)
        )
        if not replay and (c.generation != self.generation or c.resume_token != self.token):
            exp.error = ResumeConflict
            return
        self._age_journal(cast(float, now))  # resumes are modelled with a clock (see journaled)
        if c.last_seq < self.evicted_through:
            exp.error = ResyncRequired
            return
        exp.resumed, exp.replayed_resume = True, replay
        exp.replay_seqs = [seq for _, seq, _ in self.journal if seq > c.last_seq]
        if not replay:
            self.last_resume = (
                None
                if c.control_id is None
                else (c.control_id, c.generation, c.resume_token, c.last_seq, now)
            )
            self.generation += 1
            self.token = None  # rotated: the client learns it from session.resumed
        self.detached_at = None

    def _c_append(self, c: cmd.AppendAudio, exp: Expectation, now: float | None) -> None:
        if c.sample_rate != self.config.sample_rate:
            exp.error = InvalidCommand
            return
        if self.buffered + len(c.pcm) > self.config.max_input_bytes:
            exp.error = Backpressure
            return
        if self.state == IDLE:
            self.state = LISTENING
        self.buffered += len(c.pcm)
        # The overlap policy: speech over a response longer than the minimum barges in.
        ms = len(c.pcm) / 2 / self.config.sample_rate * 1000.0
        if self.overlap_ms is not None and self.state == RESPONDING:
            self.overlap_ms += ms
            if self.overlap_ms >= self.config.min_interruption_ms:
                self._cancel(exp, "turn_detected")

    def _c_commit(self, c: cmd.CommitInput, exp: Expectation, now: float | None) -> None:
        if self.state == IDLE or self.buffered == 0:
            exp.error = InputBufferEmpty
            return
        # Committed audio waits for the next response, however many commits come first.
        # ...within max_committed_bytes, the newest kept.
        self.committed = min(self.committed + self.buffered, self.config.max_committed_bytes // 2 * 2)
        self.buffered = 0
        self._add_auto_item()  # the user's audio item
        if self.state == RESPONDING:
            return  # allowed during a response; it starts nothing
        if self.config.respond_on_commit:
            self._submit(exp, now)
        else:
            self.state = IDLE

    def _c_create_response(self, c: cmd.CreateResponse, exp: Expectation, now: float | None) -> None:
        if self.state == RESPONDING:
            exp.error = ResponseInProgress
            return
        self._submit(exp, now)

    def _c_clear(self, c: cmd.ClearInput, exp: Expectation, now: float | None) -> None:
        self.buffered = 0
        if self.state in (IDLE, LISTENING):
            self.state = IDLE

    def _c_barge_in(self, c: cmd.BargeIn, exp: Expectation, now: float | None) -> None:
        if self.state == RESPONDING:
            self._cancel(exp, c.reason)

    def _c_cancel(self, c: cmd.CancelResponse, exp: Expectation, now: float | None) -> None:
        if self.state != RESPONDING:
            exp.error = NoActiveResponse
            return
        if c.response_id is not None and (
            self.response is None or c.response_id != self.response.response_id
        ):
            exp.error = ResponseNotFound
            return
        self._cancel(exp, c.reason)

    def _c_heartbeat(self, c: cmd.Heartbeat, exp: Expectation, now: float | None) -> None:
        pass

    # Conversation items never move the state; unknown ids and duplicates are refused.
    def _c_create_item(self, c: cmd.CreateItem, exp: Expectation, now: float | None) -> None:
        if c.item.id in self.items or (
            c.previous_item_id not in (None, "root") and c.previous_item_id not in self.items
        ):
            exp.error = InvalidItem
            return
        self._add_item(c.item.id)

    def _c_delete_item(self, c: cmd.DeleteItem, exp: Expectation, now: float | None) -> None:
        if c.item_id not in self.items:
            exp.error = ItemNotFound
            return
        self.items.remove(c.item_id)

    def _c_retrieve_item(self, c: cmd.RetrieveItem, exp: Expectation, now: float | None) -> None:
        if c.item_id not in self.items:
            exp.error = ItemNotFound

    def _add_item(self, item_id: str) -> None:
        self.items.append(item_id)
        del self.items[: -self.config.max_items]

    def _add_auto_item(self) -> None:
        self._auto_items += 1
        self._add_item(f"<auto {self._auto_items}>")

    def _c_speech_started(self, c: cmd.SpeechStartedSignal, exp: Expectation, now: float | None) -> None:
        if self.state == IDLE:
            self.state = LISTENING
        elif self.state == RESPONDING:
            self.overlap_ms = 0.0
            config = self.config
            if config.interrupt_response and config.hold_audio_on_speech and "audio" in config.modalities:
                self.held = True

    def _c_speech_stopped(self, c: cmd.SpeechStoppedSignal, exp: Expectation, now: float | None) -> None:
        if self.state == RESPONDING:
            self.overlap_ms = None
            # A backchannel: the held audio goes on, and an end that waited for it comes now.
            self.held = False
            if self.held_end is not None:
                status, reason = self.held_end
                self._end(exp, now, status, reason)

    def _c_close(self, c: cmd.Close, exp: Expectation, now: float | None) -> None:
        self._close(exp, c.reason)

    def close(self, reason: str) -> Expectation:
        """The session closed for a reason of its own (a failure)."""
        exp = Expectation("close")
        if self.state != CLOSED:
            self._close(exp, reason)
            self.terminals.extend(exp.terminals)
        return exp

    # -- engine outputs ---------------------------------------------------------------------

    def output(self, output: EngineOutput, now: float | None = None) -> Expectation:
        rid = output.request_id
        exp = Expectation("output")
        if rid == self.turn_request:
            assert self.state == RESPONDING, "model: a live request outside responding"
            if isinstance(output, Decision):
                if output.speak:
                    self._begin(exp, now)
                else:  # "keep listening" for a committed turn: the engine broke the protocol
                    exp.invalid = True
                    self.invalid_outputs += 1
            elif isinstance(output, FunctionCall):
                self._begin(exp, now)
            elif isinstance(output, (TextDelta, AudioPacket)):
                self._begin(exp, now)
                r = self.response
                assert r is not None, "_begin opened the response"
                if isinstance(output, TextDelta):
                    if output.text and output.token_count > 0 and r.first_text is None:
                        r.first_text = now
                        if r.ttft_ms is not None:
                            self.ttft[r.response_id] = r.ttft_ms
                elif r.first_audio is None:
                    r.first_audio = now
                    if r.ttfp_ms is not None:
                        self.ttfp[r.response_id] = r.ttfp_ms
            elif isinstance(output, TurnDone) and self.held:
                # Its audio is held: the overlap policy says whether it completed.
                self.held_end = (
                    "incomplete" if output.reason == "length" else "completed",
                    None if output.reason != "length" else "max_output_tokens",
                )
            elif isinstance(output, TurnDone):
                self._end(
                    exp,
                    now,
                    "incomplete" if output.reason == "length" else "completed",
                    None if output.reason != "length" else "max_output_tokens",
                )
            elif isinstance(output, (EngineFailure, Aborted)):
                self._end(exp, now, "failed", "engine_error")
        else:
            exp.stale = True
            self.stale_outputs += 1
        if self.state != CLOSED:
            self._touch(now)  # model output is activity too (stale or not)
        # A request of a cancelled epoch ended: once all have, barge_in is left.
        if rid in self.aborting and _terminal_for(output):
            self.aborting.discard(rid)
            if not self.aborting and self.state == BARGE_IN:
                self.state = LISTENING if self.buffered else IDLE
        self.terminals.extend(exp.terminals)
        return exp

    # -- shared paths -----------------------------------------------------------------------

    def _submit(self, exp: Expectation, now: float | None) -> None:
        rid = f"{self.session_id}/e{self.epoch}/t{self.turn_id}"
        exp.submits.append((rid, self.committed))
        self.issued.append(rid)
        self.committed = 0
        self.turn_request = rid
        self.request_start = now
        self.overlap_ms = None
        self.state = RESPONDING
        self._begin(exp, now)  # response.created goes out when the turn is accepted

    def _begin(self, exp: Expectation, now: float | None) -> None:
        if self.response is not None:
            return
        rid = f"resp_{self.session_id[-6:]}_{self.epoch}_{self.turn_id}"
        start = self.request_start if self.request_start is not None else now
        self.response = ModelResponse(rid, self.epoch, self.turn_id, start)
        exp.terminals.append(("response.created", rid))
        self._add_auto_item()  # the response's assistant item

    def _finish_response(self, exp: Expectation, status: str, reason: str | None) -> None:
        if self.response is not None:
            exp.terminals.append(("response.done", self.response.response_id, status, reason))
            self.response = None

    def _end(self, exp: Expectation, now: float | None, status: str, reason: str | None) -> None:
        self._begin(exp, now)  # a turn that ends before any output still answers with a pair
        self._finish_response(exp, status, reason)
        self.turn_request = None
        self.request_start = None
        self.turn_id += 1
        self.overlap_ms = None
        self.held, self.held_end = False, None
        self.state = LISTENING if self.buffered else IDLE
        exp.timing_reset = True

    def _abort_in_flight(self, exp: Expectation) -> None:
        # A turn whose end is held has ended at the engine: nothing to abort.
        if self.turn_request is not None and self.held_end is None:
            self.aborting.add(self.turn_request)
            exp.aborts.append((self.turn_request,))
        self.turn_request = None
        self.request_start = None

    def _cancel(self, exp: Expectation, reason: str) -> None:
        # With the turn's end held there is no abort to wait for: the user's speech goes on.
        self.state = BARGE_IN if self.held_end is None else LISTENING
        self.epoch += 1
        exp.epoch_moved = True
        self._abort_in_flight(exp)
        self.held, self.held_end = False, None
        self._finish_response(exp, "cancelled", reason)
        self.overlap_ms = None
        exp.timing_reset = True

    def _close(self, exp: Expectation, reason: str) -> None:
        self.state = CLOSED
        self._abort_in_flight(exp)
        done_reason = reason if reason in ("turn_detected", "client_cancelled") else "session_closed"
        self._finish_response(exp, "cancelled", done_reason)
        self.buffered = self.committed = 0
        self.items = []
        self.overlap_ms = None
        self.held, self.held_end = False, None
        self.close_issued_at = len(self.issued)
        exp.terminals.append(("session.closed", reason))
        exp.timing_reset = True

    # -- comparing with a real core ---------------------------------------------------------

    def mismatches(self, core: SessionCore) -> list[str]:
        """Every observable way ``core`` (a SessionCore) differs from the model; [] if none."""
        out = []

        def same(name: str, real: object, want: object) -> None:
            if real != want:
                out.append(f"{name}: session has {real!r}, model expects {want!r}")

        same("state", core.state, self.state)
        same("epoch", core.epoch, self.epoch)
        same("turn_id", core.turn_id, self.turn_id)
        same("buffered input bytes", core.buffered_input_bytes, self.buffered)
        same(
            "active response", core.response_id, None if self.response is None else self.response.response_id
        )
        same(
            "in-flight requests",
            set(core.in_flight_requests),
            {self.turn_request} if self.turn_request else set(),
        )
        same("requests being aborted", set(core.aborting_requests), self.aborting)
        same("stale outputs counted", core.counters.stale_outputs, self.stale_outputs)
        same("invalid outputs counted", core.counters.invalid_outputs, self.invalid_outputs)
        # The ledger holds something exactly while a model turn is in flight.
        same("timing ledger empty", core.timing.is_empty, self.state != RESPONDING)
        same("lease generation", core.lease.generation, self.generation)
        same("lease detached", core.lease.detached, self.detached_at is not None)
        if self.token is not None:
            same("resume token", core.lease.token, self.token)
        return out


def _terminal_for(output: EngineOutput) -> bool:
    # The model only issues RESPONSE requests, which only a real terminal ends (a listen
    # decision would end a model-native UNIT request, which this model never issues).
    return isinstance(output, (TurnDone, EngineFailure, Aborted))


# --- the event stream -----------------------------------------------------------------------

_RESPONSE_PARTS = (
    ev.OutputItemAdded,
    ev.ContentPartAdded,
    ev.TextDeltaEvent,
    ev.AudioDeltaEvent,
    ev.TranscriptDeltaEvent,
    ev.TextDone,
    ev.AudioDone,
    ev.TranscriptDone,
    ev.ContentPartDone,
    ev.OutputItemDone,
)


class EventStreamChecker:
    """Feed it every event a client receives, in order; it raises AssertionError on a break."""

    def __init__(self, *, check_seq: bool = True) -> None:
        self.check_seq = check_seq
        self.events: list[ev.ServerEvent] = []
        self.last_seq = 0
        self.last_epoch = 0
        self.closed = False
        self.open: ev.ResponseCreated | None = None
        self.created: set[str] = set()
        self.done: dict[str, ev.ResponseDone] = {}
        self.ttft: dict[str, float] = {}
        self.ttfp: dict[str, float] = {}
        self.cancelled_epoch: int | None = None  # epoch of the last cancelled response.done
        self.terminals: list[
            tuple[str | None, ...]
        ] = []  # created / done / closed, as SessionModel lists them

    def feed(self, events: Iterable[ev.ServerEvent]) -> None:
        for event in events:
            self.check(event)

    def check(self, e: ev.ServerEvent) -> None:
        where = f"event #{len(self.events) + 1} {e.type} (seq {e.seq}, epoch {e.epoch})"
        self.events.append(e)
        assert not self.closed, f"{where} arrived after session.closed"
        if self.check_seq:
            assert e.seq == self.last_seq + 1, f"{where}: server_event_seq jumped from {self.last_seq}"
            self.last_seq = e.seq
        assert e.epoch >= self.last_epoch, f"{where}: epoch went back from {self.last_epoch}"
        if self.cancelled_epoch is not None and not isinstance(e, ev.SessionClosedEvent):
            assert e.epoch > self.cancelled_epoch, (
                f"{where}: an event of epoch {e.epoch} after that epoch's response was cancelled"
            )
        self.last_epoch = e.epoch

        if isinstance(e, ev.ResponseCreated):
            assert self.open is None, (
                f"{where}: response {e.response_id} created while {self.open.response_id} is active"
            )
            assert e.response_id not in self.created, f"{where}: response id {e.response_id} reused"
            self.created.add(e.response_id)
            self.open = e
            self.cancelled_epoch = None
            self._metrics(where, e, e.metrics, fresh=True)
            self.terminals.append(("response.created", e.response_id))
        elif isinstance(e, _RESPONSE_PARTS):
            self._inside(where, e)
            metrics = getattr(e, "metrics", None)
            if isinstance(e, (ev.TextDeltaEvent, ev.TranscriptDeltaEvent)) and metrics is not None:
                assert e.response_id not in self.ttft, f"{where}: TTFT recorded twice"
                assert metrics.ttft_ms is not None, f"{where}: first-token metrics without TTFT"
                self.ttft[e.response_id] = metrics.ttft_ms
            if isinstance(e, ev.AudioDeltaEvent) and metrics is not None:
                assert e.response_id not in self.ttfp, f"{where}: TTFP recorded twice"
                assert metrics.ttfp_ms is not None, f"{where}: first-packet metrics without TTFP"
                self.ttfp[e.response_id] = metrics.ttfp_ms
            self._metrics(where, e, metrics)
        elif isinstance(e, ev.ResponseDone):
            self._inside(where, e)
            assert e.status in ev.RESPONSE_STATUSES, f"{where}: unknown status {e.status!r}"
            self._metrics(where, e, e.metrics)
            self.done[e.response_id] = e
            self.open = None
            if e.status == "cancelled":
                self.cancelled_epoch = e.epoch
            self.terminals.append(("response.done", e.response_id, e.status, e.reason))
        elif isinstance(e, ev.SessionClosedEvent):
            assert self.open is None, (
                f"{where}: session closed while response {self.open.response_id} never got response.done"
            )
            self.closed = True
            self.terminals.append(("session.closed", e.reason))

    def _inside(self, where: str, e: ev.ResponseEvent) -> None:
        assert e.response_id not in self.done, f"{where}: event for {e.response_id} after its response.done"
        assert self.open is not None and self.open.response_id == e.response_id, (
            f"{where}: event for {e.response_id}, which is not the active response"
        )
        assert e.epoch == self.open.epoch, (
            f"{where}: epoch {e.epoch} inside a response created at epoch {self.open.epoch}"
        )

    def _metrics(
        self, where: str, e: ev.ResponseEvent, m: ResponseMetrics | None, *, fresh: bool = False
    ) -> None:
        if m is None:
            return
        assert m.response_id == e.response_id, f"{where}: metrics of {m.response_id} leaked in"
        assert m.source == SERVER, f"{where}: metrics source is {m.source!r}, expected 'server'"
        for name in ("ttft_ms", "ttfp_ms", "tpot_ms", "stop_latency_ms"):
            value = getattr(m, name)
            assert value is None or value >= 0, f"{where}: {name} is negative ({value})"
        if fresh:  # nothing of an earlier response may leak into a new one
            assert m.ttft_ms is None and m.ttfp_ms is None and m.token_count == 0, (
                f"{where}: a new response starts with timing already recorded: {m}"
            )
            return
        rid = e.response_id
        if rid in self.ttft:
            assert m.ttft_ms == self.ttft[rid], f"{where}: TTFT changed from {self.ttft[rid]} to {m.ttft_ms}"
        if rid in self.ttfp:
            assert m.ttfp_ms == self.ttfp[rid], f"{where}: TTFP changed from {self.ttfp[rid]} to {m.ttfp_ms}"

    def assert_complete(self) -> None:
        """The stream ended properly: session.closed came, and every response got its done."""
        assert self.closed, "the event stream ended without session.closed"
        missing = self.created - set(self.done)
        assert not missing, f"responses without response.done: {sorted(missing)}"
