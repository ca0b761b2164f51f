"""The server-side codec: typed session events in, OpenAI Realtime GA JSON out.

Theory of operation
-------------------
Sessions produce typed values (:mod:`duplex_actors.core.events`); this module alone knows how
each looks on the wire. :func:`encode` turns one event into the JSON objects the client gets,
with every field OpenAI's GA schema requires (``tests/server/test_ga_schema.py`` validates
each against the openai SDK's own pydantic models). It also converts response audio to the
client's declared output format (:mod:`.audio_format`).

Besides OpenAI's fields every session event carries our ``server_event_seq`` (what resume
replays by) and ``epoch`` (the fence). ``response.done`` is followed by OpenAI's
``rate_limits.updated``: it is derived from the done event rather than being a session event
of its own, so it carries ``server_event_seq: null`` and a resume that replays the done sends
it again.

The codec is stateless apart from :class:`WireSession` (what the client declared: formats,
voice, model, turn detection), so encoding the same event twice gives the same JSON.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import attrs

from ..core import events as ev
from ..core import function_events as fev
from ..core import transcription_events as tev
from ..core.conversation import Item
from ..core.session_config import SessionConfig
from ..core.timing import ResponseMetrics
from .audio_format import GA_DEFAULT, AudioFormat, encode_output

#: GA's status_details.reason values; our other reasons travel as ``duplex_reason``.
_GA_REASONS = ("turn_detected", "client_cancelled", "max_output_tokens", "content_filter")


@attrs.define(slots=True, kw_only=True)
class WireSession:
    """What the client declared about the wire, kept by the server per session."""

    model: str = "duplex-actors"
    voice: str = "alloy"
    input_format: AudioFormat = GA_DEFAULT
    output_format: AudioFormat = GA_DEFAULT
    #: The GA turn_detection object in force (None: manual turns).
    turn_detection: dict[str, Any] | None = None
    #: The engine's token limits (EngineCapabilities): the one a response runs under when it
    #: names none, and the most any may ask for; None where the engine has none. With them
    #: ``max_output_tokens`` echoes the limit that really applies, never an "inf" that is not.
    engine_max_output_tokens: int | None = None
    engine_max_output_tokens_limit: int | None = None
    #: The binary-audio extension (session.update duplex.binary_audio): a binary websocket
    #: frame is an append of raw audio in ``input_format``.
    binary_audio: bool = False

    def output_token_limit(self, requested: int | None) -> int | str:
        """The limit a response asking for ``requested`` (None: nothing) really runs under."""
        if requested is None:
            limit = self.engine_max_output_tokens
        elif self.engine_max_output_tokens_limit is not None:
            limit = min(requested, self.engine_max_output_tokens_limit)
        else:
            limit = requested
        return "inf" if limit is None else limit


def encode(event: ev.ServerEvent, wire: WireSession) -> list[dict[str, Any]]:
    """The JSON objects one event becomes, in the order they go out."""
    out = {
        "type": event.TYPE,
        "event_id": event_id(event),
        "server_event_seq": event.seq,
        "epoch": event.epoch,
    }
    body = _BODIES.get(type(event))
    if body is not None:
        out.update(body(event, wire))
    if isinstance(event, ev.ResponseDone):
        return [out, _rate_limits(event)]
    return [out]


def event_id(event: ev.ServerEvent) -> str:
    return f"evt_{event.session_id[-8:]}_{event.seq}"


# --- shared shapes ---------------------------------------------------------------------------


def session_type(config: SessionConfig) -> str:
    """The GA ``session.type`` of a session: "transcription" for one that makes no responses."""
    return "realtime" if config.responses else "transcription"


def session_object(session_id: str, config: dict[str, Any], wire: WireSession) -> dict[str, Any]:
    """GA ``session`` (type "realtime", or "transcription": :func:`transcription_session_object`),
    plus our settings under the extension key ``duplex``."""
    if not config.get("responses", True):
        return transcription_session_object(session_id, config, wire)
    modalities = config.get("modalities") or ["audio"]
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": wire.model,
        "output_modalities": ["audio"] if "audio" in modalities else ["text"],
        "instructions": config.get("instructions") or "",
        "audio": {
            "input": {
                "format": wire.input_format.to_wire(),
                "turn_detection": wire.turn_detection,
                "transcription": _transcription_object(config),
                "noise_reduction": None,
            },
            "output": {
                "format": wire.output_format.to_wire(),
                "voice": wire.voice,
                "speed": config.get("output_speed", 1.0),
            },
        },
        "max_output_tokens": wire.output_token_limit(config.get("max_output_tokens") or None),
        "tool_choice": _tool_choice(config.get("tool_choice") or "auto"),
        "tools": [{**t, "parameters": json.loads(t["parameters"])} for t in config.get("tools") or ()],
        "tracing": None,
        "truncation": "auto",
        "duplex": {
            k: config[k]
            for k in (
                "auto_respond",
                "respond_on_commit",
                "model_native",
                "state_events",
                "server_vad",
                "sample_rate",
                "min_interruption_ms",
                "modalities",
            )
            if k in config
        }
        | ({"binary_audio": True} if wire.binary_audio else {}),
    }


def transcription_session_object(
    session_id: str, config: dict[str, Any], wire: WireSession
) -> dict[str, Any]:
    """GA's transcription session: its audio input alone (nothing answers it, so it has no
    output, instructions or tools), and its turn detection without the two settings that only
    concern responses."""
    detection = wire.turn_detection
    if detection is not None:
        detection = {k: v for k, v in detection.items() if k not in ("create_response", "interrupt_response")}
    return {
        "type": "transcription",
        "object": "realtime.session",
        "id": session_id,
        "audio": {
            "input": {
                "format": wire.input_format.to_wire(),
                "turn_detection": detection,
                "transcription": _transcription_object(config),
                "noise_reduction": None,
            },
        },
        "include": None,
        "duplex": {k: config[k] for k in ("server_vad", "sample_rate") if k in config}
        | ({"binary_audio": True} if wire.binary_audio else {}),
    }


def _transcription_object(config: dict[str, Any]) -> dict[str, Any] | None:
    """The input transcription as the client said it (unsaid: English, what the recogniser
    hears); a language it cannot hear fails each turn's transcription, not this echo."""
    if not config.get("transcription"):
        return None
    return {"model": config["transcription"], "language": config.get("transcription_language") or "en"}


