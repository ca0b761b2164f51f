"""The session statechart: the single authority over what a session may do.

Theory of operation
-------------------
This file holds the whole lifecycle of one full-duplex session as data: five states, the
triggers that move between them, the guards that choose between branches and the effects a
transition performs, each by name. Nothing here does I/O or knows about time, engines or
sockets; :mod:`duplex_actors.core.session` implements the named guards and effects, and the
actor shell only feeds triggers in and carries effects out.

The chart is defined once with the ``transitions`` library (:data:`MACHINE`), which is what
the design-review exports (Mermaid, DOT, SCXML) are drawn from. A ``transitions.Machine`` per
session would cost each one time and memory, so :func:`compile_chart` reads the one Machine's
events back into a frozen dispatch table, :data:`CHART`, that sessions share; ``tests/core/test_chart_equivalence.py``
proves with hypothesis that the Machine and the table agree on every event sequence, guard
outcome and effect list.

States
  idle        no user audio buffered and no model turn in flight.
  listening   user audio is buffered (or speech is in progress); no model turn is active.
  responding  a model turn is in flight: pending until the engine begins the response
              (``response.created``), then streaming until the turn ends. At most one.
  barge_in    the response was cancelled (barge-in or response.cancel): the epoch moved on,
              the old request is being aborted; user audio keeps flowing in. Left when the
              engine confirms the abort, or straight to responding on a new commit.
  closed      absorbing. Every later command is refused with ``SessionClosed``.

Guards come in two kinds. Most *select* a branch (``has_buffered_audio``: listening or
idle after a commit). Some are *checks*: a condition the trigger must meet at all, declared in
:data:`CHECKS` with the typed error its failure means (a resume naming a stale lease
generation is a ``ResumeConflict``, one whose missed events the journal no longer holds is
``ResyncRequired``). When no branch of a (state, trigger) holds, the refusal is named by the
first failing check in row order, where each row's guards are read left to right and stop at
its first failing guard (so a check behind a failing selector never speaks: a resume with
wrong credentials learns nothing about the journal); with no failing check it is the error
:data:`REFUSALS` names for the pair, else ``IllegalTransition``. Some checks are
*preconditions* (:data:`PRECONDITIONS`: the command's fence, the ids it names): every row of
their trigger begins with them in the open states, and an open pair with no row at all reads
them before its :data:`REFUSALS` error, so a command fenced to another epoch is refused as
such whatever the state would say of it. Either way the state and
everything else is left untouched: guards are pure predicates over the session core.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
from transitions import Machine

from ..errors import (
    NO_SUCH_SESSION,
    Backpressure,
    DuplexError,
    FenceAhead,
    IllegalTransition,
    InputBufferEmpty,
    InvalidCommand,
    ItemNotFound,
    NoActiveResponse,
    ResourceExhausted,
    ResponseInProgress,
    ResponseNotFound,
    ResponsesNotOffered,
    ResumeConflict,
    ResyncRequired,
    ServerDraining,
    SessionClosed,
    StaleFence,
    UnknownFunctionCall,
    UnknownSession,
)
from .chart_rows import row as row


class State(str, enum.Enum):
    """The five states of a session's statechart (the module docstring says what each means)."""

    IDLE = "idle"
    LISTENING = "listening"
    RESPONDING = "responding"
    BARGE_IN = "barge_in"
    CLOSED = "closed"

    def __repr__(self) -> str:  # readable in hypothesis failure reports
        return self.value


IDLE, LISTENING, RESPONDING, BARGE_IN, CLOSED = (s.value for s in State)
OPEN_STATES = [IDLE, LISTENING, RESPONDING, BARGE_IN]
SAME = None  # an internal transition: state unchanged, no exit/enter


# The two effect chains that end a response early; named once so every path that cancels does
# exactly the same things in the same order.
CANCEL_RESPONSE = [
    "advance_epoch",  # fences the old work off: its output becomes stale
    "abort_engine_requests",  # every request of the old epoch
    "drop_undelivered_audio",  # queued packets of the cancelled response never play
    "emit_response_cancelled",  # exactly one response.done (only if response.created went out)
    "reset_timing",
    "start_idle_timer",  # server VAD's idle timeout counts from here (unless the user speaks)
]
# Close does not move the epoch: once closed, every output is stale by definition (nothing is
# registered as in flight any more), and the epoch keeps meaning "number of cancellations".
CLOSE_SESSION = [
    "abort_engine_requests",
    "drop_undelivered_audio",
    "emit_response_cancelled",
    "reset_timing",
    "emit_session_closed",
]
END_TURN_COMPLETED = ["emit_response_completed", "finish_turn", "reset_timing", "start_idle_timer"]
# A failed turn sends what was held first: the failure follows the audio it produced.
END_TURN_FAILED = [
    "release_held_audio",
    "emit_response_failed",
    "finish_turn",
    "reset_timing",
    "start_idle_timer",
]


