"""The wire's vocabulary: the declared limits, the typed errors a refused frame raises, the
decoded values that are not plain session commands, and the typed field readers the decoder
(:mod:`.wire`) parses every client frame with. Import these names from :mod:`.wire`, which
re-exports them."""

from __future__ import annotations

import builtins
import re
from typing import Any, Literal, Union, overload

import attrs

from ..core import commands as cmd
from ..errors import ClientError, InvalidCommand, UnencodableText
from .audio_format import AudioFormat

# --- declared limits ------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class WireLimits:
    #: Largest text frame we parse. Bigger frames get a ``frame_too_large`` error event; frames
    #: past ``transport_cap`` are refused by the websocket layer itself (close code 1009).
    max_frame_bytes: int = attrs.field(default=1 << 20, validator=attrs.validators.gt(0))
    #: Largest decoded pcm16 payload of one ``input_audio_buffer.append``.
    max_chunk_bytes: int = attrs.field(default=256 << 10, validator=attrs.validators.gt(0))
    #: How deep JSON may nest before we refuse to look at it.
    max_depth: int = 32
    #: At most this many JSON values in one frame, counted before parsing (commas and opening
    #: brackets, strings' own included: an overestimate). Parsing costs per value, not per
    #: byte, and a frame of ``[[],[],...]`` deflates to almost nothing on the wire. Real
    #: frames hold far fewer: an append ~3, 128 tool schemas ~5,000, 64 KB of prose ~2,000.
    max_json_values: int = attrs.field(default=20_000, validator=attrs.validators.gt(0))
    #: Largest ``session.resume`` frame (the first frame of a resuming connection, parsed
    #: before any session or budget exists); a real one is under 1 KB.
    max_resume_frame_bytes: int = attrs.field(default=4096, validator=attrs.validators.gt(0))

    @property
    def transport_cap(self) -> int:
        # Headroom over max_frame_bytes, so an oversized frame is still answered with an error
        # event instead of a dropped connection.
        return self.max_frame_bytes * 4


# --- typed errors ---------------------------------------------------------------------------


class WireError(InvalidCommand):
    """A client frame could not be turned into an event; nothing was changed."""

    code = "invalid_event"


class FrameTooComplex(WireError):
    """A frame holds more JSON values than ``WireLimits.max_json_values``; it is not parsed."""

    code = "frame_too_complex"


class InvalidFrame(WireError):
    code = "invalid_frame"  # binary frame, or text that is not UTF-8


class InvalidJSON(WireError):
    code = "invalid_json"


class FrameTooLarge(WireError):
    code = "frame_too_large"


class UnknownEventType(WireError):
    code = "unknown_event_type"


class InvalidField(WireError):
    """A field is missing or has the wrong type or value; ``param`` names it."""

    code = "invalid_value"

    def __init__(self, param: str, message: str, **kw: str | None) -> None:
        super().__init__(f"{param}: {message}", **kw)
        self.param = param


class InvalidAudio(WireError):
    code = "invalid_audio"  # bad base64, odd byte count, empty chunk


class ChunkTooLarge(WireError):
    code = "chunk_too_large"


class UnsupportedAudioFormat(WireError):
    code = "unsupported_audio_format"


class NotSupported(ClientError):
    """A well-formed OpenAI event this runtime deliberately does not implement."""

    code = "not_supported"


# --- decoded values that are not plain session commands -------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class ResumeRequest:
    """``session.resume``: attach this connection to a detached session."""

    session_id: str
    command: cmd.Resume

    @property
    def event_id(self) -> str | None:
        return self.command.event_id


@attrs.frozen(slots=True, kw_only=True)
class EncodedAudio:
    """An append in the client's declared format, not yet the session's pcm16."""

    data: bytes = attrs.field(repr=lambda b: f"<{len(b)} bytes>")
    format: AudioFormat
    event_id: str | None = None
    epoch: int | None = None


