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

Server events are encoded by :mod:`.codec`; :func:`encode` serialises the result. The
limits, errors, decoded values and field readers are in :mod:`.wire_types` (re-exported here).
"""

from __future__ import annotations

import binascii
import json
import secrets
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from ..core import commands as cmd
from ..core.conversation import Item
from ..core.engine_io import SAMPLING_RANGES, SPEED_RANGE, SamplingOverrides
from ..errors import (
    ClientError,
    DuplexError,
    InvalidCommand,
    InvalidSampling,
    ItemNotFound,  # noqa: F401  (was defined here; kept importable)
    UnencodableText,
)
from .audio_format import G711_RATE, LEGACY_NAMES, PCM, PCM_RATES, PCMA, PCMU, AudioFormat
from .wire_items import _item_value, _session_transcription, _tool_choice_field, _tool_fields, _tools_field
from .wire_types import (
    _HAS_SERVER_VAD,
    _MISSING,
    _SURROGATE,
    EAGERNESS_SILENCE_MS,
    AudioItemCreate,
    ChunkTooLarge,
    ClientEvent,
    EncodedAudio,
    FrameTooComplex,
    FrameTooLarge,
    InvalidAudio,
    InvalidField,
    InvalidFrame,
    InvalidJSON,
    NotSupported,
    ResumeRequest,
    SessionUpdate,
    TurnDetection,
    UnknownEventType,
    UnsupportedAudioFormat,
    WireError,
    WireLimits,
    _depth_ok,
    _Fields,
    _json_type,
    _refuse_unencodable,
)

_b64decode: Callable[..., bytes]  # pybase64's or the standard library's b64decode
try:  # an optional accelerator (extra 'fast'): the same checks as the standard library's
    # b64decode(validate=True), several times faster on an append
    from pybase64 import b64decode as _b64decode
except ImportError:  # both paths: tests/server/test_wire_accelerators.py
    from base64 import b64decode as _b64decode


# --- the decoder ----------------------------------------------------------------------------


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (_INFINITY, -_INFINITY):  # a literal past a double's range ("1e400")
        raise ValueError(f"{text[:32]} is out of range for a JSON number")
    return value


_INFINITY = float("inf")
# Python's json reads NaN and Infinity, which no JSON parser elsewhere does: held in a tool's
# schema they came back in session.updated as bare `Infinity`, and a browser's JSON.parse threw
# on the whole event. So a frame holding one (or a number that overflows to it) is refused as
# invalid JSON here, and nothing the server echoes can hold one. Float literals are rare in
# frames (none in an append), so the hook costs nothing on the hot path.
_JSON = json.JSONDecoder(parse_float=_finite_float, parse_constant=_refuse_constant)


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
    # count cannot pass the frame's length, so only a longer frame is counted: an append (a
    # few KB of base64) skips three scans of itself.
    brackets = None
    if len(frame) > limits.max_json_values:
        brackets = frame.count("[") + frame.count("{")
        if brackets + frame.count(",") > limits.max_json_values:
            raise FrameTooComplex(
                f"frame holds more than max_json_values={limits.max_json_values} JSON values"
            )
    try:
        obj = _JSON.decode(frame)
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
_ParserT = TypeVar("_ParserT", bound=_Parser)


def _parser(*names: str) -> Callable[[_ParserT], _ParserT]:
    def register(fn: _ParserT) -> _ParserT:
        for name in names:
            _PARSERS[name] = fn
        return fn

    return register


def accepted_types() -> tuple[str, ...]:
    """Every client event type the decoder knows (including those answered ``not_supported``)."""
    return tuple(sorted(_PARSERS))


@_parser("input_audio_buffer.append")
def _append(
    f: _Fields, event_id: str | None, epoch: int | None, limits: WireLimits, rates: tuple[int, AudioFormat]
) -> ClientEvent:
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
        return cmd.AppendAudio.of(pcm, sample_rate, event_id=event_id, epoch=epoch)
    return EncodedAudio(data=pcm, format=declared, event_id=event_id, epoch=epoch)


# The wire's order for each set of modalities a command may hold (text first, as OpenAI lists them).
_MODALITIES = {
    tuple(sorted(chosen)): tuple(sorted(chosen, reverse=True))
    for chosen in ({"audio"}, {"text"}, cmd.MODALITIES)
}


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
def _response_create(
    f: _Fields, event_id: str | None, epoch: int | None, limits: WireLimits, rates: tuple[int, AudioFormat]
) -> cmd.CreateResponse:
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
def _response_cancel(
    f: _Fields, event_id: str | None, epoch: int | None, limits: WireLimits, rates: tuple[int, AudioFormat]
) -> cmd.CancelResponse:
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
def _session_update(
    f: _Fields, event_id: str | None, epoch: int | None, limits: WireLimits, rates: tuple[int, AudioFormat]
) -> SessionUpdate:
    sample_rate, _ = rates
    s = f.object("session", required=True)
    kind = s.obj.get("type")
    if kind not in (None, "realtime", "transcription"):
        raise NotSupported(f"session.type {kind!r} is not supported: 'realtime' or 'transcription'")
    changes: dict[str, Any] = {}
    found: dict[str, Any] = {}
    if kind is not None:
        # Checked against the session's own type by the reader (only it knows which it is).
        found["session_type"] = kind
    # All or nothing, as OpenAI applies it: every field is read (and checked) before anything
    # is applied, and the first refused one raises, naming its param; nothing of the update
    # reaches the session (decode's caller reports the one error, no session.updated).
    audio = s.object("audio")
    in_fields = audio.object("input") if audio is not None else None
    out_fields = audio.object("output") if audio is not None else None

    def turn_detection() -> None:
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
        td_fields = holders[0].object("turn_detection", required=True)  # not None: read above
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
        settings: dict[str, Any] = {
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

    def input_format() -> None:
        fmt = _format(in_fields, "format", sample_rate) if in_fields is not None else None
        fmt = fmt or _legacy_format(s, "input_audio_format")
        if fmt is not None:
            found["input_format"] = fmt

    def output_format() -> None:
        fmt = _format(out_fields, "format", sample_rate) if out_fields is not None else None
        fmt = fmt or _legacy_format(s, "output_audio_format")
        if fmt is not None:
            found["output_format"] = fmt

    def voice() -> None:
        holder = out_fields if out_fields is not None and out_fields.has("voice") else s
        value = holder.obj.get("voice")
        if isinstance(value, dict):  # GA: a custom voice by id (as short as a voice's name: it is
            # kept with the session's settings, which the text budget does not count)
            value = holder.object("voice", required=True).str("id", required=True, max_len=128)
        elif value is not None:
            value = holder.str("voice", max_len=128)
        if value is not None:
            found["voice"] = value

    def speed() -> None:
        # GA audio.output.speed; the beta API had it at the top level.
        holder = out_fields if out_fields is not None and out_fields.has("speed") else s
        value = holder.number("speed", minimum=SPEED_RANGE[0], maximum=SPEED_RANGE[1])
        if value is not None:
            changes["output_speed"] = value

    def instructions() -> None:
        value = s.str("instructions")
        if value is not None:
            changes["instructions"] = value

    def modalities() -> None:
        value = _modalities(s, "output_modalities") or _modalities(s, "modalities")
        if value is not None:
            changes["modalities"] = value

    # knob -> (value, the dotted param it came from), range-checked knob by knob below.
    sampling: dict[str, tuple[Any, str]] = {}

    def temperature() -> None:
        value = s.number("temperature", minimum=0.0)
        if value is not None:
            sampling["temperature"] = (value, s._name("temperature"))

    def max_tokens() -> None:
        for key in ("max_output_tokens", "max_response_output_tokens"):
            if s.has(key) and s.obj[key] == "inf":
                # No limit: the session's earlier one goes (it was kept, and echoed).
                changes["reset_sampling"] = ("max_tokens",)
                continue
            limit = s.int(key, minimum=1)
            if limit is not None:
                sampling["max_tokens"] = (limit, s._name(key))

    def duplex() -> None:
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
                number = sp.number(key, minimum=0.0)
                if number is not None:
                    sampling[key] = (number, sp._name(key))
            for key, minimum in (("top_k", 0), ("max_tokens", 1), ("seed", None)):
                whole = sp.int(key, minimum=minimum)
                if whole is not None:
                    sampling[key] = (whole, sp._name(key))

    def tools() -> None:
        changes.update(_tools_field(s))

    def tool_choice() -> None:
        # openai-agents lets a user set tool_choice to a bare tool name: one the same update
        # declares is read as that function (refusing it would refuse the agent's whole setup).
        named = tuple(t.name for t in changes.get("tools") or ())
        changes.update(_tool_choice_field(s, named))

    def transcription() -> None:
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


@_parser("conversation.item.create")
def _item_create(
    f: _Fields, event_id: str | None, epoch: int | None, limits: WireLimits, rates: tuple[int, AudioFormat]
) -> cmd.CreateItem | AudioItemCreate:
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


@_parser("conversation.item.delete")
def _item_delete(
    f: _Fields, event_id: str | None, epoch: int | None, limits: WireLimits, rates: tuple[int, AudioFormat]
) -> cmd.DeleteItem:
    return cmd.DeleteItem(
        item_id=f.str("item_id", required=True, max_len=256), event_id=event_id, epoch=epoch
    )


@_parser("conversation.item.retrieve")
def _item_retrieve(
    f: _Fields, event_id: str | None, epoch: int | None, limits: WireLimits, rates: tuple[int, AudioFormat]
) -> cmd.RetrieveItem:
    return cmd.RetrieveItem(
        item_id=f.str("item_id", required=True, max_len=256), event_id=event_id, epoch=epoch
    )


# --- function tools -----------------------------------------------------------------------


@_parser("conversation.item.truncate")
def _item_truncate(
    f: _Fields, event_id: str | None, epoch: int | None, limits: WireLimits, rates: tuple[int, AudioFormat]
) -> cmd.TruncateItem:
    return cmd.TruncateItem(
        item_id=f.str("item_id", required=True, max_len=256),
        content_index=f.int("content_index", required=True),
        audio_end_ms=f.int("audio_end_ms", required=True),
        event_id=event_id,
        epoch=epoch,
    )


@_parser("output_audio_buffer.clear", "transcription_session.update")
def _not_supported(
    f: _Fields, event_id: str | None, epoch: int | None, limits: WireLimits, rates: tuple[int, AudioFormat]
) -> NoReturn:
    raise NotSupported(f"{f.obj['type']} is not supported by this server")


# --- duplex extensions ----------------------------------------------------------------------


@_parser("duplex.playback_ack")
def _playback_ack(
    f: _Fields, event_id: str | None, epoch: int | None, limits: WireLimits, rates: tuple[int, AudioFormat]
) -> cmd.PlaybackAck:
    return cmd.PlaybackAck(
        response_id=f.str("response_id", required=True, max_len=256),
        played_ms=f.int("played_ms", required=True),
        event_id=event_id,
        epoch=epoch,
    )


@_parser("session.resume")
def _session_resume(
    f: _Fields, event_id: str | None, epoch: int | None, limits: WireLimits, rates: tuple[int, AudioFormat]
) -> ResumeRequest:
    command = cmd.Resume(
        generation=f.int("generation", required=True),
        resume_token=f.str("resume_token", required=True, max_len=256),
        last_seq=f.int("last_seq") or 0,
        control_id=f.str("control_id", max_len=256),
        event_id=event_id,
    )
    return ResumeRequest(session_id=f.str("session_id", required=True, max_len=256), command=command)


# --- server-side framing --------------------------------------------------------------------


def encode(wire: dict[str, Any]) -> str:
    """Serialise one server event (as :mod:`.codec` shapes it) as a compact JSON text frame."""
    return json.dumps(wire, separators=(",", ":"), ensure_ascii=False)


def transport_error(err: DuplexError) -> dict[str, Any]:
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
def _fieldless(command_class: type[cmd.Command]) -> _Parser:
    def parse(
        f: _Fields,
        event_id: str | None,
        epoch: int | None,
        limits: WireLimits,
        rates: tuple[int, AudioFormat],
    ) -> cmd.Command:
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


__all__ = [
    "decode",
    "accepted_types",
    "encode",
    "transport_error",
    "WireLimits",
    "WireError",
    "FrameTooComplex",
    "InvalidFrame",
    "InvalidJSON",
    "FrameTooLarge",
    "UnknownEventType",
    "InvalidField",
    "InvalidAudio",
    "ChunkTooLarge",
    "UnsupportedAudioFormat",
    "NotSupported",
    "ResumeRequest",
    "EncodedAudio",
    "TurnDetection",
    "EAGERNESS_SILENCE_MS",
    "SessionUpdate",
    "AudioItemCreate",
    "ClientEvent",
]
