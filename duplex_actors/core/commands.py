"""Mailbox commands: what applications (and the transport) ask of a session.

Frozen and slotted; validated at construction so a malformed command never reaches the
statechart. ``event_id`` is the client's id, echoed in any error; ``epoch``, when given, is the
fence the client believes current: an older one is refused with ``StaleFence``.

Each command belongs to a mailbox lane. The *control* lane (barge-in, cancel, close,
heartbeat, detach, resume, playback acks) is never stuck behind audio on the *data* lane.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, ClassVar

import attrs

from ..errors import InvalidCommand
from .conversation import Item
from .engine_io import SPEED_RANGE, FunctionTool, SamplingOverrides


class Lane(enum.IntEnum):
    CONTROL = 0
    ENGINE = 1
    DATA = 2


#: An attrs validator: it refuses a value with InvalidCommand and returns nothing.
_Validator = Callable[[object, "attrs.Attribute[Any]", object], None]


# Validators raise InvalidCommand, not attrs' own TypeError/ValueError: an application that
# builds a command wrongly gets the runtime's error for a refused command, whichever field it was.
def _count(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidCommand(f"{attribute.name} must be a non-negative integer, not {value!r}"[:200])


_optional_count = attrs.validators.optional(_count)

#: The knobs a session's sampling has (what ``reset_sampling`` and a ``sampling`` dict may name).
SAMPLING_KNOBS = frozenset(f.name for f in attrs.fields(SamplingOverrides))


def _sampling_knobs(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, tuple) or not set(value) <= SAMPLING_KNOBS:
        raise InvalidCommand(
            f"{attribute.name} must be a tuple of sampling knobs ({', '.join(sorted(SAMPLING_KNOBS))})"
        )


def _optional_speed(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not SPEED_RANGE[0] <= value <= SPEED_RANGE[1]
    ):
        raise InvalidCommand(f"{attribute.name} must be a number from {SPEED_RANGE[0]} to {SPEED_RANGE[1]}")


@attrs.frozen(slots=True, kw_only=True)
class Command:
    LANE: ClassVar[Lane] = Lane.DATA
    TRIGGER: ClassVar[str] = ""
    event_id: str | None = None
    epoch: int | None = attrs.field(default=None, validator=_optional_count)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # hypothesis (and IPython) print a failing example with this: the short repr (audio
        # as its length) rather than every byte of it.
        printer.text(repr(self))


def _buffer_bytes(value: object) -> object:
    # Only a buffer is copied into bytes: bytes(4) is four zero bytes, and an int given as audio
    # must be refused, not taken as that much silence.
    return bytes(value) if isinstance(value, (bytearray, memoryview)) else value


def _pcm16(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bytes):
        raise InvalidCommand(f"audio must be bytes of pcm16, not {type(value).__name__}")
    if len(value) % 2:
        raise InvalidCommand("pcm16 audio must have an even number of bytes")


SAMPLE_RATES = (8000, 16000, 24000, 48000)
_SAMPLE_RATES = frozenset(SAMPLE_RATES)


def _rate(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in SAMPLE_RATES:
        raise InvalidCommand(f"unsupported sample rate {value!r}")


def _text(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise InvalidCommand(f"{attribute.name} must be a string, not {type(value).__name__}")


# What the wire's parser already refuses, refused again for a command an application builds
# itself (``SessionHandle.update``, ``create_response``): an update taking instructions that
# are not text was applied, and every later response failed inside the engine.
_optional_text = attrs.validators.optional(_text)


def _nonempty_text(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    _text(instance, attribute, value)
    if not value:
        raise InvalidCommand(f"{attribute.name} must not be empty")


#: A response's output: text, audio (with its transcript), or both.
MODALITIES = frozenset({"text", "audio"})


def _modalities(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (
        isinstance(value, tuple) and value and set(value) <= MODALITIES and len(set(value)) == len(value)
    ):
        raise InvalidCommand(
            f"{attribute.name} must be a tuple of 'text' and/or 'audio', not {value!r}"[:200]
        )


def _tuple_of(kinds: type | tuple[type, ...], described: str) -> _Validator:
    """A validator for a tuple whose every element is one of ``kinds``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not (isinstance(value, tuple) and all(isinstance(e, kinds) for e in value)):
            raise InvalidCommand(f"{attribute.name} must be a tuple of {described}, not {value!r}"[:200])

    return check


def _transcription(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, (str, bool)):
        raise InvalidCommand(f"{attribute.name} must be a model name, False (off) or None, not {value!r}")


