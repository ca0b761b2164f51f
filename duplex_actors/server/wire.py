"""The wire codec: one client JSON frame in, one typed client event out (or a typed error).

Theory of operation
-------------------
Clients speak the OpenAI Realtime vocabulary (GA names) plus our ``duplex`` extensions. This
module owns the *shape* of those frames and nothing else: it knows the declared limits, the
field types and the mapping onto :mod:`duplex_actors.core.commands`. It never touches a
socket, a session or a clock, so every rule here is tested without a server.

:func:`decode` either returns a value whose type says what to do with it:

* a :class:`~duplex_actors.core.commands.Command`: hand it to the session (``tell``);
* :class:`ResumeRequest`: take over a detached session (the server does the lookup);
* :class:`SessionUpdate`: ``session.update``, whose wire settings (audio formats, voice, turn
  detection) the server keeps and whose session settings go to the session as a command;
* :class:`EncodedAudio`: an append in a format other than the session's own pcm16, for the
  server to convert (:mod:`.audio_format`) before the session sees it;

or raises a :class:`WireError` subclass carrying a stable ``code`` and, whenever the frame let
us read one, the client's ``event_id``. A refused frame changes nothing anywhere.

Server events are encoded by :mod:`.codec`; :func:`encode` serialises the result.
"""

from __future__ import annotations

import base64
import binascii
import builtins
import json
import re
import secrets
from collections.abc import Callable
from typing import Any, Literal, Union, overload

import attrs

from ..core import commands as cmd
from ..core.conversation import CREATABLE_ROLES, ContentPart, Item
from ..core.engine_io import SAMPLING_RANGES, SPEED_RANGE, FunctionTool, SamplingOverrides
from ..errors import (
    ClientError,
    DuplexError,
    InvalidCommand,
    InvalidSampling,
    ItemNotFound,  # noqa: F401  (was defined here; kept importable)
    UnencodableText,
)
from .audio_format import G711_RATE, LEGACY_NAMES, PCM, PCM_RATES, PCMA, PCMU, AudioFormat

_b64decode: Callable[..., bytes]  # pybase64's or the standard library's b64decode
try:  # an optional accelerator (extra 'fast'): the same checks as the standard library's
    # b64decode(validate=True), ~7x faster on a 20 ms append (8.5 -> 1.2 us, 2026-12-03)
    from pybase64 import b64decode as _b64decode
except ImportError:  # both paths: tests/server/test_wire_accelerators.py
    from base64 import b64decode as _b64decode

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
    #: byte: 1 MB of ``[[],[],...]`` took 0.4 s of the event loop, and deflates to ~1 KB. Real
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

    def __init__(self, param: str, message: str, **kw) -> None:
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

    def __init__(self, obj: dict, prefix: str, event_id: str | None) -> None:
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


# --- the decoder ----------------------------------------------------------------------------