_row = row  # short, for the table below


@attrs.frozen(slots=True)
class Check:
    """What the failure of a checking guard means: the typed refusal and what the client reads.

    ``message`` (and ``param``, the request field the refusal names) may hold ``{fields}``
    that the session fills in from what its step knows (the epoch a command named, the
    unknown id): the session core's ``_facts_<check>`` method, where it has one."""

    error: type[DuplexError]
    message: str
    param: str | None = None

    def refusal(self, state: str, trigger: str, facts: Mapping[str, Any] | None = None) -> DuplexError:
        """The error this check's failure is refused with, in ``state`` on ``trigger``."""
        message = self.message.format_map(facts) if facts else self.message
        if issubclass(self.error, IllegalTransition):
            return self.error(state, trigger, message)
        if self.param is not None:
            return self.error(message, param=self.param.format_map(facts) if facts else self.param)
        return self.error(message)


#: The checking guards (module docstring): each one's failure is refused with its own error.
#: Every other guard only selects a branch.
CHECKS: Mapping[str, Check] = {
    "audio_at_session_rate": Check(InvalidCommand, "the audio is not at this session's sample rate"),
    "input_fits": Check(Backpressure, "the input buffer would exceed max_input_bytes; commit or clear first"),
    # The runtime's audio budget (audio_budget.py): refused only while it is spent and this
    # client holds more than its share of it.
    "within_audio_budget": Check(
        Backpressure,
        "the server holds all the input audio it may, and this client more than its share: "
        "commit, clear or wait for a response before sending more",
    ),
    "item_audio_within_budget": Check(
        Backpressure,
        "the server holds all the input audio it may, and this client more than its share: "
        "the item's audio does not fit",
    ),
    # The runtime's text budget (text_budget.py), the same way: refused only while it is spent
    # and this client holds more than its share of it.
    "item_text_within_budget": Check(
        ResourceExhausted,
        "the server holds all the conversation text it may, and this client more than its "
        "share: the item does not fit (delete items or close sessions first)",
    ),
    "settings_within_budget": Check(
        ResourceExhausted,
        "the server holds all the conversation text it may, and this client more than its "
        "share: the new instructions and tools do not fit",
    ),
    "response_text_within_budget": Check(
        ResourceExhausted,
        "the server holds all the conversation text it may, and this client more than its "
        "share: the response's own input, instructions and tools do not fit",
    ),
    # Refused as an id nobody opened is: telling the two apart tells a key which ids are live.
    "resume_key_matches": Check(UnknownSession, NO_SUCH_SESSION),
    "resume_generation_current": Check(
        ResumeConflict, "the resume names a lease generation that is not the current one"
    ),
    "resume_token_matches": Check(ResumeConflict, "the resume token does not match"),
    "journal_holds_last_seq": Check(
        ResyncRequired, "the journal no longer holds every event after last_seq: open a new session"
    ),
    "not_draining": Check(
        ServerDraining, "the server is shutting down: it finishes responses in flight and starts none"
    ),
    # The preconditions (PRECONDITIONS): a command fenced to another epoch, an output for a call
    # never made, a response over items not held, played audio that goes backwards.
    "epoch_not_stale": Check(StaleFence, "command names epoch {epoch}; session is at {session_epoch}"),
    "epoch_not_ahead": Check(FenceAhead, "command names epoch {epoch}; session is only at {session_epoch}"),
    "answers_known_call": Check(
        UnknownFunctionCall, "no function call with call_id {call_id!r} in this session"
    ),
    "input_items_known": Check(
        ItemNotFound, "no item {item_id!r} in this conversation", param="response.input[{index}].id"
    ),
    "played_ms_monotonic": Check(InvalidCommand, "played_ms cannot go backwards"),
    "responses_offered": Check(
        ResponsesNotOffered,
        "this is a transcription session: it transcribes the audio and makes no responses",
    ),
}

APPEND_CHECKS = ["audio_at_session_rate", "input_fits", "within_audio_budget"]