def item_object(item: Item) -> dict[str, Any]:
    if item.type == "function_call":
        return {
            "id": item.id,
            "object": "realtime.item",
            "type": "function_call",
            "status": item.status,
            "call_id": item.call_id or "",
            "name": item.name or "",
            "arguments": item.arguments or "",
        }
    if item.type == "function_call_output":
        return {
            "id": item.id,
            "object": "realtime.item",
            "type": "function_call_output",
            "status": item.status,
            "call_id": item.call_id or "",
            "output": item.output or "",
        }
    parts = []
    for p in item.content:
        if p.type == "input_audio":
            parts.append({"type": "input_audio", "transcript": p.transcript})
        elif p.type == "output_audio":
            parts.append({"type": "output_audio", "transcript": p.transcript or ""})
        elif p.type == "output_text":
            parts.append({"type": "output_text", "text": p.text or ""})
        elif p.type == "input_image":  # the image itself is not kept (see wire_items._content_text)
            parts.append({"type": "input_image"})
        else:
            parts.append({"type": "input_text", "text": p.text or ""})
    # GA has no developer role: a developer message is a system message on the wire.
    role = "system" if item.role == "developer" else item.role
    return {
        "id": item.id,
        "object": "realtime.item",
        "type": "message",
        "role": role,
        "status": item.status,
        "content": parts,
    }


def _conversation_id(event: ev.ServerEvent) -> str:
    return f"conv_{event.session_id[-24:]}"


def _response_object(
    e: ev.ResponseCreated | ev.ResponseDone,
    wire: WireSession,
    *,
    status: str,
    details: dict[str, Any] | None,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": e.response_id,
        "object": "realtime.response",
        "status": status,
        "status_details": details,
        "output": output,
        "output_modalities": ["audio"] if "audio" in e.modalities else ["text"],
        "conversation_id": None if e.out_of_band else _conversation_id(e),
        "metadata": e.metadata,
        "usage": usage,
        "max_output_tokens": wire.output_token_limit(e.max_output_tokens or None),
        "audio": {"output": {"format": wire.output_format.to_wire(), "voice": wire.voice}},
        # duplex extensions
        "turn_id": e.turn_id,
        "metrics": e.metrics.to_wire() if e.metrics else None,
    }


def _in_response(e: ev.ResponseEvent) -> dict[str, Any]:
    return {
        "response_id": e.response_id,
        "item_id": e.item_id,
        "output_index": e.output_index,
        "content_index": 0,
    }


def _with_metrics(body: dict[str, Any], metrics: ResponseMetrics | None) -> dict[str, Any]:
    if metrics is not None:
        body["metrics"] = metrics.to_wire()
    return body