@attrs.frozen(slots=True, kw_only=True)
class TurnDetection:
    """Server VAD settings of a ``session.update`` (OpenAI's ``turn_detection`` object)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    #: After a response's audio has played, this much quiet makes the server respond on its
    #: own (input_audio_buffer.timeout_triggered). None: never.
    idle_timeout_ms: int | None = None
    #: What the client asked for: "server_vad", or "semantic_vad" (its ``eagerness`` is mapped
    #: onto ``silence_duration_ms``; both are echoed back as sent).
    type: str = "server_vad"
    eagerness: str | None = None


#: semantic_vad's eagerness as the silence that ends a turn (ms). The detector here hears
#: silence, not meaning: "low" waits longer for the user to go on, "high" answers sooner;
#: "auto" is OpenAI's "medium", which keeps server_vad's default.
EAGERNESS_SILENCE_MS = {"low": 1000, "medium": 500, "auto": 500, "high": 300}


@attrs.frozen(slots=True, kw_only=True)
class SessionUpdate:
    """``session.update``: the session command, plus what it does to server turn detection."""

    command: cmd.UpdateSession
    #: Set when the update turns server VAD on (with these settings).
    turn_detection: TurnDetection | None = None
    #: True when the update turns server VAD off (``turn_detection: null``).
    vad_off: bool = False
    #: The ``create_response`` / ``interrupt_response`` the client asked for, to echo back.
    create_response: bool = True
    interrupt_response: bool = True
    input_format: AudioFormat | None = None
    output_format: AudioFormat | None = None
    voice: str | None = None
    #: The binary-audio extension turned on (True) or off (False); None: unchanged.
    binary_audio: bool | None = None
    #: The ``session.type`` the update names ("realtime", "transcription"), if it names one:
    #: it must be the session's own (a session's type is chosen when it opens).
    session_type: str | None = None

    @property
    def event_id(self) -> str | None:
        return self.command.event_id


@attrs.frozen(slots=True, kw_only=True)
class AudioItemCreate:
    """``conversation.item.create`` of a user message with ``input_audio``: the command, and
    the audio in the client's declared format (the server converts it to the session's pcm16,
    then hands the command its audio)."""

    command: cmd.CreateItem
    data: bytes = attrs.field(repr=lambda b: f"<{len(b)} bytes>")
    format: AudioFormat

    @property
    def event_id(self) -> str | None:
        return self.command.event_id


ClientEvent = Union[cmd.Command, ResumeRequest, EncodedAudio, SessionUpdate, AudioItemCreate]

#: Whether this runtime's UpdateSession knows the ``server_vad`` switch.
_HAS_SERVER_VAD = "server_vad" in attrs.fields_dict(cmd.UpdateSession)


# --- field readers --------------------------------------------------------------------------

_MISSING = object()


class _Fields:
    """Typed access to one JSON object, raising InvalidField with the dotted param name."""

    __slots__ = ("obj", "prefix", "event_id")

    def __init__(self, obj: dict[str, Any], prefix: str, event_id: str | None) -> None:
        self.obj = obj
        self.prefix = prefix
        self.event_id = event_id

    def _name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def fail(self, key: str, message: str) -> InvalidField:
        return InvalidField(self._name(key), message, event_id=self.event_id)

    def has(self, key: str) -> bool:
        return key in self.obj

    # The readers are named after the JSON types they read, so within the class the builtins
    # are spelled builtins.str, builtins.int and builtins.bool. required=True never gives None.

    @overload
    def str(
        self, key: builtins.str, *, required: Literal[True], max_len: builtins.int = ...
    ) -> builtins.str: ...
    @overload
    def str(
        self, key: builtins.str, *, required: builtins.bool = ..., max_len: builtins.int = ...
    ) -> builtins.str | None: ...
    def str(
        self, key: builtins.str, *, required: builtins.bool = False, max_len: builtins.int = 1 << 16
    ) -> builtins.str | None:
        value = self.obj.get(key, _MISSING)
        if value is _MISSING or (value is None and not required):
            if required:
                raise self.fail(key, "is required")
            return None
        if not isinstance(value, str):
            raise self.fail(key, f"must be a string, not {_json_type(value)}")
        if len(value) > max_len:
            raise self.fail(key, f"is longer than {max_len} characters")
        return value

    @overload
    def int(
        self,
        key: builtins.str,
        *,
        required: Literal[True],
        minimum: builtins.int | None = ...,
        maximum: builtins.int | None = ...,
    ) -> builtins.int: ...
    @overload
    def int(
        self,
        key: builtins.str,
        *,
        required: builtins.bool = ...,
        minimum: builtins.int | None = ...,
        maximum: builtins.int | None = ...,
    ) -> builtins.int | None: ...
    def int(
        self,
        key: builtins.str,
        *,
        required: builtins.bool = False,
        minimum: builtins.int | None = 0,
        maximum: builtins.int | None = None,
    ) -> builtins.int | None:
        value = self.obj.get(key, _MISSING)
        if value is _MISSING or (value is None and not required):
            if required:
                raise self.fail(key, "is required")
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be an integer, not {_json_type(value)}")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be >= {minimum}")
        if maximum is not None and value > maximum:
            raise self.fail(key, f"must be <= {maximum}")
        return value

    def number(
        self, key: builtins.str, *, minimum: float | None = None, maximum: float | None = None
    ) -> float | None:
        value = self.obj.get(key, _MISSING)
        if value is _MISSING or value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise self.fail(key, f"must be a number, not {_json_type(value)}")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be >= {minimum}")
        if maximum is not None and value > maximum:
            raise self.fail(key, f"must be <= {maximum}")
        return float(value)

    def bool(self, key: builtins.str) -> builtins.bool | None:
        value = self.obj.get(key, _MISSING)
        if value is _MISSING or value is None:
            return None
        if not isinstance(value, bool):
            raise self.fail(key, f"must be a boolean, not {_json_type(value)}")
        return value

    @overload
    def object(self, key: builtins.str, *, required: Literal[True]) -> _Fields: ...
    @overload
    def object(self, key: builtins.str, *, required: builtins.bool = ...) -> _Fields | None: ...
    def object(self, key: builtins.str, *, required: builtins.bool = False) -> _Fields | None:
        value = self.obj.get(key, _MISSING)
        if value is _MISSING or (value is None and not required):
            if required:
                raise self.fail(key, "is required")
            return None
        if not isinstance(value, dict):
            raise self.fail(key, f"must be an object, not {_json_type(value)}")
        return _Fields(value, self._name(key) + ".", self.event_id)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _depth_ok(value: Any, limit: int) -> bool:
    if limit >= 2 and type(value) is dict:
        # One flat object, what nearly every frame is (every append): its values are the
        # second level, and nothing is under them.
        for item in value.values():
            if isinstance(item, (dict, list)):
                break
        else:
            return True
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return True


_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_unencodable(value: Any) -> None:
    """Refuse a frame whose strings (keys included) hold a lone surrogate: it would reach the
    session and its replay journal, and fail later when an event echoing it is encoded."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise UnencodableText(
                    "a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                    "which is not valid Unicode text"
                )
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
