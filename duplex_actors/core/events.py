"""Outgoing server events, named as in the OpenAI Realtime API (GA) plus duplex extensions.

Every event carries ``server_event_seq`` (monotonic per session, what resume replays by) and
the ``epoch`` it was produced under; events inside a response carry ``response_id``. They are
typed values only: audio is raw pcm16 bytes at the engine's rate, and nothing here knows JSON.
The server's codec (:mod:`duplex_actors.server.codec`) turns each into the Realtime GA shape,
converting audio to the client's declared format on the way.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from .conversation import Item
from .engine_io import InputUsage
from .timing import ResponseMetrics


@attrs.frozen(slots=True, kw_only=True)
class ServerEvent:
    TYPE: ClassVar[str] = "event"
    #: True for duplex extensions that OpenAI's Realtime API does not define.
    EXTENSION: ClassVar[bool] = False
    #: Terminal events always fit the output buffer (it keeps a reserve for them).
    TERMINAL: ClassVar[bool] = False

    #: The event's wire name (``TYPE``), read by every consumer of every event: a plain class
    #: attribute, set for each event class as it is defined, rather than a property (a call
    #: per read).
    type: ClassVar[str] = TYPE

    seq: int
    epoch: int
    session_id: str

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.type = cls.TYPE


@attrs.frozen(slots=True, kw_only=True)
class ResponseEvent(ServerEvent):
    response_id: str
    item_id: str = ""
    #: The response output item it belongs to (the assistant message's; 0 unless a function
    #: call came before it).
    output_index: int = 0


# --- session ------------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class SessionCreated(ServerEvent):
    TYPE = "session.created"
    config: dict[str, Any] = attrs.field(factory=dict)
    resume_token: str = ""


@attrs.frozen(slots=True, kw_only=True)
class SessionUpdated(ServerEvent):
    TYPE = "session.updated"
    config: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen(slots=True, kw_only=True)
class SessionResumed(ServerEvent):
    TYPE = "session.resumed"
    EXTENSION = True
    generation: int
    resume_token: str
    replayed: int


@attrs.frozen(slots=True, kw_only=True)
class SessionClosedEvent(ServerEvent):
    TYPE = "session.closed"
    EXTENSION = True
    TERMINAL = True
    reason: str


@attrs.frozen(slots=True, kw_only=True)
class HeartbeatAck(ServerEvent):
    TYPE = "heartbeat.ack"
    EXTENSION = True


@attrs.frozen(slots=True, kw_only=True)
class ErrorEvent(ServerEvent):
    TYPE = "error"
    TERMINAL = True  # an error answers a command; it must never be squeezed out
    code: str
    message: str
    #: OpenAI's error type: invalid_request_error (the client's fault) or server_error.
    error_type: str = "invalid_request_error"
    client_event_id: str | None = None
    #: The client field the error is about, when there is one.
    param: str | None = None
    #: Our exception class name (e.g. InputBufferEmpty), for logs and our own client.
    error_class: str | None = None


# --- input audio buffer -------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class SpeechStarted(ServerEvent):
    TYPE = "input_audio_buffer.speech_started"
    audio_start_ms: int
    item_id: str


@attrs.frozen(slots=True, kw_only=True)
class SpeechStopped(ServerEvent):
    TYPE = "input_audio_buffer.speech_stopped"
    audio_end_ms: int
    item_id: str


@attrs.frozen(slots=True, kw_only=True)
class InputTimeoutTriggered(ServerEvent):
    """Server VAD's idle timeout ran out: the quiet since the last response (``audio_start_ms``
    to ``audio_end_ms`` on the input's timeline) is committed as ``item_id`` and answered."""

    TYPE = "input_audio_buffer.timeout_triggered"
    audio_start_ms: int
    audio_end_ms: int
    item_id: str


@attrs.frozen(slots=True, kw_only=True)
class InputCommitted(ServerEvent):
    TYPE = "input_audio_buffer.committed"
    item_id: str
    audio_ms: int
    previous_item_id: str | None = None


@attrs.frozen(slots=True, kw_only=True)
class InputCleared(ServerEvent):
    TYPE = "input_audio_buffer.cleared"


# --- conversation -------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class ItemAdded(ServerEvent):
    TYPE = "conversation.item.added"
    item: Item
    previous_item_id: str | None = None


@attrs.frozen(slots=True, kw_only=True)
class ItemDone(ServerEvent):
    TYPE = "conversation.item.done"
    item: Item
    previous_item_id: str | None = None


@attrs.frozen(slots=True, kw_only=True)
class ItemRetrieved(ServerEvent):
    TYPE = "conversation.item.retrieved"
    item: Item