# Rows are tried in order for a (state, trigger): the first whose guards hold wins.
TRANSITIONS = [
    # --- user audio -------------------------------------------------------------------------
    # Audio at another rate is refused here, once, for every shell (the server's VAD included).
    _row("append", IDLE, LISTENING, ["buffer_audio"], conditions=APPEND_CHECKS),
    _row("append", [LISTENING, RESPONDING, BARGE_IN], SAME, ["buffer_audio"], conditions=APPEND_CHECKS),
    # Model-native mode: a full audio unit goes to the model, which decides listen or speak.
    _row("unit_ready", LISTENING, SAME, ["submit_unit"], conditions=["model_native", "not_draining"]),
    _row("unit_ready", LISTENING, SAME, conditions=["model_native"]),  # draining: nothing may start
    _row("unit_ready", [IDLE, RESPONDING, BARGE_IN], SAME),  # keep buffering; nothing to ask
    # Under server VAD, speech opens the user's turn: until it closes, every chunk is kept
    # (outside one, the input keeps only the speech_prefix_ms window), and no idle timer runs.
    # close_speech comes after any commit of the speech it closes: it trims what is left.
    _row("speech_started", IDLE, LISTENING, ["emit_speech_started", "open_speech"]),
    _row("speech_started", [LISTENING, BARGE_IN], SAME, ["emit_speech_started", "open_speech"]),
    # Speech over a response is an overlap: the overlap policy later barges in or lets it be.
    # Until it decides, the response's audio is held (the outbox keeps it from the client):
    # OpenAI stops at speech_started, so a GA client must not hear the answer go on over the
    # user. An interruption drops what was held unheard; a backchannel sends it on.
    _row(
        "speech_started",
        RESPONDING,
        SAME,
        ["emit_speech_started", "open_speech", "start_overlap", "hold_response_audio"],
        conditions=["interrupt_response", "holds_audio_on_speech"],
    ),
    _row("speech_started", RESPONDING, SAME, ["emit_speech_started", "open_speech", "start_overlap"]),
    # Each chunk of speech over the response grows the overlap; the policy (core/overlap.py)
    # says when it has become an interruption rather than a backchannel. A session whose
    # speech may not interrupt (GA interrupt_response: false) lets the response play on.
    # A response whose engine turn already ended while its audio was held has no request left
    # to abort: nothing to wait for, so the user's turn goes on in listening.
    _row(
        "overlap",
        RESPONDING,
        LISTENING,
        CANCEL_RESPONSE,
        conditions=["interrupt_response", "overlap_is_interruption", "turn_end_held"],
    ),
    _row(
        "overlap",
        RESPONDING,
        BARGE_IN,
        CANCEL_RESPONSE,
        conditions=["interrupt_response", "overlap_is_interruption"],
    ),
    _row("overlap", RESPONDING, SAME),
    # Server VAD: the end of the user's speech is the end of their turn.
    _row(
        "speech_stopped",
        [LISTENING, BARGE_IN],
        RESPONDING,
        ["emit_speech_stopped", "abort_units", "commit_input", "submit_model_turn", "close_speech"],
        conditions=["server_vad", "has_buffered_audio", "auto_respond", "not_draining"],
    ),
    _row(
        "speech_stopped",
        [LISTENING, BARGE_IN],
        IDLE,
        ["emit_speech_stopped", "abort_units", "commit_input", "close_speech"],
        conditions=["server_vad", "has_buffered_audio"],
    ),
    _row("speech_stopped", [IDLE, LISTENING, BARGE_IN], SAME, ["emit_speech_stopped", "close_speech"]),
    # Speech that could not interrupt is still the user's turn: committed when it ends, it waits
    # for the next response (none is created while this one plays).
    _row(
        "speech_stopped",
        RESPONDING,
        SAME,
        ["emit_speech_stopped", "end_overlap", "abort_units", "commit_input", "close_speech"],
        conditions=["server_vad", "has_buffered_audio"],
        unless=["interrupt_response"],
    ),
    # A backchannel over the response is no turn: past the prefix window it is not kept. The
    # audio held since speech_started goes on; a turn whose engine end waited for that
    # decision completes now.
    _row(
        "speech_stopped",
        RESPONDING,
        LISTENING,
        ["emit_speech_stopped", "end_overlap", "close_speech", "release_held_audio", *END_TURN_COMPLETED],
        conditions=["turn_end_held", "has_buffered_audio"],
    ),
    _row(
        "speech_stopped",
        RESPONDING,
        IDLE,
        ["emit_speech_stopped", "end_overlap", "close_speech", "release_held_audio", *END_TURN_COMPLETED],
        conditions=["turn_end_held"],
    ),
    _row(
        "speech_stopped",
        RESPONDING,
        SAME,
        ["emit_speech_stopped", "end_overlap", "close_speech", "release_held_audio"],
    ),
    # Server VAD's idle timeout (GA turn_detection.idle_timeout_ms): nobody spoke for that long
    # after a response's audio finished playing. What the input holds (the quiet, possibly
    # nothing) is committed and the model prompts the user. The timer is only a hint: speech,
    # a response or a settings change since it was set make it stale, and a stale one changes
    # nothing (idle_deadline_passed asks the session again).
    _row(
        "idle_timeout",
        [IDLE, LISTENING, BARGE_IN],
        RESPONDING,
        ["emit_timeout_triggered", "abort_units", "commit_input", "submit_model_turn"],
        conditions=["idle_deadline_passed", "not_draining"],
    ),
    _row("idle_timeout", OPEN_STATES + [CLOSED], SAME),
    # Units still deciding about audio that is committed or cleared are fenced off: their
    # output would otherwise interleave into the response or answer audio nobody keeps.
    _row("clear", [IDLE, LISTENING], IDLE, ["abort_units", "clear_input"]),
    _row("clear", [RESPONDING, BARGE_IN], SAME, ["abort_units", "clear_input"]),
    # --- end of the user's turn -------------------------------------------------------------
    # A client commit adds the audio to the conversation. Only embedders that asked for it
    # (respond_on_commit) get a response from it; Realtime clients ask with response.create.
    _row(
        "commit",
        [LISTENING, BARGE_IN],
        RESPONDING,
        ["abort_units", "commit_input", "submit_model_turn"],
        conditions=["has_buffered_audio", "respond_on_commit", "not_draining"],
    ),
    _row(
        "commit",
        [LISTENING, BARGE_IN],
        IDLE,
        ["abort_units", "commit_input"],
        conditions=["has_buffered_audio"],
    ),
    # Committing while a response plays is allowed (GA): the audio waits for the next response.
    _row("commit", RESPONDING, SAME, ["abort_units", "commit_input"], conditions=["has_buffered_audio"]),
    # Draining (SIGTERM): the responses in flight finish, no new one starts (ServerDraining).
    # Model-native units still deciding are fenced off as a commit fences them: their answer
    # would be for a turn that has begun, and would stream into the response asked for.
    _row(
        "create_response",
        [IDLE, LISTENING, BARGE_IN],
        RESPONDING,
        ["abort_units", "submit_model_turn"],
        conditions=["not_draining"],
    ),
    # --- conversation items -----------------------------------------------------------------
    _row("create_item", OPEN_STATES, SAME, ["add_item"]),
    _row("delete_item", OPEN_STATES, SAME, ["remove_item"]),
    _row("retrieve_item", OPEN_STATES, SAME, ["send_item"]),
    _row("truncate_item", OPEN_STATES, SAME, ["cut_item_audio"]),
    # --- engine output (already classified as current by its fence) -------------------------
    _row("speak", RESPONDING, SAME, ["begin_response"], unless=["response_begun"]),
    _row("speak", RESPONDING, SAME),  # a second "speak" for a begun response changes nothing
    _row("speak", LISTENING, RESPONDING, ["promote_unit", "begin_response"], conditions=["model_native"]),
    _row("listen", [IDLE, LISTENING, BARGE_IN], SAME, ["emit_decision", "finish_unit"]),
    # Each kind of output streams into the response; the first begins it if the engine did not
    # say "speak" first.
    _row("text_delta", RESPONDING, SAME, ["deliver_text"], conditions=["response_begun"]),
    _row("text_delta", RESPONDING, SAME, ["begin_response", "deliver_text"]),
    _row("audio_packet", RESPONDING, SAME, ["deliver_audio"], conditions=["response_begun"]),
    _row("audio_packet", RESPONDING, SAME, ["begin_response", "deliver_audio"]),
    _row("function_call", RESPONDING, SAME, ["deliver_function_call"], conditions=["response_begun"]),
    _row("function_call", RESPONDING, SAME, ["begin_response", "deliver_function_call"]),
    # The engine finished while the user talks over the held audio: whether the response
    # completed or was interrupted is the overlap policy's to say, so its end waits (a short
    # answer interrupted must end cancelled, not completed).
    _row("turn_done", RESPONDING, SAME, ["hold_turn_end"], conditions=["audio_held"]),
    _row("turn_done", RESPONDING, LISTENING, END_TURN_COMPLETED, conditions=["has_buffered_audio"]),
    _row("turn_done", RESPONDING, IDLE, END_TURN_COMPLETED),
    _row("turn_failed", RESPONDING, LISTENING, END_TURN_FAILED, conditions=["has_buffered_audio"]),
    _row("turn_failed", RESPONDING, IDLE, END_TURN_FAILED),
    _row("turn_failed", [IDLE, LISTENING, BARGE_IN], SAME, ["emit_engine_error", "finish_unit"]),
    # Output fenced off as stale is consumed and counted in every state, closed included.
    _row("stale_output", OPEN_STATES + [CLOSED], SAME, ["count_stale_output"]),
    # --- interruption -----------------------------------------------------------------------
    # (A response whose engine turn ended while its audio was held has nothing to abort.)
    _row("barge_in", RESPONDING, LISTENING, CANCEL_RESPONSE, conditions=["turn_end_held"]),
    _row("barge_in", RESPONDING, BARGE_IN, CANCEL_RESPONSE),
    _row("barge_in", [IDLE, LISTENING, BARGE_IN], SAME),  # nothing to interrupt: races are normal
    # A cancel that names a response must name the active one; otherwise nothing is cancelled.
    _row(
        "cancel",
        RESPONDING,
        LISTENING,
        CANCEL_RESPONSE,
        conditions=["names_active_response", "turn_end_held"],
    ),
    _row("cancel", RESPONDING, BARGE_IN, CANCEL_RESPONSE, conditions=["names_active_response"]),
    # Each aborted request's end settles its abort; the one that settles the last leaves
    # barge_in (aborts_settled: no other abort outstanding).
    _row(
        "abort_confirmed",
        BARGE_IN,
        LISTENING,
        ["settle_abort"],
        conditions=["aborts_settled", "has_buffered_audio"],
    ),
    _row("abort_confirmed", BARGE_IN, IDLE, ["settle_abort"], conditions=["aborts_settled"]),
    _row("abort_confirmed", BARGE_IN, SAME, ["settle_abort"]),  # more aborts still outstanding
    # late confirmation (e.g. of units fenced off by a commit), or after close
    _row("abort_confirmed", [IDLE, LISTENING, RESPONDING, CLOSED], SAME, ["settle_abort"]),
    # --- liveness and lifecycle -------------------------------------------------------------
    _row("heartbeat", OPEN_STATES, SAME, ["touch_lease"]),
    _row("playback_ack", OPEN_STATES, SAME, ["record_playback"]),
    _row("detach", OPEN_STATES, SAME, ["detach_lease"]),
    # Resume: the API key first, then the credentials, then the journal, so a resume that
    # fails authentication learns nothing about the session. The same resume replayed (its
    # answer was lost) gets the same answer, also while the connection that answer went to
    # still looks attached: the answer is lost because that connection broke, which the server
    # may not know for the keepalive's 40 s, well past the replay's window. A replay holds only
    # until the client acts on its connection (replays_last_resume), so it never pushes out a
    # client that has its answer. The lease performs the compare-and-swap.
    _row(
        "resume",
        OPEN_STATES,
        SAME,
        ["resume_lease"],
        conditions=["resume_key_matches", "replays_last_resume", "journal_holds_last_seq"],
    ),
    _row(
        "resume",
        OPEN_STATES,
        SAME,
        ["resume_lease"],
        conditions=[
            "resume_key_matches",
            "resume_generation_current",
            "resume_token_matches",
            "journal_holds_last_seq",
        ],
    ),
    # An update that sets turn detection (the server starts a new detector) or whether speech
    # may interrupt ends the overlap being judged: no speech_stopped of it will come. What was
    # held goes on, as after a backchannel, and a turn end that waited completes.
    _row(
        "update",
        RESPONDING,
        LISTENING,
        ["apply_session_update", "end_overlap", "release_held_audio", *END_TURN_COMPLETED],
        conditions=["update_ends_overlap", "turn_end_held", "has_buffered_audio"],
    ),
    _row(
        "update",
        RESPONDING,
        IDLE,
        ["apply_session_update", "end_overlap", "release_held_audio", *END_TURN_COMPLETED],
        conditions=["update_ends_overlap", "turn_end_held"],
    ),
    _row(
        "update",
        RESPONDING,
        SAME,
        ["apply_session_update", "end_overlap", "release_held_audio"],
        conditions=["update_ends_overlap", "audio_held"],
    ),
    _row("update", OPEN_STATES, SAME, ["apply_session_update"]),
    # A function's output joins the conversation for the next model turn; it starts nothing.
    _row("function_output", OPEN_STATES, SAME, ["record_function_output"]),
    # A committed turn's transcript came back from the recogniser (it runs beside the model
    # turn, so in any state); once closed, a late one is consumed and not sent.
    _row("transcript", OPEN_STATES, SAME, ["emit_transcript"]),
    _row("transcript", CLOSED, SAME),
    # The server began to shut down: from now on the session starts no response (not_draining).
    _row("drain", OPEN_STATES, SAME, ["mark_draining"]),
    _row("drain", CLOSED, SAME),
    _row("close", OPEN_STATES, CLOSED, CLOSE_SESSION),
    _row("close", CLOSED, SAME),  # closing twice is harmless
    # The reaper queues an expiry when it sees a lease run out; by the time it is processed a
    # resume or any activity queued before it may have renewed the lease, so the chart asks
    # the lease again: a stale expiry changes nothing.
    _row("expire", OPEN_STATES, CLOSED, CLOSE_SESSION, conditions=["lease_expired"]),
    _row("expire", OPEN_STATES, SAME),
    _row("fail", OPEN_STATES, CLOSED, CLOSE_SESSION),  # the session actor itself crashed
    # The declared slow-consumer policy: rather than grow without bound or drop events
    # silently, a session whose client stopped reading closes (its terminals still fit).
    _row("outbox_overflow", OPEN_STATES, CLOSED, CLOSE_SESSION),
    # A lease that runs out, or a failure noticed, as the session closes: already done.
    _row("expire", CLOSED, SAME),
    _row("fail", CLOSED, SAME),
]

