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
* :class:`TruncateItem`: an OpenAI ``conversation.item.truncate``, which the server turns into
  a playback acknowledgement once it knows which response the item belongs to;

or raises a :class:`WireError` subclass carrying a stable ``code`` and, whenever the frame let
us read one, the client's ``event_id``. A refused frame changes nothing anywhere.

Server events need no codec: every one is ``event.to_wire()`` serialised as JSON.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any, Callable, Union

import attrs

from ..core import commands as cmd
from ..core.engine_io import SamplingOverrides
from ..errors import ClientError, DuplexError, InvalidCommand, UnencodableText

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

    @property
    def transport_cap(self) -> int:
        # Headroom over max_frame_bytes, so an oversized frame is still answered with an error
        # event instead of a dropped connection.
        return self.max_frame_bytes * 4


# --- typed errors ---------------------------------------------------------------------------


class WireError(InvalidCommand):
    """A client frame could not be turned into an event; nothing was changed."""

    code = "invalid_event"


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


class ItemNotFound(ClientError):
    code = "item_not_found"


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
class TruncateItem:
    """``conversation.item.truncate``: the client played ``audio_end_ms`` of an item."""

    item_id: str
    content_index: int
    audio_end_ms: int
    event_id: str | None = None


@attrs.frozen(slots=True, kw_only=True)
class TurnDetection:
    """Server VAD settings of a ``session.update`` (OpenAI's ``turn_detection`` object)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500


@attrs.frozen(slots=True, kw_only=True)
class SessionUpdate:
    """``session.update``: the session command, plus what it does to server turn detection."""

    command: cmd.UpdateSession
    #: Set when the update turns server VAD on (with these settings).
    turn_detection: TurnDetection | None = None
    #: True when the update turns server VAD off (``turn_detection: null``).
    vad_off: bool = False

    @property
    def event_id(self) -> str | None:
        return self.command.event_id


ClientEvent = Union[cmd.Command, ResumeRequest, TruncateItem, SessionUpdate]

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

    def str(self, key: str, *, required: bool = False, max_len: int = 1 << 16) -> str | None:
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

    def int(self, key: str, *, required: bool = False, minimum: int | None = 0,
            maximum: int | None = None) -> int | None:
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

    def number(self, key: str, *, minimum: float | None = None) -> float | None:
        value = self.obj.get(key, _MISSING)
        if value is _MISSING or value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise self.fail(key, f"must be a number, not {_json_type(value)}")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be >= {minimum}")
        return float(value)

    def bool(self, key: str) -> bool | None:
        value = self.obj.get(key, _MISSING)
        if value is _MISSING or value is None:
            return None
        if not isinstance(value, bool):
            raise self.fail(key, f"must be a boolean, not {_json_type(value)}")
        return value

    def object(self, key: str, *, required: bool = False) -> "_Fields | None":
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
                raise UnencodableText("a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                                      "which is not valid Unicode text")
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


# --- the decoder ----------------------------------------------------------------------------


def decode(frame: str | bytes, limits: WireLimits = WireLimits(), *, sample_rate: int = 16000) -> ClientEvent:
    """Parse one client frame. ``sample_rate`` is the session's input rate (format checks)."""
    if isinstance(frame, (bytes, bytearray, memoryview)):
        raise InvalidFrame("binary frames are not accepted; send JSON text frames")
    size = len(frame) if frame.isascii() else len(frame.encode("utf-8", "surrogatepass"))
    if size > limits.max_frame_bytes:
        raise FrameTooLarge(f"frame is larger than max_frame_bytes={limits.max_frame_bytes}")
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
    if not _depth_ok(obj, limits.max_depth):
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
    try:
        return parser(fields, event_id, epoch, limits, sample_rate)
    except DuplexError as err:
        raise err.with_event_id(event_id)
    except (TypeError, ValueError) as exc:  # an attrs validator of the command itself
        raise WireError(f"invalid {event_type}: {exc}", event_id=event_id) from None


