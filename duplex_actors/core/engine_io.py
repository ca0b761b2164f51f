"""What a session sends to the shared engine, and what the engine sends back.

Every output names the request it belongs to (``request_id``, derived from the fence), so the
router can tell current output from stale output without any engine cooperation. A request
ends with exactly one *terminal* output: ``TurnDone``, ``EngineFailure`` or ``Aborted``. The
engine actor guarantees that even when a backend forgets (it synthesises the terminal).
"""

from __future__ import annotations

import enum
from typing import Any, Union

import attrs

from ..errors import InvalidSampling
from .conversation import Item
from .fence import Fence


class TurnKind(enum.Enum):
    """Why a request was made: a response to the user, or a model-native unit's listen/speak decision."""

    #: The user's turn is committed (client commit or server VAD): produce a response.
    RESPONSE = "response"
    #: Model-native duplex: one audio unit; the model first decides listen or speak.
    UNIT = "unit"


def _short_pretty(self: object, printer: Any, cycle: bool) -> None:
    # hypothesis (and IPython) print a failing example with this: the short repr (audio as its
    # length) rather than every byte of it.
    printer.text(repr(self))


#: The range every engine accepts for each sampling knob (inclusive unless said otherwise).
#: Checked when the overrides are built, i.e. at the wire: a value outside it would otherwise
#: reach an engine's batch and could fail the batch neighbours too (a seed past 64 bits fails
#: torch's manual_seed, a NaN temperature poisons a tensor).
SAMPLING_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_k": (0, 100_000),
    "top_p": (0.0, 1.0),  # exclusive of 0: nothing would be left to sample
    "max_tokens": (1, 32_768),
    "seed": (0, 2**63 - 1),
}

#: How fast an engine may be asked to speak, 1.0 being its natural pace (OpenAI's
#: audio.output.speed range).
SPEED_RANGE = (0.25, 1.5)