TRIGGERS = tuple(dict.fromkeys(row["trigger"] for row in TRANSITIONS))

# What a closed session still consumes without a refusal: closing again, and what the engine,
# the recogniser, the reaper or a timer may still deliver after the close.
_CONSUMED_WHEN_CLOSED = (
    "close",
    "stale_output",
    "abort_confirmed",
    "expire",
    "fail",
    "transcript",
    "idle_timeout",
    "drain",
)

# Which error an illegal (state, trigger) raises; anything unlisted raises IllegalTransition.
# Engine triggers refused here are engine protocol errors; the core reports them as such.
REFUSALS: Mapping[tuple[str, str], type[IllegalTransition]] = {
    **{(CLOSED, t): SessionClosed for t in TRIGGERS if t not in _CONSUMED_WHEN_CLOSED},
    (IDLE, "commit"): InputBufferEmpty,
    (LISTENING, "commit"): InputBufferEmpty,
    (BARGE_IN, "commit"): InputBufferEmpty,
    (RESPONDING, "commit"): InputBufferEmpty,
    (RESPONDING, "cancel"): ResponseNotFound,
    (RESPONDING, "create_response"): ResponseInProgress,
    (IDLE, "cancel"): NoActiveResponse,
    (LISTENING, "cancel"): NoActiveResponse,
    (BARGE_IN, "cancel"): NoActiveResponse,
}


