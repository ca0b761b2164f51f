"""Outgoing server events, named as in the OpenAI Realtime API (GA) plus duplex extensions.

Every event carries ``server_event_seq`` (monotonic per session, what resume replays by) and
the ``epoch`` it was produced under; events inside a response carry ``response_id``. Audio is
kept as raw pcm16 bytes here; the wire layer base64-encodes it. ``to_wire()`` gives the JSON
shape clients of the Realtime API already parse.
"""

from __future__ import annotations

import base64
from typing import Any, ClassVar

import attrs

from .timing import ResponseMetrics


@attrs.frozen(slots=True, kw_only=True)
class ServerEvent:
    TYPE: ClassVar[str] = "event"
    #: True for duplex extensions that OpenAI's Realtime API does not define.
    EXTENSION: ClassVar[bool] = False
    #: Terminal events always fit the output buffer (it keeps a reserve for them).
    TERMINAL: ClassVar[bool] = False

    seq: int
    epoch: int
    session_id: str

    @property
    def type(self) -> str:
        return self.TYPE

    def body(self) -> dict[str, Any]:
        return {}

    def to_wire(self) -> dict[str, Any]:
        wire = {"type": self.TYPE, "event_id": f"evt_{self.session_id[-8:]}_{self.seq}",
                "server_event_seq": self.seq, "epoch": self.epoch}
        wire.update(self.body())
        return wire


@attrs.frozen(slots=True, kw_only=True)
class ResponseEvent(ServerEvent):
    response_id: str
    item_id: str = ""

    def body(self) -> dict[str, Any]:
        return {"response_id": self.response_id, "item_id": self.item_id, "output_index": 0,
                "content_index": 0}


# --- session ------------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class SessionCreated(ServerEvent):
    TYPE = "session.created"
    config: dict = attrs.field(factory=dict)
    resume_token: str = ""

    def body(self):
        return {"session": {"id": self.session_id, "object": "realtime.session", **self.config},
                "resume_token": self.resume_token}


@attrs.frozen(slots=True, kw_only=True)
class SessionUpdated(ServerEvent):
    TYPE = "session.updated"
    config: dict = attrs.field(factory=dict)

    def body(self):
        return {"session": {"id": self.session_id, "object": "realtime.session", **self.config}}


@attrs.frozen(slots=True, kw_only=True)
class SessionResumed(ServerEvent):
    TYPE = "session.resumed"
    EXTENSION = True
    generation: int
    resume_token: str
    replayed: int

    def body(self):
        return {"generation": self.generation, "resume_token": self.resume_token,
                "replayed": self.replayed}


@attrs.frozen(slots=True, kw_only=True)
class SessionClosedEvent(ServerEvent):
    TYPE = "session.closed"
    EXTENSION = True
    TERMINAL = True
    reason: str

    def body(self):
        return {"reason": self.reason}


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
    error_type: str = "invalid_request_error"
    client_event_id: str | None = None

    def body(self):
        return {"error": {"type": self.error_type, "code": self.code, "message": self.message,
                          "event_id": self.client_event_id}}


# --- input audio buffer -------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class SpeechStarted(ServerEvent):
    TYPE = "input_audio_buffer.speech_started"
    audio_start_ms: int
    item_id: str

    def body(self):
        return {"audio_start_ms": self.audio_start_ms, "item_id": self.item_id}


@attrs.frozen(slots=True, kw_only=True)
class SpeechStopped(ServerEvent):
    TYPE = "input_audio_buffer.speech_stopped"
    audio_end_ms: int
    item_id: str

    def body(self):
        return {"audio_end_ms": self.audio_end_ms, "item_id": self.item_id}


@attrs.frozen(slots=True, kw_only=True)
class InputCommitted(ServerEvent):
    TYPE = "input_audio_buffer.committed"
    item_id: str
    audio_ms: int

    def body(self):
        return {"item_id": self.item_id, "previous_item_id": None, "audio_ms": self.audio_ms}


@attrs.frozen(slots=True, kw_only=True)
class InputCleared(ServerEvent):
    TYPE = "input_audio_buffer.cleared"


@attrs.frozen(slots=True, kw_only=True)
class DecisionEvent(ServerEvent):
    TYPE = "duplex.decision"
    EXTENSION = True
    decision: str  # "listen" | "speak"
    turn_id: int

    def body(self):
        return {"decision": self.decision, "turn_id": self.turn_id}


