"""Compound values of client frames: conversation items and their content, function tools and
tool choice, and input transcription settings, read with the field readers of
:mod:`.wire_types`. The decoder (:mod:`.wire`) calls these from the parsers of
``conversation.item.create``, ``response.create`` and ``session.update``."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from ..core.conversation import CREATABLE_ROLES, ContentPart, Item
from ..core.engine_io import FunctionTool
from .wire_types import InvalidAudio, NotSupported, _Fields, _json_type

#: Content parts an item may have. A message has a few (text, audio, an image); an item of
#: thousands of parts that hold no text (images, whose pictures are not kept, or empty texts)
#: took ~0.7 MiB of a session's memory from a frame that deflates to a kilobyte.
MAX_CONTENT_PARTS = 64


def _content_text(
    item: _Fields,
    allowed: tuple[str, ...],
    as_type: str = "input_text",
    images: bool = False,
    audio: list[bytes] | None = None,
) -> tuple[ContentPart, ...]:
    content = item.obj.get("content")
    if not isinstance(content, list) or not content:
        raise item.fail("content", "must be a non-empty list of content parts")
    if len(content) > MAX_CONTENT_PARTS:
        raise item.fail("content", f"has more than {MAX_CONTENT_PARTS} parts")
    parts = []
    for i, raw in enumerate(content):
        if not isinstance(raw, dict):
            raise item.fail(f"content[{i}]", "must be an object")
        part = _Fields(raw, f"{item.prefix}content[{i}].", item.event_id)
        kind = part.str("type", required=True)
        if kind == "input_image" and images:
            # Valid GA input (a user's camera frame or picture) that no engine here can see.
            # It was refused, and the refusal ended the session for pipecat, which treats any
            # error as fatal: one video frame killed the call. The part is kept as a marker,
            # without its image (which would fill the conversation's budget), and is not read.
            part.str("image_url", max_len=1 << 30)  # a string if given (the frame bounds it)
            parts.append(ContentPart(type="input_image"))
            continue
        if kind == "input_audio" and audio is not None:
            # A user's recorded turn (GA): base64 in the session's declared input format, its
            # transcript optional. The bytes go to the caller (the server converts them).
            data = part.str("audio", max_len=1 << 30)
            if not data and not part.str("transcript"):
                raise part.fail(
                    "audio", "is required (base64, in the session's input format) unless a transcript is"
                )
            if data:
                try:
                    audio.append(base64.b64decode(data, validate=True))
                except (binascii.Error, ValueError):
                    raise InvalidAudio("audio is not valid base64", param=f"{part.prefix}audio") from None
            parts.append(ContentPart(type="input_audio", transcript=part.str("transcript")))
            continue
        if kind not in allowed:
            raise part.fail("type", f"{kind!r} is not supported here; use {' or '.join(allowed)}")
        parts.append(ContentPart(type=as_type, text=part.str("text", required=True)))
    return tuple(parts)


def _item_value(item: _Fields, audio: list[bytes] | None = None) -> Item:
    """An item a client writes (conversation.item.create, or a response's own input)."""
    kind = item.str("type", required=True)
    item_id = item.str("id", max_len=256) or ""
    if kind == "message":
        role = item.str("role", required=True)
        if role not in CREATABLE_ROLES:
            raise item.fail("role", f"must be one of {', '.join(CREATABLE_ROLES)}")
        if role == "assistant":  # replayed history: text only (audio is never kept)
            parts = _content_text(item, ("output_text", "text"), as_type="output_text")
        else:
            if role == "user":
                parts = _content_text(item, ("input_text",), images=True, audio=audio)
            else:
                parts = _content_text(item, ("input_text", "text"))
        value = Item(id=item_id, role=role, content=parts)
    elif kind == "function_call_output":
        value = Item(
            id=item_id,
            type=kind,
            call_id=item.str("call_id", required=True, max_len=256),
            output=item.str("output", required=True),
        )
    elif kind == "function_call":
        # The assistant's call, replayed by a client that syncs its history (livekit sends the
        # calls of its chat context). GA requires name and arguments; without a call_id the
        # session gives it one, so an output can still answer it.
        value = Item(
            id=item_id,
            type=kind,
            call_id=item.str("call_id", max_len=256) or None,
            name=item.str("name", required=True, max_len=256),
            arguments=item.str("arguments", required=True),
        )
    else:
        raise NotSupported(
            f"{item.prefix}type {kind!r} is not supported; create message, function_call "
            "or function_call_output items",
            param=f"{item.prefix}type",
        )
    return value


_MAX_TOOLS = 128


def _tool_fields(s: _Fields) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` (of a response.create's response) as command fields: only
    those given."""
    tools = _tools_field(s)
    return {**tools, **_tool_choice_field(s, tuple(t.name for t in tools.get("tools") or ()))}


def _tools_field(s: _Fields) -> dict[str, Any]:
    """``tools`` as a command field, if given."""
    changes: dict[str, Any] = {}
    if s.has("tools") and s.obj["tools"] is not None:
        tools = s.obj["tools"]
        if not isinstance(tools, list):
            raise s.fail("tools", f"must be an array, not {_json_type(tools)}")
        if len(tools) > _MAX_TOOLS:
            raise s.fail("tools", f"has more than {_MAX_TOOLS} entries")
        parsed = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise s.fail(f"tools[{i}]", f"must be an object, not {_json_type(tool)}")
            t = _Fields(tool, f"{s.prefix}tools[{i}].", s.event_id)
            kind = t.str("type") or "function"
            if kind != "function":
                raise NotSupported(f"tool type {kind!r} is not supported; only function tools are")
            parameters = tool.get("parameters", {})
            if not isinstance(parameters, dict):
                raise t.fail("parameters", f"must be an object, not {_json_type(parameters)}")
            parsed.append(
                FunctionTool(
                    name=t.str("name", required=True, max_len=256),
                    description=t.str("description") or "",
                    parameters=json.dumps(parameters, separators=(",", ":")),
                )
            )
        changes["tools"] = tuple(parsed)
    return changes


def _tool_choice_field(s: _Fields, named: tuple[str, ...] = ()) -> dict[str, Any]:
    """``tool_choice`` as a command field, if given. A bare string in ``named`` (the tools
    given next to it) is read as that function."""
    changes: dict[str, Any] = {}
    choice = s.obj.get("tool_choice")
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required") and choice not in named:
            raise s.fail("tool_choice", f"must be 'auto', 'none', 'required' or a function, not {choice!r}")
        changes["tool_choice"] = choice
    elif isinstance(choice, dict):
        tool = s.object("tool_choice", required=True)
        changes["tool_choice"] = tool.str("name", required=True, max_len=256)
    elif choice is not None:
        raise s.fail("tool_choice", f"must be a string or an object, not {_json_type(choice)}")
    return changes


#: The model name a transcription the client turned on without naming one echoes (the runtime's
#: recogniser does the work, whatever the name).
DEFAULT_TRANSCRIPTION_MODEL = "pocketsphinx"


def _session_transcription(s: _Fields, in_fields: _Fields | None) -> dict[str, Any]:
    """Input transcription: GA ``audio.input.transcription`` or beta ``input_audio_transcription``
    (``{"model": ..., "language", "prompt"}``, or null to turn it off)."""
    holders = [
        (h, k)
        for h, k in ((in_fields, "transcription"), (s, "input_audio_transcription"))
        if h is not None and h.has(k)
    ]
    if not holders:
        return {}
    holder, key = holders[0]
    if holder.obj[key] is None:
        return {"transcription": False}
    settings = holder.object(key, required=True)  # present, and not null (above)
    # A language the recogniser cannot hear fails each turn's transcription (...failed), never
    # the session: pipecat treats an error here as fatal (runtime.transcribe decides).
    language = settings.str("language", max_len=32)
    settings.str("prompt")  # type-checked; the recogniser takes no prompt
    return {
        "transcription": settings.str("model", max_len=256) or DEFAULT_TRANSCRIPTION_MODEL,
        "transcription_language": language or None,
    }