def _rate_limits(done: ev.ResponseDone) -> dict[str, Any]:
    # This server enforces no request or token quota per client: the list of limits that apply
    # is empty, rather than invented figures a client could read as "nothing left".
    return {
        "type": "rate_limits.updated",
        "event_id": f"{event_id(done)}_rl",
        "server_event_seq": None,
        "epoch": done.epoch,
        "rate_limits": [],
    }


# --- one body per event type -----------------------------------------------------------------


def _tool_choice(choice: str) -> str | dict[str, str]:
    """GA's spelling: a mode as a string, a named function as an object."""
    if choice in ("auto", "none", "required"):
        return choice
    return {"type": "function", "name": choice}


def _session_created(e: ev.SessionCreated, wire: WireSession) -> dict[str, Any]:
    return {"session": session_object(e.session_id, e.config, wire), "resume_token": e.resume_token}


def _session_updated(e: ev.SessionUpdated, wire: WireSession) -> dict[str, Any]:
    return {"session": session_object(e.session_id, e.config, wire)}


def _error(e: ev.ErrorEvent, wire: WireSession) -> dict[str, Any]:
    return {
        "error": {
            "type": e.error_type,
            "code": e.code,
            "message": e.message,
            "param": e.param,
            "event_id": e.client_event_id,
        }
    }


def _response_created(e: ev.ResponseCreated, wire: WireSession) -> dict[str, Any]:
    return {"response": _response_object(e, wire, status="in_progress", details=None, output=[], usage=None)}


def _response_done(e: ev.ResponseDone, wire: WireSession) -> dict[str, Any]:
    details: dict[str, Any] | None = None
    if e.status != "completed":
        details = {"type": e.status}
        if e.reason in _GA_REASONS:
            details["reason"] = e.reason
        elif e.reason is not None:
            details["duplex_reason"] = e.reason  # e.g. session_closed, engine_error
        if e.status == "failed":
            details["error"] = {"type": "server_error", "code": e.reason or "engine_error"}
    return {
        "response": _response_object(
            e,
            wire,
            status=e.status,
            details=details,
            output=[item_object(i) for i in e.output],
            usage=_usage(e),
        )
    }


def _usage(e: ev.ResponseDone) -> dict[str, Any]:
    """GA usage. Output tokens are the thinker's text tokens (speech is synthesised from them:
    no audio tokens). Input is what the engine says its model read for the response; a
    response the engine never finished (cancelled, failed) has no such report, and its input
    fields are null rather than guessed."""
    out = e.output_tokens
    usage: dict[str, Any] = {
        "total_tokens": None,
        "input_tokens": None,
        "output_tokens": out,
        "input_token_details": None,
        "output_token_details": {"text_tokens": out, "audio_tokens": 0},
    }
    read = e.input_usage
    if read is not None:
        usage["input_tokens"] = read.tokens
        usage["total_tokens"] = read.tokens + out
        usage["input_token_details"] = {
            "text_tokens": read.text_tokens,
            "audio_tokens": read.audio_tokens,
            "image_tokens": 0,
            "cached_tokens": read.cached_tokens,
        }
    return usage


def _part(part_type: str, words: str | None) -> dict[str, str]:
    if part_type == "audio":
        return {"type": "audio", "transcript": words or ""}
    return {"type": "text", "text": words or ""}


def _call_ids(e: fev.FunctionArgumentsDelta | fev.FunctionArgumentsDone) -> dict[str, Any]:
    return {
        "response_id": e.response_id,
        "item_id": e.call.item_id,
        "output_index": e.call.output_index,
        "call_id": e.call.call_id,
    }


def _audio_delta(e: ev.AudioDeltaEvent, wire: WireSession) -> dict[str, Any]:
    fmt = wire.output_format
    data = encode_output(e.pcm, e.sample_rate, fmt)
    body = {**_in_response(e), "delta": base64.b64encode(data).decode("ascii"), "sample_rate": fmt.rate}
    return _with_metrics(body, e.metrics)