_Parser = Callable[[_Fields, "str | None", "int | None", WireLimits, int], ClientEvent]
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
def _append(f: _Fields, event_id, epoch, limits: WireLimits, sample_rate: int):
    audio = f.obj.get("audio", _MISSING)
    if audio is _MISSING or audio is None:
        raise f.fail("audio", "is required (base64 pcm16)")
    if not isinstance(audio, str):
        raise f.fail("audio", f"must be a base64 string, not {_json_type(audio)}")
    # Check the size before decoding, so a huge chunk costs no allocation.
    if len(audio) // 4 * 3 > limits.max_chunk_bytes + 3:
        raise ChunkTooLarge(f"audio chunk is larger than max_chunk_bytes={limits.max_chunk_bytes}")
    try:
        pcm = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidAudio("audio is not valid base64") from None
    if len(pcm) > limits.max_chunk_bytes:
        raise ChunkTooLarge(f"audio chunk is larger than max_chunk_bytes={limits.max_chunk_bytes}")
    if not pcm:
        raise InvalidAudio("audio chunk is empty")
    if len(pcm) % 2:
        raise InvalidAudio("pcm16 audio must have an even number of bytes")
    rate = f.int("sample_rate", minimum=1)  # extension: the chunk's rate, checked by the session
    return cmd.AppendAudio(pcm=pcm, sample_rate=sample_rate if rate is None else rate,
                           event_id=event_id, epoch=epoch)


@_parser("response.create")
def _response_create(f: _Fields, event_id, epoch, limits, sample_rate):
    response = f.object("response")
    instructions = response.str("instructions") if response is not None else None
    if response is not None:
        conversation = response.obj.get("conversation")
        if conversation not in (None, "auto"):
            raise NotSupported("out-of-band responses (response.conversation other than 'auto') "
                               "are not supported")
    return cmd.CreateResponse(instructions=instructions, event_id=event_id, epoch=epoch)


@_parser("response.cancel")
def _response_cancel(f: _Fields, event_id, epoch, limits, sample_rate):
    f.str("response_id")  # type-checked; the session cancels its one active response
    return cmd.CancelResponse(event_id=event_id, epoch=epoch)


@_parser("session.update")
def _session_update(f: _Fields, event_id, epoch, limits, sample_rate):
    s = f.object("session", required=True)
    changes: dict[str, Any] = {}

    # Turn detection: GA nests it under audio.input, the beta API had it at the top level.
    audio = s.object("audio")
    audio_in = audio.object("input") if audio is not None else None
    holders = [h for h in (audio_in, s) if h is not None and h.has("turn_detection")]
    detection: TurnDetection | None = None
    vad_off = False
    if holders:
        td = holders[0].obj["turn_detection"]
        if td is None:
            changes["auto_respond"] = False
            vad_off = True
        else:
            td_fields = holders[0].object("turn_detection")
            kind = td_fields.str("type", required=True)
            if kind not in ("server_vad", "semantic_vad"):
                raise td_fields.fail("type", f"must be 'server_vad' or 'semantic_vad', not {kind!r}")
            create = td_fields.bool("create_response")
            changes["auto_respond"] = True if create is None else create
            threshold = td_fields.number("threshold")
            if threshold is not None and not 0.0 < threshold < 1.0:
                raise td_fields.fail("threshold", "must be between 0 and 1")
            settings = {"threshold": threshold,
                        "prefix_padding_ms": td_fields.int("prefix_padding_ms", maximum=10_000),
                        "silence_duration_ms": td_fields.int("silence_duration_ms", minimum=1,
                                                             maximum=60_000)}
            detection = TurnDetection(**{k: v for k, v in settings.items() if v is not None})
        if _HAS_SERVER_VAD:
            changes["server_vad"] = detection is not None

    # Input format: must match what this session takes.
    fmt = audio_in.object("format") if audio_in is not None else None
    if fmt is not None:
        kind = fmt.str("type")
        if kind not in (None, "audio/pcm"):
            raise UnsupportedAudioFormat(f"input format {kind!r} is not supported; use audio/pcm")
        rate = fmt.int("rate", minimum=1)
        if rate is not None and rate != sample_rate:
            raise UnsupportedAudioFormat(f"input rate {rate} Hz is not supported; this session takes "
                                         f"{sample_rate} Hz pcm16")
    legacy = s.str("input_audio_format")
    if legacy not in (None, "pcm16"):
        raise UnsupportedAudioFormat(f"input_audio_format {legacy!r} is not supported; use pcm16")

    instructions = s.str("instructions")
    if instructions is not None:
        changes["instructions"] = instructions

    sampling: dict[str, Any] = {}
    temperature = s.number("temperature", minimum=0.0)
    if temperature is not None:
        sampling["temperature"] = temperature
    for key in ("max_output_tokens", "max_response_output_tokens"):
        if s.has(key) and s.obj[key] == "inf":
            continue
        limit = s.int(key, minimum=1)
        if limit is not None:
            sampling["max_tokens"] = limit

    # Our extension block: {"duplex": {"model_native", "min_interruption_ms", "sampling"}}.
    duplex = s.object("duplex")
    if duplex is not None:
        native = duplex.bool("model_native")
        if native is not None:
            changes["model_native"] = native
        min_ms = duplex.int("min_interruption_ms", minimum=0, maximum=60_000)
        if min_ms is not None:
            changes["min_interruption_ms"] = min_ms
        auto = duplex.bool("auto_respond")
        if auto is not None:
            changes["auto_respond"] = auto
        sp = duplex.object("sampling")
        if sp is not None:
            for key in ("temperature", "top_p"):
                value = sp.number(key, minimum=0.0)
                if value is not None:
                    sampling[key] = value
            for key, minimum in (("top_k", 0), ("max_tokens", 1), ("seed", None)):
                value = sp.int(key, minimum=minimum)
                if value is not None:
                    sampling[key] = value
    if sampling:
        changes["sampling"] = SamplingOverrides(**sampling)  # may raise InvalidSampling
    return SessionUpdate(command=cmd.UpdateSession(event_id=event_id, epoch=epoch, **changes),
                         turn_detection=detection, vad_off=vad_off)