class Origin(str, enum.Enum):
    """Who raises a trigger, and so whose fault a refusal of it is."""

    #: a client command (core/commands.py): refusing it raises the typed error to the client.
    CLIENT = "client"
    #: an engine output, classified by its fence: refusing it is the engine's fault, counted
    #: as an invalid output, never the client's.
    ENGINE = "engine"
    #: the session itself: its own measurements (a full audio unit, the overlap grown), its
    #: lease running out, or its actor failing.
    SELF = "self"

    def __repr__(self) -> str:
        return self.value


TRIGGER_ORIGINS: Mapping[str, Origin] = {
    **dict.fromkeys(
        (
            "append",
            "commit",
            "clear",
            "create_response",
            "speech_started",
            "speech_stopped",
            "update",
            "barge_in",
            "cancel",
            "heartbeat",
            "playback_ack",
            "detach",
            "resume",
            "function_output",
            "create_item",
            "delete_item",
            "retrieve_item",
            "truncate_item",
            "close",
        ),
        Origin.CLIENT,
    ),
    **dict.fromkeys(
        (
            "speak",
            "listen",
            "text_delta",
            "audio_packet",
            "function_call",
            "turn_done",
            "turn_failed",
            "stale_output",
            "abort_confirmed",
        ),
        Origin.ENGINE,
    ),
    # A transcript is the session's own measurement of committed audio (a recogniser beside it).
    **dict.fromkeys(
        (
            "unit_ready",
            "overlap",
            "outbox_overflow",
            "expire",
            "fail",
            "transcript",
            "idle_timeout",
            "drain",
        ),
        Origin.SELF,
    ),
}
CLIENT_TRIGGERS = frozenset(t for t, o in TRIGGER_ORIGINS.items() if o is Origin.CLIENT)
ENGINE_TRIGGERS = frozenset(t for t, o in TRIGGER_ORIGINS.items() if o is Origin.ENGINE)
SELF_TRIGGERS = frozenset(t for t, o in TRIGGER_ORIGINS.items() if o is Origin.SELF)