def decode(
    frame: str | bytes,
    limits: WireLimits = WireLimits(),
    *,
    sample_rate: int = 16000,
    input_format: AudioFormat | None = None,
    binary_audio: bool = False,
) -> ClientEvent:
    """Parse one client frame. ``sample_rate`` is the session's own pcm16 rate; ``input_format``
    what the client declared it sends (None: that same pcm16). ``binary_audio``: the session
    turned the binary-audio extension on, so a binary frame is an append of raw audio."""
    if isinstance(frame, (bytes, bytearray, memoryview)):
        if not binary_audio:
            raise InvalidFrame(
                "binary frames are not accepted; send JSON text frames (or turn on the "
                "binary-audio extension: session.update duplex.binary_audio)"
            )
        return _binary_append(
            bytes(frame), limits, sample_rate, input_format or AudioFormat(PCM, sample_rate)
        )
    size = len(frame) if frame.isascii() else len(frame.encode("utf-8", "surrogatepass"))
    if size > limits.max_frame_bytes:
        raise FrameTooLarge(f"frame is larger than max_frame_bytes={limits.max_frame_bytes}")
    # C-speed counts, before any Python walks the frame (see WireLimits.max_json_values). The
    # count cannot pass the frame's length, so only a longer frame is counted: an append (1-6
    # KB of base64) skips three scans of itself (a 20 ms append's decode: ~11.5 -> ~10.9 us).
    brackets = None
    if len(frame) > limits.max_json_values:
        brackets = frame.count("[") + frame.count("{")
        if brackets + frame.count(",") > limits.max_json_values:
            raise FrameTooComplex(
                f"frame holds more than max_json_values={limits.max_json_values} JSON values"
            )
    try:
        obj = json.loads(frame)
    except RecursionError:
        raise InvalidJSON(f"JSON nests deeper than {limits.max_depth} levels") from None
    except ValueError as exc:
        raise InvalidJSON(f"frame is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise InvalidJSON(f"an event must be a JSON object, not {_json_type(obj)}")
    if "\\u" in frame:  # only a \uXXXX escape can smuggle a lone surrogate past UTF-8 decoding
        try:
            _refuse_unencodable(obj)
        except UnencodableText as err:
            echo = obj.get("event_id")
            if isinstance(echo, str) and len(echo) <= 512 and not _SURROGATE.search(echo):
                err.with_event_id(echo)
            raise
    event_id = obj.get("event_id")
    if event_id is not None and not isinstance(event_id, str):
        raise InvalidField("event_id", f"must be a string, not {_json_type(event_id)}")
    if event_id is not None and len(event_id) > 512:
        raise InvalidField("event_id", "is longer than 512 characters")
    # Nesting cannot pass the number of brackets: where they were counted, the walk runs only
    # when they could nest that deep.
    if (brackets is None or brackets > limits.max_depth) and not _depth_ok(obj, limits.max_depth):
        raise InvalidJSON(f"JSON nests deeper than {limits.max_depth} levels", event_id=event_id)
    fields = _Fields(obj, "", event_id)
    event_type = obj.get("type")
    if not isinstance(event_type, str):
        raise fields.fail("type", "is required" if event_type is None else "must be a string")
    parser = _PARSERS.get(event_type)
    if parser is None:
        shown = event_type if len(event_type) <= 64 else event_type[:64] + "..."
        raise UnknownEventType(f"unknown event type {shown!r}", event_id=event_id)
    epoch = fields.int("epoch")
    declared = input_format or AudioFormat(PCM, sample_rate)
    try:
        return parser(fields, event_id, epoch, limits, (sample_rate, declared))
    except DuplexError as err:
        raise err.with_event_id(event_id) from None
    except (TypeError, ValueError) as exc:  # an attrs validator of the command itself
        raise WireError(f"invalid {event_type}: {exc}", event_id=event_id) from None


_Parser = Callable[[_Fields, "str | None", "int | None", WireLimits, "tuple[int, AudioFormat]"], ClientEvent]
_PARSERS: dict[str, _Parser] = {}


def _parser(*names: str):
    def register(fn: _Parser) -> _Parser:
        for name in names:
            _PARSERS[name] = fn
        return fn

    return register


def accepted_types() -> tuple[str, ...]:
    """Every client event type the decoder knows (including those answered ``not_supported``)."""
    return tuple(sorted(_PARSERS))


@_parser("input_audio_buffer.append")
def _append(f: _Fields, event_id, epoch, limits: WireLimits, rates):
    sample_rate, declared = rates
    audio = f.obj.get("audio", _MISSING)
    if audio is _MISSING or audio is None:
        raise f.fail("audio", "is required (base64 pcm16)")
    if not isinstance(audio, str):
        raise f.fail("audio", f"must be a base64 string, not {_json_type(audio)}")
    # Check the size before decoding, so a huge chunk costs no allocation.
    if len(audio) // 4 * 3 > limits.max_chunk_bytes + 3:
        raise ChunkTooLarge(f"audio chunk is larger than max_chunk_bytes={limits.max_chunk_bytes}")
    try:
        pcm = _b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidAudio("audio is not valid base64") from None
    _check_chunk(pcm, limits, declared)
    rate = f.int("sample_rate", minimum=1)  # extension: the chunk names its rate
    if rate is not None and rate != declared.rate:
        raise InvalidCommand(
            f"audio is {rate} Hz; this session takes {declared.type} at "
            f"{declared.rate} Hz (declare another format with session.update)"
        )
    return _append_of(pcm, sample_rate, declared, event_id, epoch)


def _binary_append(pcm: bytes, limits: WireLimits, sample_rate: int, declared: AudioFormat) -> ClientEvent:
    """A binary frame under the binary-audio extension: the bytes of an
    ``input_audio_buffer.append``'s audio, in the declared input format, with the same checks
    (no event_id or epoch: a binary frame has no fields)."""
    _check_chunk(pcm, limits, declared)
    return _append_of(pcm, sample_rate, declared, None, None)


def _check_chunk(pcm: bytes, limits: WireLimits, declared: AudioFormat) -> None:
    """An append's decoded audio: within max_chunk_bytes, not empty, whole pcm16 samples."""
    if len(pcm) > limits.max_chunk_bytes:
        raise ChunkTooLarge(f"audio chunk is larger than max_chunk_bytes={limits.max_chunk_bytes}")
    if not pcm:
        raise InvalidAudio("audio chunk is empty")
    if declared.type == PCM and len(pcm) % 2:
        raise InvalidAudio("pcm16 audio must have an even number of bytes")


def _append_of(
    pcm: bytes, sample_rate: int, declared: AudioFormat, event_id: str | None, epoch: int | None
) -> ClientEvent:
    """The session's own pcm16 at its rate goes straight in; anything else is converted first."""
    if declared.type == PCM and declared.rate == sample_rate:
        return cmd.AppendAudio(pcm=pcm, sample_rate=sample_rate, event_id=event_id, epoch=epoch)
    return EncodedAudio(data=pcm, format=declared, event_id=event_id, epoch=epoch)


_MODALITIES = {("audio",): ("audio",), ("text",): ("text",), ("audio", "text"): ("text", "audio")}


def _modalities(f: _Fields, key: str) -> tuple[str, ...] | None:
    value = f.obj.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise f.fail(key, "must be a list of strings")
    chosen = _MODALITIES.get(tuple(sorted(set(value))))
    if chosen is None:
        raise f.fail(key, 'must be ["audio"] or ["text"]')
    return chosen


@_parser("response.create")
def _response_create(f: _Fields, event_id, epoch, limits, rates):
    response = f.object("response")
    instructions = modalities = metadata = None
    options: dict[str, Any] = {}
    context: dict[str, Any] = {}
    if response is not None:
        instructions = response.str("instructions")
        conversation = response.str("conversation")
        if conversation not in (None, "auto", "none"):
            raise NotSupported(
                f"response.conversation {conversation[:64]!r}: this server has one conversation "
                "per session; use 'auto' or 'none' (out of band)",
                param="response.conversation",
            )
        context = {"out_of_band": conversation == "none", "input": _response_input(response)}
        modalities = _modalities(response, "output_modalities")
        meta = response.object("metadata")
        if meta is not None:
            # OpenAI's limits: at most 16 pairs, keys <= 64 and values <= 512 characters; a bad
            # value is named by its key (param response.metadata.<key>).
            if len(meta.obj) > 16:
                raise response.fail("metadata", "has more than 16 keys")
            for key in meta.obj:
                if len(key) > 64:
                    raise response.fail("metadata", f"key {key[:64]!r}... is longer than 64 characters")
                meta.str(key, required=True, max_len=512)
            metadata = dict(meta.obj)
        # This reply's own tools and tool_choice (livekit's generate_reply passes them), and
        # token limit: read as session.update reads them, errors named under response.
        options = _tool_fields(response)
        if response.obj.get("max_output_tokens") == "inf":
            options["max_tokens"] = 0  # no limit for this response, whatever the session's
        else:
            options["max_tokens"] = response.int(
                "max_output_tokens", minimum=1, maximum=int(SAMPLING_RANGES["max_tokens"][1])
            )
    return cmd.CreateResponse(
        instructions=instructions,
        modalities=modalities,
        metadata=metadata,
        event_id=event_id,
        epoch=epoch,
        **options,
        **context,
    )


#: Items a response's own context may hold (GA ``response.input``).
MAX_RESPONSE_INPUT = 64


def _response_input(response: _Fields) -> tuple[Item | str, ...] | None:
    """GA ``response.input``: items written here, or ``item_reference``s to the conversation's."""
    raw = response.obj.get("input")
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise response.fail("input", "must be a list of items")
    if len(raw) > MAX_RESPONSE_INPUT:
        raise response.fail("input", f"has more than {MAX_RESPONSE_INPUT} items")
    entries: list[Item | str] = []
    for i, value in enumerate(raw):
        if not isinstance(value, dict):
            raise response.fail(f"input[{i}]", "must be an object")
        entry = _Fields(value, f"{response.prefix}input[{i}].", response.event_id)
        if entry.str("type") == "item_reference":
            entries.append(entry.str("id", required=True, max_len=256) or "")
        else:
            entries.append(_item_value(entry))
    return tuple(entries)


@_parser("response.cancel")
def _response_cancel(f: _Fields, event_id, epoch, limits, rates):
    # Without response_id the active response is cancelled; with one, it must be the active one.
    return cmd.CancelResponse(response_id=f.str("response_id", max_len=256), event_id=event_id, epoch=epoch)


def _format(holder: _Fields, key: str, sample_rate: int) -> AudioFormat | None:
    fmt = holder.object(key)
    if fmt is None:
        return None
    kind = fmt.str("type") or PCM
    if kind not in (PCM, PCMU, PCMA):
        raise UnsupportedAudioFormat(
            f"{fmt.prefix}type: {kind!r} is not supported; use audio/pcm, audio/pcmu or audio/pcma",
            param=f"{fmt.prefix}type",
        )
    rate = fmt.int("rate", minimum=1)
    if kind == PCM:
        if rate is not None and rate not in PCM_RATES:
            raise UnsupportedAudioFormat(
                f"{fmt.prefix}rate: {rate} Hz is not supported; audio/pcm "
                "is 24000 Hz (16000 Hz as an extension)",
                param=f"{fmt.prefix}rate",
            )
        return AudioFormat(PCM, rate or 24000)
    if rate not in (None, G711_RATE):
        raise UnsupportedAudioFormat(f"{fmt.prefix}rate: {kind} is always 8000 Hz", param=f"{fmt.prefix}rate")
    return AudioFormat(kind, G711_RATE)


def _legacy_format(s: _Fields, key: str) -> AudioFormat | None:
    name = s.str(key)
    if name is None:
        return None
    if name not in LEGACY_NAMES:
        raise UnsupportedAudioFormat(
            f"{key}: {name!r} is not supported; use pcm16, g711_ulaw or g711_alaw", param=key
        )
    return AudioFormat.of(LEGACY_NAMES[name])


@_parser("session.update")
def _session_update(f: _Fields, event_id, epoch, limits, rates):
    sample_rate, _ = rates
    s = f.object("session", required=True)
    kind = s.obj.get("type")
    if kind not in (None, "realtime"):
        raise NotSupported(f"session.type {kind!r} is not supported; this server runs realtime sessions")
    changes: dict[str, Any] = {}
    found: dict[str, Any] = {}
    # All or nothing, as OpenAI applies it: every field is read (and checked) before anything
    # is applied, and the first refused one raises, naming its param; nothing of the update
    # reaches the session (decode's caller reports the one error, no session.updated).
    audio = s.object("audio")
    in_fields = audio.object("input") if audio is not None else None
    out_fields = audio.object("output") if audio is not None else None

    def turn_detection():
        # GA nests it under audio.input, the beta API had it at the top level.
        holders = [h for h in (in_fields, s) if h is not None and h.has("turn_detection")]
        if not holders:
            return
        td = holders[0].obj["turn_detection"]
        if td is None:
            changes["auto_respond"] = False
            changes["idle_timeout_ms"] = 0
            changes["interrupt_response"] = True  # a client's own speech signals may interrupt
            found["vad_off"] = True
            if _HAS_SERVER_VAD:
                changes["server_vad"] = False
            return
        td_fields = holders[0].object("turn_detection")
        kind = td_fields.str("type", required=True)
        if kind not in ("server_vad", "semantic_vad"):
            raise td_fields.fail("type", f"must be 'server_vad' or 'semantic_vad', not {kind!r}")
        create = td_fields.bool("create_response")
        interrupt = td_fields.bool("interrupt_response")
        threshold = td_fields.number("threshold")
        if threshold is not None and not 0.0 < threshold < 1.0:
            raise td_fields.fail("threshold", "must be between 0 and 1")
        eagerness = td_fields.str("eagerness", max_len=16)
        if eagerness is not None and eagerness not in EAGERNESS_SILENCE_MS:
            raise td_fields.fail("eagerness", f"must be 'low', 'medium', 'high' or 'auto', not {eagerness!r}")
        silence = td_fields.int("silence_duration_ms", minimum=1, maximum=60_000)
        if kind == "semantic_vad" and silence is None:
            silence = EAGERNESS_SILENCE_MS[eagerness or "auto"]
        settings = {
            "type": kind,
            # Only semantic_vad has an eagerness (GA); server_vad's is not echoed.
            "eagerness": (eagerness or "auto") if kind == "semantic_vad" else None,
            "threshold": threshold,
            "prefix_padding_ms": td_fields.int("prefix_padding_ms", maximum=10_000),
            "silence_duration_ms": silence,
            # At least a second: each timeout makes a response nobody asked for, and a client
            # must not turn that into a stream of them. At most an hour (a client that sends
            # nothing meanwhile has its session closed by idle_ttl_s, 300 s, long before).
            "idle_timeout_ms": td_fields.int("idle_timeout_ms", minimum=1_000, maximum=3_600_000),
        }
        detection = TurnDetection(**{k: v for k, v in settings.items() if v is not None})
        found["turn_detection"] = detection
        # Each turn_detection object replaces the last whole: what it leaves out is the default.
        changes["speech_prefix_ms"] = detection.prefix_padding_ms
        changes["idle_timeout_ms"] = detection.idle_timeout_ms or 0
        found["create_response"] = True if create is None else create
        found["interrupt_response"] = True if interrupt is None else interrupt
        changes["auto_respond"] = found["create_response"]
        changes["interrupt_response"] = found["interrupt_response"]
        if _HAS_SERVER_VAD:
            changes["server_vad"] = True

    def input_format():
        fmt = _format(in_fields, "format", sample_rate) if in_fields is not None else None
        fmt = fmt or _legacy_format(s, "input_audio_format")
        if fmt is not None:
            found["input_format"] = fmt

    def output_format():
        fmt = _format(out_fields, "format", sample_rate) if out_fields is not None else None
        fmt = fmt or _legacy_format(s, "output_audio_format")
        if fmt is not None:
            found["output_format"] = fmt

    def voice():
        holder = out_fields if out_fields is not None and out_fields.has("voice") else s
        value = holder.obj.get("voice")
        if isinstance(value, dict):  # GA: a custom voice by id
            value = holder.object("voice").str("id", required=True)
        elif value is not None:
            value = holder.str("voice", max_len=128)
        if value is not None:
            found["voice"] = value

    def speed():
        # GA audio.output.speed; the beta API had it at the top level.
        holder = out_fields if out_fields is not None and out_fields.has("speed") else s
        value = holder.number("speed", minimum=SPEED_RANGE[0], maximum=SPEED_RANGE[1])
        if value is not None:
            changes["output_speed"] = value

    def instructions():
        value = s.str("instructions")
        if value is not None:
            changes["instructions"] = value

    def modalities():
        value = _modalities(s, "output_modalities") or _modalities(s, "modalities")
        if value is not None:
            changes["modalities"] = value

    # knob -> (value, the dotted param it came from), range-checked knob by knob below.
    sampling: dict[str, tuple[Any, str]] = {}

    def temperature():
        value = s.number("temperature", minimum=0.0)
        if value is not None:
            sampling["temperature"] = (value, s._name("temperature"))

    def max_tokens():
        for key in ("max_output_tokens", "max_response_output_tokens"):
            if s.has(key) and s.obj[key] == "inf":
                # No limit: the session's earlier one goes (it was kept, and echoed).
                changes["reset_sampling"] = ("max_tokens",)
                continue
            limit = s.int(key, minimum=1)
            if limit is not None:
                sampling["max_tokens"] = (limit, s._name(key))

    def duplex():
        # Our extension block: {"duplex": {"model_native", "min_interruption_ms", "sampling"}}.
        block = s.object("duplex")
        if block is None:
            return
        native = block.bool("model_native")
        if native is not None:
            changes["model_native"] = native
        state_events = block.bool("state_events")
        if state_events is not None:
            changes["state_events"] = state_events
        binary_audio = block.bool("binary_audio")
        if binary_audio is not None:
            found["binary_audio"] = binary_audio
        min_ms = block.int("min_interruption_ms", minimum=0, maximum=60_000)
        if min_ms is not None:
            changes["min_interruption_ms"] = min_ms
        for key in ("auto_respond", "respond_on_commit"):
            value = block.bool(key)
            if value is not None:
                changes[key] = value
        sp = block.object("sampling")
        if sp is not None:
            for key in ("temperature", "top_p"):
                value = sp.number(key, minimum=0.0)
                if value is not None:
                    sampling[key] = (value, sp._name(key))
            for key, minimum in (("top_k", 0), ("max_tokens", 1), ("seed", None)):
                value = sp.int(key, minimum=minimum)
                if value is not None:
                    sampling[key] = (value, sp._name(key))

    def tools():
        changes.update(_tools_field(s))

    def tool_choice():
        # openai-agents lets a user set tool_choice to a bare tool name: one the same update
        # declares is read as that function (refusing it would refuse the agent's whole setup).
        named = tuple(t.name for t in changes.get("tools") or ())
        changes.update(_tool_choice_field(s, named))

    def transcription():
        changes.update(_session_transcription(s, in_fields))

    for reader in (
        turn_detection,
        input_format,
        output_format,
        voice,
        speed,
        instructions,
        modalities,
        temperature,
        max_tokens,
        duplex,
        tools,
        tool_choice,
        transcription,
    ):
        reader()

    # Each knob is range-checked on its own, so the error names its dotted param: one out of
    # range (a seed past 64 bits would fail an engine batch and its neighbours) refuses the
    # update before anything of it reaches the session.
    for key, (value, param) in sampling.items():
        try:
            SamplingOverrides(**{key: value})
        except InvalidSampling as err:
            reason = err.message.split(": ", 1)[-1]
            raise InvalidSampling(param, reason, event_id=event_id) from None
    if sampling:
        changes["sampling"] = SamplingOverrides(**{k: v for k, (v, _) in sampling.items()})
    return SessionUpdate(command=cmd.UpdateSession(event_id=event_id, epoch=epoch, **changes), **found)


# --- conversation items -----------------------------------------------------------------------


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


@_parser("conversation.item.create")
def _item_create(f: _Fields, event_id, epoch, limits, rates):
    audio: list[bytes] = []
    value = _item_value(f.object("item", required=True), audio)
    previous = f.str("previous_item_id", max_len=256)
    command = cmd.CreateItem(item=value, previous_item_id=previous, event_id=event_id, epoch=epoch)
    if not audio:
        return command
    declared = rates[1]
    data = b"".join(audio)
    if declared.type == PCM and len(data) % 2:
        raise InvalidAudio("pcm16 audio must have an even number of bytes")
    return AudioItemCreate(command=command, data=data, format=declared)


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


@_parser("conversation.item.delete")
def _item_delete(f: _Fields, event_id, epoch, limits, rates):
    return cmd.DeleteItem(
        item_id=f.str("item_id", required=True, max_len=256), event_id=event_id, epoch=epoch
    )


@_parser("conversation.item.retrieve")
def _item_retrieve(f: _Fields, event_id, epoch, limits, rates):
    return cmd.RetrieveItem(
        item_id=f.str("item_id", required=True, max_len=256), event_id=event_id, epoch=epoch
    )


# --- function tools -----------------------------------------------------------------------

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
        "transcription": settings.str("model", max_len=256) or "pocketsphinx",
        "transcription_language": language or None,
    }