# --- response -----------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class ResponseCreated(ResponseEvent):
    TYPE = "response.created"
    turn_id: int
    metrics: ResponseMetrics | None = None
    metadata: dict | None = None  # the client's response.create metadata, echoed

    def body(self):
        return {"response": {"id": self.response_id, "object": "realtime.response",
                             "status": "in_progress", "metadata": self.metadata,
                             "turn_id": self.turn_id,
                             "metrics": self.metrics.to_wire() if self.metrics else None}}


@attrs.frozen(slots=True, kw_only=True)
class OutputItemAdded(ResponseEvent):
    TYPE = "response.output_item.added"

    def body(self):
        return {"response_id": self.response_id, "output_index": 0,
                "item": {"id": self.item_id, "type": "message", "role": "assistant",
                         "status": "in_progress"}}


@attrs.frozen(slots=True, kw_only=True)
class ContentPartAdded(ResponseEvent):
    TYPE = "response.content_part.added"


@attrs.frozen(slots=True, kw_only=True)
class TextDeltaEvent(ResponseEvent):
    TYPE = "response.output_text.delta"
    delta: str
    metrics: ResponseMetrics | None = None  # set on the first delta (it carries TTFT)

    def body(self):
        b = super().body()
        b["delta"] = self.delta
        if self.metrics is not None:
            b["metrics"] = self.metrics.to_wire()
        return b


@attrs.frozen(slots=True, kw_only=True)
class AudioDeltaEvent(ResponseEvent):
    TYPE = "response.output_audio.delta"
    pcm: bytes = attrs.field(repr=lambda b: f"<{len(b)} bytes>")
    sample_rate: int = 16000
    metrics: ResponseMetrics | None = None  # set on the first packet (it carries TTFP)

    def body(self):
        b = super().body()
        b["delta"] = base64.b64encode(self.pcm).decode("ascii")
        b["sample_rate"] = self.sample_rate
        if self.metrics is not None:
            b["metrics"] = self.metrics.to_wire()
        return b


@attrs.frozen(slots=True, kw_only=True)
class TranscriptDeltaEvent(ResponseEvent):
    TYPE = "response.output_audio_transcript.delta"
    delta: str

    def body(self):
        b = super().body()
        b["delta"] = self.delta
        return b


@attrs.frozen(slots=True, kw_only=True)
class TextDone(ResponseEvent):
    TYPE = "response.output_text.done"
    text: str

    def body(self):
        b = super().body()
        b["text"] = self.text
        return b


@attrs.frozen(slots=True, kw_only=True)
class AudioDone(ResponseEvent):
    TYPE = "response.output_audio.done"


@attrs.frozen(slots=True, kw_only=True)
class TranscriptDone(ResponseEvent):
    TYPE = "response.output_audio_transcript.done"
    transcript: str

    def body(self):
        b = super().body()
        b["transcript"] = self.transcript
        return b


@attrs.frozen(slots=True, kw_only=True)
class ContentPartDone(ResponseEvent):
    TYPE = "response.content_part.done"


@attrs.frozen(slots=True, kw_only=True)
class OutputItemDone(ResponseEvent):
    TYPE = "response.output_item.done"
    status: str = "completed"

    def body(self):
        return {"response_id": self.response_id, "output_index": 0,
                "item": {"id": self.item_id, "type": "message", "role": "assistant",
                         "status": self.status}}


@attrs.frozen(slots=True, kw_only=True)
class ResponseDone(ResponseEvent):
    TYPE = "response.done"
    TERMINAL = True
    status: str  # completed | cancelled | failed | incomplete
    reason: str | None = None
    turn_id: int
    metrics: ResponseMetrics | None = None
    #: The response's output items (message, function calls) as wire dicts: clients read
    #: function calls from here (pipecat does).
    output: tuple = ()
    metadata: dict | None = None

    def body(self):
        details = {"type": self.status, "reason": self.reason} if self.reason else None
        return {"response": {"id": self.response_id, "object": "realtime.response",
                             "status": self.status, "status_details": details,
                             "output": list(self.output), "metadata": self.metadata,
                             "turn_id": self.turn_id,
                             "metrics": self.metrics.to_wire() if self.metrics else None}}


RESPONSE_STATUSES = ("completed", "cancelled", "failed", "incomplete")