#: A command fenced to an epoch must name the session's current one (core/commands.py).
FENCE_CHECKS = ("epoch_not_stale", "epoch_not_ahead")

#: The checks every row of a trigger begins with, in the open states (:func:`build_machine`
#: puts them in front of each row's guards, so the exports show them on every transition).
#: Read before anything else, they refuse a command before any effect runs; a pair with no
#: row reads them too before its :data:`REFUSALS` error, and closed reads none (a closed
#: session refuses with ``SessionClosed`` whatever the command names). Closing is never
#: fenced off: it is always allowed and always harmless.
PRECONDITIONS: Mapping[str, tuple[str, ...]] = {
    **{t: FENCE_CHECKS for t in sorted(CLIENT_TRIGGERS - {"close"})},
    # An output answers one of this session's calls (a function_call_output item, too).
    "function_output": (*FENCE_CHECKS, "answers_known_call", "item_text_within_budget"),
    "create_item": (
        *FENCE_CHECKS,
        "answers_known_call",
        "item_audio_within_budget",
        "item_text_within_budget",
    ),
    # New settings' text fits the runtime's text budget (or this client is within its share).
    "update": (*FENCE_CHECKS, "settings_within_budget"),
    # A response over its own context (GA response.input) names items the session holds.
    # A transcription session makes none (SessionConfig.responses).
    "create_response": (
        *FENCE_CHECKS,
        "responses_offered",
        "input_items_known",
        "response_text_within_budget",
    ),
    # What the client played of a response never goes backwards.
    "playback_ack": (*FENCE_CHECKS, "played_ms_monotonic"),
}