@_parser("conversation.item.truncate")
def _item_truncate(f: _Fields, event_id, epoch, limits, sample_rate):
    return TruncateItem(item_id=f.str("item_id", required=True, max_len=256),
                        content_index=f.int("content_index", required=True),
                        audio_end_ms=f.int("audio_end_ms", required=True),
                        event_id=event_id)


@_parser("conversation.item.create", "conversation.item.delete", "conversation.item.retrieve",
         "output_audio_buffer.clear", "transcription_session.update")
def _not_supported(f: _Fields, event_id, epoch, limits, sample_rate):
    kind = f.obj["type"]
    if kind.startswith("conversation.item."):
        raise NotSupported(f"{kind} is not supported: sessions keep no editable conversation "
                           "history; stream audio and commit, or use response.create with "
                           "instructions")
    raise NotSupported(f"{kind} is not supported by this server")


# --- duplex extensions ----------------------------------------------------------------------


@_parser("duplex.playback_ack")
def _playback_ack(f: _Fields, event_id, epoch, limits, sample_rate):
    return cmd.PlaybackAck(response_id=f.str("response_id", required=True, max_len=256),
                           played_ms=f.int("played_ms", required=True),
                           event_id=event_id, epoch=epoch)




@_parser("session.resume")
def _session_resume(f: _Fields, event_id, epoch, limits, sample_rate):
    command = cmd.Resume(generation=f.int("generation", required=True),
                         resume_token=f.str("resume_token", required=True, max_len=256),
                         last_seq=f.int("last_seq") or 0,
                         control_id=f.str("control_id", max_len=256),
                         event_id=event_id)
    return ResumeRequest(session_id=f.str("session_id", required=True, max_len=256), command=command)


# --- server-side framing --------------------------------------------------------------------


def encode(wire: dict) -> str:
    """Serialise one server event (``event.to_wire()``) as a compact JSON text frame."""
    return json.dumps(wire, separators=(",", ":"), ensure_ascii=False)


def transport_error(err: DuplexError) -> dict:
    """An ``error`` event for a connection that has no session (a failed resume, admission).

    It carries ``server_event_seq: null``: it is not part of any session's replayable stream.
    """
    return {"type": "error", "event_id": None, "server_event_seq": None, "epoch": None,
            "error": {"type": type(err).__name__, "code": err.code, "message": err.message,
                      "event_id": err.event_id}}


# Events with no fields of their own beyond event_id and the fence: one parser shape for all.
def _fieldless(command_class):
    def parse(f, event_id, epoch, limits, sample_rate):
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