def _metadata(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (
        isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    ):
        raise InvalidCommand(f"{attribute.name} must be a dict of strings, not {value!r}"[:200])


def _item(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, Item):
        raise InvalidCommand(f"{attribute.name} must be an Item, not {type(value).__name__}")


def _whole(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidCommand(f"{attribute.name} must be an integer, not {value!r}")


_optional = attrs.validators.optional
_optional_modalities = _optional(_modalities)
_optional_metadata = _optional(_metadata)
_optional_tools = _optional(_tuple_of(FunctionTool, "FunctionTool"))
_optional_context = _optional(_tuple_of((Item, str), "items and item ids"))


def _sampling(value: object) -> SamplingOverrides | None:
    """A ``sampling`` given as a mapping of knobs (as ``open_session`` takes it) becomes
    :class:`SamplingOverrides`; a mapping naming an unknown knob, or anything else that is not
    one, is refused (a dict was taken, and the session failed at the update)."""
    if value is None or isinstance(value, SamplingOverrides):
        return value
    if isinstance(value, dict):
        unknown = sorted(map(str, set(value) - SAMPLING_KNOBS))
        if unknown:
            raise InvalidCommand(f"sampling: unknown knob(s) {unknown}; known: {sorted(SAMPLING_KNOBS)}")
        return SamplingOverrides(**value)
    raise InvalidCommand(
        f"sampling must be SamplingOverrides or a dict of its knobs, not {type(value).__name__}"
    )


@attrs.frozen(slots=True, kw_only=True)
class AppendAudio(Command):
    """Client audio for the input buffer (GA ``input_audio_buffer.append``): pcm16 at the session's
    rate.
    """

    TRIGGER = "append"
    pcm: bytes = attrs.field(validator=_pcm16, converter=_buffer_bytes, repr=lambda b: f"<{len(b)} bytes>")
    sample_rate: int = attrs.field(default=16000, validator=_rate)
    #: A VAD's verdict on this chunk (None: unknown). Only speech counts towards an overlap, so
    #: the silence a VAD waits out before saying "stopped" never turns a backchannel into a
    #: barge-in.
    speech: bool | None = None

    @classmethod
    def of(
        cls,
        pcm: bytes,
        sample_rate: int = 16000,
        *,
        event_id: str | None = None,
        epoch: int | None = None,
        speech: bool | None = None,
    ) -> AppendAudio:
        """The same command as ``AppendAudio(pcm=..., ...)``, built faster for the common case.

        Appends are the runtime's most frequent message (50 a second per session), and the
        generated ``__init__`` runs a validator call per field and a ``bytes()`` converter.
        For what callers nearly always send (``bytes`` of even length, a supported rate, no
        epoch) the same checks are made here inline and the slots are set directly; anything
        else goes through the validated constructor, which raises the same precise errors.
        """
        if (
            type(pcm) is not bytes
            or len(pcm) & 1
            or type(sample_rate) is not int
            or sample_rate not in _SAMPLE_RATES
            or epoch is not None
        ):
            return cls(pcm=pcm, sample_rate=sample_rate, event_id=event_id, epoch=epoch, speech=speech)
        command = _new(cls)
        _set_event_id(command, event_id)
        _set_epoch(command, None)
        _set_pcm(command, pcm)
        _set_sample_rate(command, sample_rate)
        _set_speech(command, speech)
        return command


_new = object.__new__


def _slot_setter(cls: type, name: str) -> Callable[[object, object], None]:
    """The ``__set__`` of ``cls``'s slot ``name`` (its member descriptor, found along the MRO).

    It writes the slot as ``object.__setattr__`` would (frozen attrs classes refuse their own
    ``__setattr__``, by design), without the attribute lookup each of those calls makes."""
    for klass in cls.__mro__:
        descriptor = vars(klass).get(name)
        if descriptor is not None:
            setter: Callable[[object, object], None] = descriptor.__set__
            return setter
    raise AttributeError(f"{cls.__name__} has no slot {name!r}")


_set_event_id, _set_epoch, _set_pcm, _set_sample_rate, _set_speech = (
    _slot_setter(AppendAudio, name) for name in ("event_id", "epoch", "pcm", "sample_rate", "speech")
)


@attrs.frozen(slots=True, kw_only=True)
class CommitInput(Command):
    """Commit the buffered audio as a user item (``input_audio_buffer.commit``)."""

    TRIGGER = "commit"


@attrs.frozen(slots=True, kw_only=True)
class ClearInput(Command):
    """Drop the uncommitted audio (``input_audio_buffer.clear``)."""

    TRIGGER = "clear"


@attrs.frozen(slots=True, kw_only=True)
class CreateResponse(Command):
    """Ask for a model turn (``response.create``), optionally with instructions, modalities and
    metadata for this response only.
    """

    TRIGGER = "create_response"
    instructions: str | None = attrs.field(default=None, validator=_optional_text)
    #: Overrides the session's output modalities for this response (("text",) or ("audio",)).
    modalities: tuple[str, ...] | None = attrs.field(default=None, validator=_optional_modalities)
    #: Echoed on response.created and response.done (OpenAI: up to 16 string pairs).
    metadata: dict[str, str] | None = attrs.field(
        default=None, eq=False, hash=False, validator=_optional_metadata
    )
    #: This response's function tools and tool_choice, instead of the session's (None: the
    #: session's). OpenAI clients pass them to ask for, or rule out, a call in one reply.
    tools: tuple[FunctionTool, ...] | None = attrs.field(default=None, validator=_optional_tools)
    tool_choice: str | None = attrs.field(default=None, validator=_optional_text)
    #: This response's token limit, instead of the session's sampling.max_tokens: 0 lifts
    #: the session's for this response (GA ``"inf"``), None keeps it.
    max_tokens: int | None = attrs.field(default=None, validator=_optional_count)
    #: Out of band (GA ``response.conversation: "none"``): nothing the response says is
    #: written into the conversation, and the user's pending turn waits for its own response.
    out_of_band: bool = False
    #: GA ``response.input``: the context of this response instead of the pending turn, as
    #: items (written here) or ids of items in the conversation (str). None: the pending turn.
    input: tuple[Item | str, ...] | None = attrs.field(default=None, validator=_optional_context)


@attrs.frozen(slots=True, kw_only=True)
class SpeechStartedSignal(Command):
    """From server VAD (or a client that runs its own VAD)."""

    TRIGGER = "speech_started"
    audio_ms: int = attrs.field(default=0, validator=_count)


@attrs.frozen(slots=True, kw_only=True)
class SpeechStoppedSignal(Command):
    """From server VAD (or a client that runs its own VAD): the user's speech ended."""

    TRIGGER = "speech_stopped"
    audio_ms: int = attrs.field(default=0, validator=_count)


@attrs.frozen(slots=True, kw_only=True)
class UpdateSession(Command):
    """Change the session's settings (``session.update``): all or nothing."""

    TRIGGER = "update"
    auto_respond: bool | None = None
    respond_on_commit: bool | None = None
    modalities: tuple[str, ...] | None = attrs.field(default=None, validator=_optional_modalities)
    server_vad: bool | None = None
    #: Server VAD's pre-speech window (turn_detection.prefix_padding_ms); None leaves it.
    speech_prefix_ms: int | None = attrs.field(default=None, validator=_optional_count)
    #: Server VAD's idle timeout (turn_detection.idle_timeout_ms): 0 turns it off, None leaves it.
    idle_timeout_ms: int | None = attrs.field(default=None, validator=_optional_count)
    model_native: bool | None = None
    #: duplex.state events on or off (extension); None leaves it.
    state_events: bool | None = None
    instructions: str | None = attrs.field(default=None, validator=_optional_text)
    #: The knobs given (not None) replace the session's; the others are kept.
    sampling: SamplingOverrides | None = attrs.field(default=None, converter=_sampling)
    #: Knobs set back to the engine's default (GA ``max_output_tokens: "inf"``).
    reset_sampling: tuple[str, ...] = attrs.field(default=(), validator=_sampling_knobs)
    min_interruption_ms: int | None = attrs.field(default=None, validator=_optional_count)
    #: Whether speech over a response may cancel it (turn_detection.interrupt_response).
    interrupt_response: bool | None = None
    #: Replaces the session's function tools as a whole (``()`` removes them all).
    tools: tuple[FunctionTool, ...] | None = attrs.field(default=None, validator=_optional_tools)
    tool_choice: str | None = attrs.field(default=None, validator=_optional_text)
    #: Input transcription: a model name turns it on, False turns it off, None leaves it.
    transcription: str | bool | None = attrs.field(default=None, validator=_transcription)
    #: The language input transcription is asked to hear (ISO-639-1); None leaves it.
    transcription_language: str | None = attrs.field(default=None, validator=_optional_text)
    #: How fast the engine speaks (OpenAI's audio.output.speed, 0.25-1.5); None leaves it.
    output_speed: float | None = attrs.field(default=None, validator=_optional_speed)
    #: The rate the client now plays audio at (its output format changed); None leaves it.
    output_sample_rate: int | None = attrs.field(default=None, validator=_optional(_rate))


@attrs.frozen(slots=True, kw_only=True)
class AddFunctionOutput(Command):
    """The client ran a function the model called and sends what it returned (an OpenAI
    ``function_call_output`` item). Kept for the next model turn; no response starts."""

    TRIGGER = "function_output"
    call_id: str = attrs.field(validator=_nonempty_text)
    output: str = attrs.field(validator=_text)
    item_id: str | None = attrs.field(default=None, validator=_optional_text)


# --- conversation items (data lane: ordered with the audio and commits around them) --------


@attrs.frozen(slots=True, kw_only=True)
class CreateItem(Command):
    """``conversation.item.create``: add a user/system/developer message, a function output, or
    a function call the client replays from its history."""

    TRIGGER = "create_item"
    #: A ready item (its id may be empty: the session then allocates one).
    item: Item = attrs.field(validator=_item)
    previous_item_id: str | None = attrs.field(default=None, validator=_optional_text)
    #: A user message's input_audio, as pcm16 at the session's rate (the server converted it
    #: from the client's format): the next response hears it, as it hears committed audio.
    audio: bytes = attrs.field(
        default=b"", repr=lambda b: f"<{len(b)} bytes>", converter=_buffer_bytes, validator=_pcm16
    )


@attrs.frozen(slots=True, kw_only=True)
class DeleteItem(Command):
    """Remove a conversation item (``conversation.item.delete``)."""

    TRIGGER = "delete_item"
    item_id: str = attrs.field(validator=_text)


@attrs.frozen(slots=True, kw_only=True)
class RetrieveItem(Command):
    """Send a conversation item back (``conversation.item.retrieve``)."""

    TRIGGER = "retrieve_item"
    item_id: str = attrs.field(validator=_text)


@attrs.frozen(slots=True, kw_only=True)
class TruncateItem(Command):
    """``conversation.item.truncate``: the user heard ``audio_end_ms`` of an assistant item."""

    TRIGGER = "truncate_item"
    item_id: str = attrs.field(validator=_text)
    content_index: int = attrs.field(validator=_count)
    audio_end_ms: int = attrs.field(validator=_count)


# --- control lane ---------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class BargeIn(Command):
    """The user interrupted: cancel the response in flight at once (its reason is the response.done's)."""

    LANE = Lane.CONTROL
    TRIGGER = "barge_in"
    reason: str = attrs.field(default="turn_detected", validator=_text)


@attrs.frozen(slots=True, kw_only=True)
class CancelResponse(Command):
    """Cancel the response in flight (``response.cancel``); naming another response is refused."""

    LANE = Lane.CONTROL
    TRIGGER = "cancel"
    reason: str = attrs.field(default="client_cancelled", validator=_text)
    #: When given, it must name the active response; otherwise nothing is cancelled.
    response_id: str | None = attrs.field(default=None, validator=_optional_text)


@attrs.frozen(slots=True, kw_only=True)
class Heartbeat(Command):
    """Keep the lease alive (answered by ``heartbeat.ack``)."""

    LANE = Lane.CONTROL
    TRIGGER = "heartbeat"


@attrs.frozen(slots=True, kw_only=True)
class PlaybackAck(Command):
    """The client played ``played_ms`` of ``response_id``'s audio (what the user really heard)."""

    LANE = Lane.CONTROL
    TRIGGER = "playback_ack"
    response_id: str = attrs.field(validator=_text)
    played_ms: int = attrs.field(validator=_count)


@attrs.frozen(slots=True, kw_only=True)
class Detach(Command):
    """The transport dropped: the session waits out its disconnect grace for a resume."""

    LANE = Lane.CONTROL
    TRIGGER = "detach"


@attrs.frozen(slots=True, kw_only=True)
class Resume(Command):
    """Take a detached (or still attached) session over with its lease's generation and token,
    replaying the journal after ``last_seq``.
    """

    LANE = Lane.CONTROL
    TRIGGER = "resume"
    # Any whole number: one that is not the lease's is the chart's to refuse (resume_conflict).
    generation: int = attrs.field(validator=_whole)
    resume_token: str = attrs.field(validator=_text)
    last_seq: int = attrs.field(default=0, validator=_whole)
    #: Idempotency key: the same resume replayed gets the same answer.
    control_id: str | None = attrs.field(default=None, validator=_optional_text)
    #: Digest of the API key the resuming client presented (set by the transport; the chart
    #: refuses a key other than the one that opened the session).
    key_digest: bytes | None = attrs.field(default=None, repr=False)


@attrs.frozen(slots=True, kw_only=True)
class Close(Command):
    """Close the session; closed is absorbing."""

    LANE = Lane.CONTROL
    TRIGGER = "close"
    reason: str = attrs.field(default="client_closed", validator=_text)


MAILBOX_COMMANDS = (
    AppendAudio,
    CommitInput,
    ClearInput,
    CreateResponse,
    SpeechStartedSignal,
    SpeechStoppedSignal,
    UpdateSession,
    AddFunctionOutput,
    CreateItem,
    DeleteItem,
    RetrieveItem,
    TruncateItem,
    BargeIn,
    CancelResponse,
    Heartbeat,
    PlaybackAck,
    Detach,
    Resume,
    Close,
)