# The chart's prose (a sentence per trigger, a line per guard) for the generated design review.
from .statechart_docs import GUARD_DOCS as GUARD_DOCS  # noqa: E402
from .statechart_docs import WHY as WHY  # noqa: E402


def with_preconditions(transition: dict[str, Any]) -> dict[str, Any]:
    """``transition`` with its trigger's :data:`PRECONDITIONS` in front of its guards (open
    states only: a row from closed keeps its own)."""
    checks = PRECONDITIONS.get(transition["trigger"])
    sources = transition["source"] if isinstance(transition["source"], list) else [transition["source"]]
    if not checks or sources == [CLOSED]:
        return transition
    if CLOSED in sources:
        raise ValueError(f"a {transition['trigger']!r} row from closed and open states: split it")
    return {**transition, "conditions": [*checks, *transition["conditions"]]}


def build_machine(transitions: Iterable[dict[str, Any]]) -> Machine:
    """The transitions Machine of a table of rows (the shipped chart's, or a policy's), each
    row given its trigger's preconditions."""
    return Machine(
        model=None,
        states=[s.value for s in State],
        transitions=[with_preconditions(t) for t in transitions],
        initial=IDLE,
        auto_transitions=False,
        send_event=False,
        ignore_invalid_triggers=False,
    )


MACHINE = build_machine(TRANSITIONS)


# --- the compiled dispatch table ------------------------------------------------------------


@attrs.frozen(slots=True)
class Branch:
    dest: str  # equal to the source for internal transitions
    guards: tuple[tuple[str, bool], ...]  # (guard name, required truth)
    effects: tuple[str, ...]


@attrs.frozen(slots=True)
class Resolution:
    source: str
    trigger: str
    dest: str
    effects: tuple[str, ...]