@_parser("conversation.item.truncate")
def _item_truncate(f: _Fields, event_id, epoch, limits, rates):
    return cmd.TruncateItem(
        item_id=f.str("item_id", required=True, max_len=256),
        content_index=f.int("content_index", required=True),
        audio_end_ms=f.int("audio_end_ms", required=True),
        event_id=event_id,
        epoch=epoch,
    )


@_parser("output_audio_buffer.clear", "transcription_session.update")
def _not_supported(f: _Fields, event_id, epoch, limits, rates):
    raise NotSupported(f"{f.obj['type']} is not supported by this server")


# --- duplex extensions ----------------------------------------------------------------------


@_parser("duplex.playback_ack")
def _playback_ack(f: _Fields, event_id, epoch, limits, rates):
    return cmd.PlaybackAck(
        response_id=f.str("response_id", required=True, max_len=256),
        played_ms=f.int("played_ms", required=True),
        event_id=event_id,
        epoch=epoch,
    )


@_parser("session.resume")
def _session_resume(f: _Fields, event_id, epoch, limits, rates):
    command = cmd.Resume(
        generation=f.int("generation", required=True),
        resume_token=f.str("resume_token", required=True, max_len=256),
        last_seq=f.int("last_seq") or 0,
        control_id=f.str("control_id", max_len=256),
        event_id=event_id,
    )
    return ResumeRequest(session_id=f.str("session_id", required=True, max_len=256), command=command)