@attrs.frozen(slots=True, kw_only=True)
class ItemDeleted(ServerEvent):
    TYPE = "conversation.item.deleted"
    item_id: str


@attrs.frozen(slots=True, kw_only=True)
class ItemTruncated(ServerEvent):
    TYPE = "conversation.item.truncated"
    item_id: str
    content_index: int
    audio_end_ms: int


@attrs.frozen(slots=True, kw_only=True)
class DecisionEvent(ServerEvent):
    TYPE = "duplex.decision"
    EXTENSION = True
    decision: str  # "listen" | "speak"
    turn_id: int


@attrs.frozen(slots=True, kw_only=True)
class StateChanged(ServerEvent):
    """The session's statechart changed state (opt-in: ``duplex.state_events``), so a client
    can show the live chart. ``source == dest`` once, when turned on: the state it is in."""

    TYPE = "duplex.state"
    EXTENSION = True
    source: str
    dest: str
    trigger: str


# --- response -----------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class ResponseCreated(ResponseEvent):
    TYPE = "response.created"
    turn_id: int
    metrics: ResponseMetrics | None = None
    modalities: tuple[str, ...] = ("audio",)
    metadata: dict[str, str] | None = attrs.field(default=None, eq=False, hash=False)
    #: The token limit the response runs under (None: the engine's own).
    max_output_tokens: int | None = None
    #: Outside the conversation (GA conversation "none": conversation_id null on the wire).
    out_of_band: bool = False


@attrs.frozen(slots=True, kw_only=True)
class OutputItemAdded(ResponseEvent):
    TYPE = "response.output_item.added"
    item: Item


@attrs.frozen(slots=True, kw_only=True)
class ContentPartAdded(ResponseEvent):
    TYPE = "response.content_part.added"
    #: "audio" (a spoken response, its words in the transcript) or "text"
    part_type: str = "audio"


@attrs.frozen(slots=True, kw_only=True)
class TextDeltaEvent(ResponseEvent):
    TYPE = "response.output_text.delta"
    delta: str
    metrics: ResponseMetrics | None = None  # set on the first delta (it carries TTFT)


@attrs.frozen(slots=True, kw_only=True)
class AudioDeltaEvent(ResponseEvent):
    TYPE = "response.output_audio.delta"
    pcm: bytes = attrs.field(repr=lambda b: f"<{len(b)} bytes>")
    sample_rate: int = 16000
    metrics: ResponseMetrics | None = None  # set on the first packet (it carries TTFP)


@attrs.frozen(slots=True, kw_only=True)
class TranscriptDeltaEvent(ResponseEvent):
    TYPE = "response.output_audio_transcript.delta"
    delta: str
    metrics: ResponseMetrics | None = None  # set on the first delta of an audio response (TTFT)


@attrs.frozen(slots=True, kw_only=True)
class TextDone(ResponseEvent):
    TYPE = "response.output_text.done"
    text: str


@attrs.frozen(slots=True, kw_only=True)
class AudioDone(ResponseEvent):
    TYPE = "response.output_audio.done"


@attrs.frozen(slots=True, kw_only=True)
class TranscriptDone(ResponseEvent):
    TYPE = "response.output_audio_transcript.done"
    transcript: str


@attrs.frozen(slots=True, kw_only=True)
class ContentPartDone(ResponseEvent):
    TYPE = "response.content_part.done"
    part_type: str = "audio"
    #: The part's final words (its text, or the transcript of its audio).
    text: str = ""


@attrs.frozen(slots=True, kw_only=True)
class OutputItemDone(ResponseEvent):
    TYPE = "response.output_item.done"
    status: str = "completed"
    item: Item


@attrs.frozen(slots=True, kw_only=True)
class ResponseDone(ResponseEvent):
    TYPE = "response.done"
    TERMINAL = True
    status: str  # completed | cancelled | failed | incomplete
    reason: str | None = None
    turn_id: int
    metrics: ResponseMetrics | None = None
    modalities: tuple[str, ...] = ("audio",)
    metadata: dict[str, str] | None = attrs.field(default=None, eq=False, hash=False)
    #: The response's output items (one assistant message, or none if it never began).
    output: tuple[Item, ...] = ()
    #: Tokens the response generated (text deltas' token counts).
    output_tokens: int = 0
    #: What the model read for it, as the engine reported (None: not reported, e.g. the
    #: response was cancelled before the engine finished it).
    input_usage: InputUsage | None = None
    max_output_tokens: int | None = None
    out_of_band: bool = False


RESPONSE_STATUSES = ("completed", "cancelled", "failed", "incomplete")