def _in_range(instance: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is None:
        return
    name = attribute.name
    low, high = SAMPLING_RANGES[name]
    integral = isinstance(low, int)
    wrong_type = isinstance(value, bool) or not isinstance(value, (int, float))
    if wrong_type or (integral and not isinstance(value, int)):
        raise InvalidSampling(
            name, f"must be {'an integer' if integral else 'a number'}, not {type(value).__name__}"
        )
    if value != value or not (low <= value <= high) or (name == "top_p" and value == 0.0):
        bounds = f"({low}, {high}]" if name == "top_p" else f"[{low}, {high}]"
        raise InvalidSampling(name, f"must be in {bounds}, got {value!r}")


@attrs.frozen(slots=True)
class SamplingOverrides:
    """Per-session sampling knobs. ``None`` means "the engine's default"; adapters merge these
    onto a copy of their defaults and never mutate the engine's own. Building one with a value
    outside :data:`SAMPLING_RANGES` raises :class:`~duplex_actors.errors.InvalidSampling`."""

    temperature: float | None = attrs.field(default=None, validator=_in_range)
    top_k: int | None = attrs.field(default=None, validator=_in_range)
    top_p: float | None = attrs.field(default=None, validator=_in_range)
    max_tokens: int | None = attrs.field(default=None, validator=_in_range)
    seed: int | None = attrs.field(default=None, validator=_in_range)


@attrs.frozen(slots=True)
class FunctionTool:
    """A function the client declared in ``session.update`` (``tools``): the model may call it.

    ``parameters`` is the JSON schema as JSON text, so the request stays frozen and hashable."""

    name: str
    description: str = ""
    parameters: str = "{}"


@attrs.frozen(slots=True)
class FunctionResult:
    """What a function returned: the client's ``function_call_output`` item for ``call_id``.
    The next model turn receives it, so the model can answer with the result."""

    call_id: str
    output: str
    #: The function's name, when the session still knows which call this answers.
    name: str | None = None


@attrs.frozen(slots=True)
class ModelTurnRequest:
    """One request to the engine: its id (derived from its :class:`Fence`), the user's audio for the
    turn, the conversation so far and the response's settings.
    """

    request_id: str
    fence: Fence
    kind: TurnKind
    #: The user's audio for this turn (or unit): pcm16 little-endian mono.
    audio: bytes = attrs.field(repr=lambda b: f"<{len(b)} bytes>")
    sample_rate: int = 16000
    #: The rate the listener plays audio at (a Realtime client's output format), or None for
    #: ``sample_rate``. A hint: an engine that can synthesise at any rate makes its audio at
    #: this one, so the edge sends it as it is, with no conversion on the first packet's path.
    #: Packets carry their own rate, and the edge converts whatever rate arrives.
    output_sample_rate: int | None = None
    #: How fast to speak, 1.0 being the voice's natural pace (the session's audio.output.speed).
    #: A hint, as the rate is: an engine whose voice cannot change pace speaks at its own.
    speed: float = 1.0
    instructions: str | None = None
    sampling: SamplingOverrides = SamplingOverrides()
    #: Whether the engine should also speak (talker) or only produce text.
    modalities: tuple[str, ...] = ("text", "audio")
    #: Runtime clock time the request was handed to the engine.
    submitted_at: float = 0.0
    #: Functions the model may call this turn, and how: "auto", "none", "required" or a
    #: function's name (the client's ``tool_choice``).
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: str = "auto"
    #: Function outputs the client sent since the previous model turn, oldest first.
    function_results: tuple[FunctionResult, ...] = ()
    #: Words the user (or a system/developer message, or a tool's output) added to the
    #: conversation since the last response, in order: conversation.item.create's text input.
    input_text: str = ""
    #: The conversation before those words, oldest first: earlier user and assistant messages,
    #: function calls and their outputs (frozen items, shared with the conversation, not
    #: copied). Only for an engine that reads it (``EngineCapabilities.reads_history``), and
    #: only for a response on the conversation (one on its own ``response.input`` has none).
    history: tuple[Item, ...] = attrs.field(default=(), repr=lambda h: f"<{len(h)} items>")
    #: Whom this request's work counts against when a backend shares a resource between
    #: requests (decode slots, the speech synthesiser): an API key's digest or a client
    #: address, set by the transport. None: the request's session is a tenant of its own.
    tenant: str | None = None

    _repr_pretty_ = _short_pretty

    @property
    def share_tenant(self) -> str:
        """The tenant to share by: :attr:`tenant`, else the session (core/fair_share.py)."""
        return self.tenant or self.fence.session_id

    @property
    def audio_out_rate(self) -> int:
        """The rate to make this turn's audio at: the listener's, else the session's."""
        return self.output_sample_rate or self.sample_rate


# --- outputs --------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class Decision:
    """Listen/speak decision. For RESPONSE turns engines emit ``speak=True`` when the response
    begins; for UNIT turns ``speak=False`` is terminal for that unit."""

    request_id: str
    speak: bool
    produced_at: float = 0.0


@attrs.frozen(slots=True)
class TextDelta:
    """Engine output: text the model produced for a request."""

    request_id: str
    text: str
    token_count: int = 1
    produced_at: float = 0.0


@attrs.frozen(slots=True)
class AudioPacket:
    """Engine output: a packet of the response's audio (pcm16) and the words it speaks."""

    request_id: str
    pcm: bytes = attrs.field(repr=lambda b: f"<{len(b)} bytes>")
    sample_rate: int = 16000
    #: The words this packet speaks, for response.output_audio_transcript.delta.
    transcript: str = ""
    produced_at: float = 0.0

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / 2 / self.sample_rate

    _repr_pretty_ = _short_pretty


@attrs.frozen(slots=True)
class FunctionCall:
    """The model calls one of the request's tools. ``arguments`` is a JSON text (an object).

    Not terminal: a response may call several functions and say something as well; the client
    runs the function and sends its output as a ``function_call_output`` item, and the next
    model turn (``response.create``) gets it in ``ModelTurnRequest.function_results``."""

    request_id: str
    call_id: str
    name: str
    arguments: str = "{}"
    produced_at: float = 0.0
    #: Tokens the model generated to write the call (counted in the response's usage).
    token_count: int = 0


@attrs.frozen(slots=True)
class EngineMetrics:
    """Figures an engine measured itself (e.g. vLLM's RequestStateStats), cumulative for the
    request. ``source`` names the engine so the response metrics can say where they came from."""

    source: str
    first_token_s: float | None = None
    token_count: int = 0
    inter_token_s: tuple[float, ...] = ()


def _count(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} must be a count (an int >= 0), got {value!r}")


@attrs.frozen(slots=True)
class InputUsage:
    """What the model read for one turn (its prompt), in the engine's own tokens: the usage
    a response reports as ``input_tokens``. Engines count what they really fed the model, not
    an estimate of the conversation."""

    text_tokens: int = attrs.field(default=0, validator=_count)
    audio_tokens: int = attrs.field(default=0, validator=_count)
    #: Of those, how many came from a cache rather than being computed (vLLM's prefix cache).
    cached_tokens: int = attrs.field(default=0, validator=_count)

    @property
    def tokens(self) -> int:
        return self.text_tokens + self.audio_tokens


@attrs.frozen(slots=True)
class TurnDone:
    """Terminal: the model turn ended normally (``reason``: completed, length, listen;
    "length" only when the token limit the turn ran under was reached)."""

    request_id: str
    reason: str = "completed"
    metrics: EngineMetrics | None = None
    produced_at: float = 0.0
    #: The prompt the model read for this turn (None: the engine does not say).
    input: InputUsage | None = None


@attrs.frozen(slots=True)
class EngineFailure:
    """Terminal: the engine failed this request."""

    request_id: str
    message: str
    retryable: bool = True
    produced_at: float = 0.0


@attrs.frozen(slots=True)
class Aborted:
    """Terminal: the request was aborted (barge-in, cancel, close) and will produce nothing."""

    request_id: str
    produced_at: float = 0.0


EngineOutput = Union[Decision, TextDelta, AudioPacket, FunctionCall, TurnDone, EngineFailure, Aborted]
TERMINAL_OUTPUTS = (TurnDone, EngineFailure, Aborted)


def forced_tool(request: ModelTurnRequest) -> str | None:
    """The function a request *forces* the model to call, if any: ``tool_choice`` names one of
    its tools, or is "required" (then the first tool). A follow-up turn (it carries function
    outputs) forces nothing, so a forced call is not repeated forever."""
    if request.kind is not TurnKind.RESPONSE or not request.tools or request.function_results:
        return None
    names = [t.name for t in request.tools]
    if request.tool_choice in names:
        return request.tool_choice
    return names[0] if request.tool_choice == "required" else None


def is_terminal(output: EngineOutput, kind: TurnKind) -> bool:
    """Whether ``output`` ends the stream of a request of this ``kind``: the one rule the
    engine actor, the session core and the test kit share. A listen decision ends a UNIT
    request (the model chose not to speak for that unit); for a RESPONSE request it is not an
    end, so the stream must still close with a real terminal."""
    if isinstance(output, TERMINAL_OUTPUTS):
        return True
    return kind is TurnKind.UNIT and isinstance(output, Decision) and not output.speak