class CompiledChart:
    """A frozen ``{(state, trigger): branches}`` table read back from a transitions Machine.

    Two tables are derived from it, never written by hand: :attr:`fixed_steps`, the
    (state, trigger) pairs whose outcome the table alone decides up to its checks (one branch,
    or an unguarded first one, back to the same state, whose guards are all checks that must
    hold), and from those :attr:`append_buffers_in`, the states where an append, once its
    checks pass, does nothing but buffer the audio. The session core takes its append fast path
    only in those states, so a chart that changes the append rows changes the fast path with
    them (``tests/core/test_append_fast_path.py`` checks both paths agree).
    """

    __slots__ = ("table", "states", "triggers", "_resolved", "fixed_steps", "append_buffers_in")

    def __init__(
        self,
        table: Mapping[tuple[str, str], tuple[Branch, ...]],
        states: Iterable[str],
        triggers: Iterable[str],
    ) -> None:
        self.table = dict(table)
        self.states = tuple(states)
        self.triggers = tuple(triggers)
        #: (state, trigger) -> (checks, effects), where resolve() can answer nothing but this
        #: branch or the refusal of the first of its checks that fails (a check's failure
        #: refuses, it never selects another branch when there is none to select).
        self.fixed_steps: Mapping[tuple[str, str], tuple[tuple[str, ...], tuple[str, ...]]] = {
            key: (tuple(name for name, _ in branches[0].guards), branches[0].effects)
            for key, branches in self.table.items()
            if branches
            and branches[0].dest == key[0]
            and (len(branches) == 1 or not branches[0].guards)
            and all(want and name in CHECKS for name, want in branches[0].guards)
        }
        #: State -> the checks of its append row, for the states where an append is exactly
        #: "check, then buffer the audio": no other guard, no state change, no other effect.
        #: The append is the runtime's most frequent message (50 a second per session); in
        #: these states the core runs the checks and the effect without resolving the row
        #: (core/session.py). Never closed, whatever a chart says: a closed session's commands
        #: take another path.
        self.append_buffers_in: Mapping[str, tuple[str, ...]] = {
            state: checks
            for (state, trigger), (checks, effects) in self.fixed_steps.items()
            if trigger == "append" and effects == ("buffer_audio",) and state != CLOSED
        }
        # Resolutions are frozen values: each branch's is built once here, not once per event.
        self._resolved = {
            (state, trigger): tuple(
                (b.guards, Resolution(state, trigger, b.dest, b.effects)) for b in branches
            )
            for (state, trigger), branches in self.table.items()
        }

    def resolve(self, state: str, trigger: str, guard: Callable[[str], bool]) -> Resolution:
        """Pick the branch for ``trigger`` in ``state``; raise the declared refusal if none.
        ``guard(name)`` says whether the named guard holds."""
        return self.resolve_on(guard, _ASK_BY_NAME, state, trigger, None)

    def resolve_on(
        self,
        subject: Any,
        guards: Mapping[str, Callable[[Any, Any], bool]],
        state: str,
        trigger: str,
        step: Any,
    ) -> Resolution:
        """:meth:`resolve` for guards that are functions of a subject and the step being taken
        (``guards[name](subject, step)``: the session core's ``_g_`` methods, given the
        :class:`~duplex_actors.core.step.Step` of the trigger): one call per guard, which the
        append path feels. The effects of the returned branch are the caller's to perform."""
        branches = self._resolved.get((state, trigger))
        if branches is not None:
            for conditions, resolution in branches:
                for name, want in conditions:
                    if guards[name](subject, step) is not want:
                        break
                else:
                    return resolution
        facts = getattr(guards, "facts", None)
        raise self.refusal(
            state,
            trigger,
            lambda name: guards[name](subject, step),
            None if facts is None else lambda name: facts(name, subject, step),
        )

    def refusal(
        self,
        state: str,
        trigger: str,
        guard: Callable[[str], bool] | None = None,
        facts: Callable[[str], Mapping[str, Any] | None] | None = None,
    ) -> DuplexError:
        """The error a (state, trigger) with no branch holding is refused with (module doc);
        ``facts(check)`` fills in the failing check's message."""
        if guard is not None:
            branches = self.table.get((state, trigger))
            if branches:
                name = first_failing_check(branches, guard)
            else:  # no row: its trigger's preconditions still come first
                name = next((n for n in self.preconditions_of(state, trigger) if not guard(n)), None)
            if name is not None:
                return CHECKS[name].refusal(state, trigger, None if facts is None else facts(name))
        return refusal(state, trigger)

    def preconditions_of(self, state: str, trigger: str) -> tuple[str, ...]:
        """The checks a (state, trigger) with no row reads before its typed refusal."""
        if state == CLOSED or (state, trigger) in self.table:
            return ()
        return PRECONDITIONS.get(trigger, ())


class _AskByName(dict[str, Callable[[Callable[[str], bool], None], bool]]):
    """``resolve``'s guards as functions of the guard callable (and of no step):
    ``self[name](guard, None) == guard(name)``."""

    def __missing__(self, name: str) -> Callable[[Callable[[str], bool], None], bool]:
        function = self[name] = lambda guard, _step: guard(name)
        return function


_ASK_BY_NAME = _AskByName()


def refusal(state: str, trigger: str) -> IllegalTransition:
    """The error a pair with no transition at all (or no failing check) is refused with."""
    return REFUSALS.get((state, trigger), IllegalTransition)(state, trigger)


def first_failing_check(branches: Iterable[Branch], guard: Callable[[str], bool]) -> str | None:
    """The checking guard that names the refusal when none of ``branches`` holds, or None."""
    for branch in branches:
        for name, want in branch.guards:
            if guard(name) is not want:
                if want and name in CHECKS:  # a check is always a condition, never an unless
                    return name
                break
    return None


def compile_chart(machine: Machine) -> CompiledChart:
    table: dict[tuple[str, str], list[Branch]] = {}
    for trigger, event in machine.events.items():
        for source, transitions in event.transitions.items():
            for t in transitions:
                # Rows name guards and effects by string (the core resolves them), so the
                # Machine hands the same strings back.
                guards = tuple((str(c.func), bool(c.target)) for c in t.conditions)
                effects = tuple(str(e) for e in t.after)
                dest = source if t.dest is None else t.dest
                table.setdefault((source, trigger), []).append(Branch(dest, guards, effects))
    frozen = {key: tuple(branches) for key, branches in table.items()}
    return CompiledChart(frozen, machine.states.keys(), machine.events.keys())


CHART = compile_chart(MACHINE)

GUARDS = tuple(sorted({name for bs in CHART.table.values() for b in bs for name, _ in b.guards}))
EFFECTS = tuple(sorted({e for bs in CHART.table.values() for b in bs for e in b.effects}))