_BODIES: dict[type[ev.ServerEvent], Callable[[Any, WireSession], dict[str, Any]]] = {
    ev.SessionCreated: _session_created,
    ev.SessionUpdated: _session_updated,
    ev.SessionResumed: lambda e, w: {
        "generation": e.generation,
        "resume_token": e.resume_token,
        "replayed": e.replayed,
    },
    ev.SessionClosedEvent: lambda e, w: {"reason": e.reason},
    ev.ErrorEvent: _error,
    ev.SpeechStarted: lambda e, w: {"audio_start_ms": e.audio_start_ms, "item_id": e.item_id},
    ev.SpeechStopped: lambda e, w: {"audio_end_ms": e.audio_end_ms, "item_id": e.item_id},
    ev.InputTimeoutTriggered: lambda e, w: {
        "audio_start_ms": e.audio_start_ms,
        "audio_end_ms": e.audio_end_ms,
        "item_id": e.item_id,
    },
    ev.InputCommitted: lambda e, w: {
        "item_id": e.item_id,
        "previous_item_id": e.previous_item_id,
        "audio_ms": e.audio_ms,
    },
    ev.ItemAdded: lambda e, w: {"item": item_object(e.item), "previous_item_id": e.previous_item_id},
    ev.ItemDone: lambda e, w: {"item": item_object(e.item), "previous_item_id": e.previous_item_id},
    ev.ItemRetrieved: lambda e, w: {"item": item_object(e.item)},
    ev.ItemDeleted: lambda e, w: {"item_id": e.item_id},
    ev.ItemTruncated: lambda e, w: {
        "item_id": e.item_id,
        "content_index": e.content_index,
        "audio_end_ms": e.audio_end_ms,
    },
    ev.DecisionEvent: lambda e, w: {"decision": e.decision, "turn_id": e.turn_id},
    ev.StateChanged: lambda e, w: {"from": e.source, "to": e.dest, "trigger": e.trigger},
    ev.ResponseCreated: _response_created,
    ev.OutputItemAdded: lambda e, w: {
        "response_id": e.response_id,
        "output_index": e.output_index,
        "item": item_object(e.item),
    },
    ev.OutputItemDone: lambda e, w: {
        "response_id": e.response_id,
        "output_index": e.output_index,
        "item": item_object(e.item),
    },
    ev.ContentPartAdded: lambda e, w: {**_in_response(e), "part": _part(e.part_type, "")},
    ev.ContentPartDone: lambda e, w: {**_in_response(e), "part": _part(e.part_type, e.text)},
    ev.TextDeltaEvent: lambda e, w: _with_metrics({**_in_response(e), "delta": e.delta}, e.metrics),
    ev.TranscriptDeltaEvent: lambda e, w: _with_metrics({**_in_response(e), "delta": e.delta}, e.metrics),
    ev.AudioDeltaEvent: _audio_delta,
    ev.TextDone: lambda e, w: {**_in_response(e), "text": e.text},
    ev.AudioDone: lambda e, w: _in_response(e),
    ev.TranscriptDone: lambda e, w: {**_in_response(e), "transcript": e.transcript},
    ev.ResponseDone: _response_done,
    # function calls: an output item of their own (before or after the assistant message)
    fev.FunctionCallItemAdded: lambda e, w: {
        "response_id": e.response_id,
        "output_index": e.call.output_index,
        "item": item_object(e.call.to_item("in_progress")),
    },
    fev.FunctionArgumentsDelta: lambda e, w: {**_call_ids(e), "delta": e.delta},
    fev.FunctionArgumentsDone: lambda e, w: {
        **_call_ids(e),
        "name": e.call.name,
        "arguments": e.call.arguments,
    },
    fev.FunctionCallItemDone: lambda e, w: {
        "response_id": e.response_id,
        "output_index": e.call.output_index,
        "item": item_object(e.call.to_item()),
    },
    # input transcription of a committed user item (content part 0 is its audio)
    tev.TranscriptionDelta: lambda e, w: {"item_id": e.item_id, "content_index": 0, "delta": e.delta},
    tev.TranscriptionCompleted: lambda e, w: {
        "item_id": e.item_id,
        "content_index": 0,
        "transcript": e.transcript,
        "usage": {"type": "duration", "seconds": 0},
    },
    tev.TranscriptionFailed: lambda e, w: {
        "item_id": e.item_id,
        "content_index": 0,
        "error": {
            "type": "transcription_error",
            "code": "transcription_failed",
            "message": e.message,
            "param": None,
        },
    },
}


def event_classes() -> list[type[ev.ServerEvent]]:
    """Every concrete session event type (what the codec must be able to encode)."""
    out: list[type[ev.ServerEvent]] = []
    todo: list[type[ev.ServerEvent]] = [ev.ServerEvent]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.TYPE not in ("event",) and cls is not ev.ResponseEvent:
            out.append(cls)
    return out


#: Our events that OpenAI's set does not define (they skip GA schema validation).
EXTENSION_TYPES = frozenset(cls.TYPE for cls in event_classes() if cls.EXTENSION)