# --- server-side framing --------------------------------------------------------------------


def encode(wire: dict) -> str:
    """Serialise one server event (as :mod:`.codec` shapes it) as a compact JSON text frame."""
    return json.dumps(wire, separators=(",", ":"), ensure_ascii=False)


def transport_error(err: DuplexError) -> dict:
    """An ``error`` event for a connection that has no session (a failed resume, admission).

    It carries ``server_event_seq: null``: it is not part of any session's replayable stream.
    """
    return {
        "type": "error",
        "event_id": f"evt_transport_{secrets.token_hex(4)}",
        "server_event_seq": None,
        "epoch": None,
        "error": {
            "type": "invalid_request_error" if isinstance(err, ClientError) else "server_error",
            "code": err.code,
            "message": err.message,
            "param": err.param,
            "event_id": err.event_id,
        },
    }


# Events with no fields of their own beyond event_id and the fence: one parser shape for all.
def _fieldless(command_class):
    def parse(f, event_id, epoch, limits, rates):
        return command_class(event_id=event_id, epoch=epoch)

    return parse


for _event_type, _command_class in (
    ("input_audio_buffer.commit", cmd.CommitInput),
    ("input_audio_buffer.clear", cmd.ClearInput),
    ("heartbeat", cmd.Heartbeat),
    ("duplex.barge_in", cmd.BargeIn),
    ("session.close", cmd.Close),
):
    _parser(_event_type)(_fieldless(_command_class))
