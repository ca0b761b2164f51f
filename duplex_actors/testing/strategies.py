"""Hypothesis strategies for duplex sessions: audio, fenced commands, engine behaviour.

Everything here generates *values*; nothing touches a runtime. Three families:

* audio: :func:`pcm16_chunks` (20-200 ms of 16 kHz mono pcm16: silence, tone or noise).
  Samples are synthesised from a few drawn parameters, not drawn byte by byte, so a chunk costs
  hypothesis a handful of choices and shrinks to silence.
* commands: :func:`commands` draws ready-made :class:`~duplex_actors.core.commands.Command`
  objects with explicit epochs. Because a program is generated before it runs, its fences
  cannot know the session's epoch at send time: :func:`command_programs` therefore draws
  :class:`FencedCommand` steps that carry a *fence choice* (none, current, stale, ahead) and
  are bound to a concrete epoch with :meth:`FencedCommand.bind` when sent.
* engine: :func:`engine_scripts` draws :class:`~duplex_actors.Script` instances (latencies,
  tokens, audio, listen/speak, ``fail_after``/``fail_mode`` failures, hangs); a
  :class:`ScriptBook` hands them out per request so one ScriptedEngine plays a different
  script for every model turn. :func:`engine_outputs` draws synthetic outputs for one request
  id, for driving the sans-IO core directly.
"""

from __future__ import annotations

import enum
import functools
import math
import random
import struct
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypedDict, Unpack

import attrs
from hypothesis import strategies as st

from ..core import commands as cmd
from ..core.conversation import ContentPart, Item
from ..core.engine_io import (
    Aborted,
    AudioPacket,
    Decision,
    EngineFailure,
    EngineOutput,
    ModelTurnRequest,
    TextDelta,
    TurnDone,
)
from ..engines.scripted import Script

SAMPLE_RATE = 16000
AUDIO_KINDS = ("silence", "tone", "noise")

# --- audio ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=512)
def _synthesise(kind: str, ms: int, sample_rate: int, freq: int, amplitude: int, seed: int) -> bytes:
    n = sample_rate * ms // 1000
    if kind == "silence" or amplitude == 0:
        return bytes(2 * n)
    if kind == "tone":
        step = 2 * math.pi * freq / sample_rate
        samples = [int(amplitude * math.sin(step * i)) for i in range(n)]
        return struct.pack(f"<{n}h", *samples)
    # Noise: seeded random bytes, scaled down by shifting for quieter amplitudes.
    raw = random.Random(seed).randbytes(2 * n)
    shift = max(0, 15 - amplitude.bit_length())
    if not shift:
        return raw
    noise = struct.unpack(f"<{n}h", raw)
    return struct.pack(f"<{n}h", *(x >> shift for x in noise))


def pcm16_chunks(
    min_ms: int = 20, max_ms: int = 200, *, sample_rate: int = SAMPLE_RATE, kinds: Sequence[str] = AUDIO_KINDS
) -> st.SearchStrategy[bytes]:
    """Chunks of mono pcm16 little-endian audio, ``min_ms``..``max_ms`` long.

    ``kinds`` chooses among ``silence`` (all zeros), ``tone`` (a sine, 80-4000 Hz) and
    ``noise`` (uniform, seeded); amplitudes span quiet to near full scale.
    """
    if not 0 < min_ms <= max_ms:
        raise ValueError("need 0 < min_ms <= max_ms")
    unknown = set(kinds) - set(AUDIO_KINDS)
    if unknown or not kinds:
        raise ValueError(f"kinds must be among {AUDIO_KINDS}, got {kinds!r}")
    return st.builds(
        _synthesise,
        st.sampled_from(tuple(kinds)),
        st.integers(min_ms, max_ms),
        st.just(sample_rate),
        st.integers(80, 4000),
        st.sampled_from((0, 300, 3000, 12000, 32000)),
        st.integers(0, 2**16),
    )


#: The common case, under the name the docs use.
audio_chunks = pcm16_chunks


# --- fences and commands --------------------------------------------------------------------


class FenceChoice(str, enum.Enum):
    """How a command names its epoch, relative to the session's epoch at send time."""

    NONE = "none"  # no fence: always current
    CURRENT = "current"  # the session's epoch: accepted
    STALE = "stale"  # an older epoch: refused with StaleFence (falls back to current at 0)
    AHEAD = "ahead"  # a newer epoch than the session has

    def resolve(self, epoch: int, *, back: int = 1, ahead: int = 1) -> int | None:
        if self is FenceChoice.NONE:
            return None
        if self is FenceChoice.STALE:
            return max(epoch - back, 0)
        if self is FenceChoice.AHEAD:
            return epoch + ahead
        return epoch


def fences(*, stale: bool = True, ahead: bool = False) -> st.SearchStrategy[FenceChoice]:
    """Fence choices; mostly valid, ``stale`` (and optionally ``ahead``) ones mixed in."""
    choices = [FenceChoice.NONE, FenceChoice.CURRENT]
    if stale:
        choices.append(FenceChoice.STALE)
    if ahead:
        choices.append(FenceChoice.AHEAD)
    return st.sampled_from(choices)


COMMAND_KINDS = (
    "append",
    "commit",
    "clear",
    "create_response",
    "barge_in",
    "cancel",
    "cancel_other",
    "heartbeat",
    "close",
    "speech_started",
    "speech_stopped",
    "create_item",
    "delete_item",
    "retrieve_item",
)

#: Item ids programs create, delete and retrieve (a small pool, so they collide and miss).
ITEM_IDS = tuple(f"item_kit_{n}" for n in range(4))


@attrs.frozen(slots=True)
class FencedCommand:
    """One step of a command program: a command whose epoch is chosen when it is sent."""

    kind: str
    fence: FenceChoice = FenceChoice.NONE
    pcm: bytes = attrs.field(default=b"", repr=lambda b: f"<{len(b)} bytes>")
    audio_ms: int = 0
    stale_by: int = 1
    item: int = 0  # which of ITEM_IDS an item command names

    def bind(self, epoch: int, event_id: str | None = None) -> cmd.Command:
        """The concrete command for a session whose current epoch is ``epoch``."""
        fields: _CommandFields = {
            "epoch": self.fence.resolve(epoch, back=self.stale_by),
            "event_id": event_id,
        }
        return make_command(self.kind, pcm=self.pcm, audio_ms=self.audio_ms, item=self.item, **fields)

    @property
    def lane(self) -> cmd.Lane:
        return _COMMAND_TYPES[self.kind].LANE


_COMMAND_TYPES: dict[str, type[cmd.Command]] = {
    "append": cmd.AppendAudio,
    "commit": cmd.CommitInput,
    "clear": cmd.ClearInput,
    "create_response": cmd.CreateResponse,
    "barge_in": cmd.BargeIn,
    "cancel": cmd.CancelResponse,
    "cancel_other": cmd.CancelResponse,
    "heartbeat": cmd.Heartbeat,
    "close": cmd.Close,
    "create_item": cmd.CreateItem,
    "delete_item": cmd.DeleteItem,
    "retrieve_item": cmd.RetrieveItem,
    "speech_started": cmd.SpeechStartedSignal,
    "speech_stopped": cmd.SpeechStoppedSignal,
}


class _CommandFields(TypedDict, total=False):
    """The fields every command has (:class:`~duplex_actors.core.commands.Command`)."""

    event_id: str | None
    epoch: int | None


def make_command(
    kind: str, *, pcm: bytes = b"", audio_ms: int = 0, item: int = 0, **fields: Unpack[_CommandFields]
) -> cmd.Command:
    """Build the command of ``kind`` (one of :data:`COMMAND_KINDS`) with common fields."""
    item_id = ITEM_IDS[item % len(ITEM_IDS)]
    if kind == "create_item":
        text = Item(id=item_id, role="user", content=(ContentPart(type="input_text", text="hello"),))
        return cmd.CreateItem(item=text, **fields)
    if kind == "delete_item":
        return cmd.DeleteItem(item_id=item_id, **fields)
    if kind == "retrieve_item":
        return cmd.RetrieveItem(item_id=item_id, **fields)
    if kind == "append":
        return cmd.AppendAudio(pcm=pcm, **fields)
    if kind == "speech_started":
        return cmd.SpeechStartedSignal(audio_ms=audio_ms, **fields)
    if kind == "speech_stopped":
        return cmd.SpeechStoppedSignal(audio_ms=audio_ms, **fields)
    if kind == "cancel_other":  # names a response that is never the active one: refused
        return cmd.CancelResponse(response_id="resp_not_the_active_one", **fields)
    return _COMMAND_TYPES[kind](**fields)


_DEFAULT_WEIGHTS = {
    "append": 6,
    "commit": 3,
    "clear": 1,
    "create_response": 1,
    "barge_in": 2,
    "cancel": 1,
    "cancel_other": 1,
    "heartbeat": 1,
    "create_item": 1,
    "delete_item": 1,
    "retrieve_item": 1,
    "close": 1,
    "speech_started": 1,
    "speech_stopped": 1,
}


def fenced_commands(
    kinds: Sequence[str] = tuple(_DEFAULT_WEIGHTS),
    *,
    audio: st.SearchStrategy[bytes] | None = None,
    fence: st.SearchStrategy[FenceChoice] | None = None,
) -> st.SearchStrategy[FencedCommand]:
    """One :class:`FencedCommand` of one of ``kinds`` (appends weighted up, as in real traffic)."""
    unknown = set(kinds) - set(COMMAND_KINDS)
    if unknown:
        raise ValueError(f"unknown command kinds {sorted(unknown)}")
    audio = audio if audio is not None else pcm16_chunks()
    fence = fence if fence is not None else fences()
    weighted = [k for k in kinds for _ in range(_DEFAULT_WEIGHTS.get(k, 1))]
    return st.builds(
        FencedCommand,
        kind=st.sampled_from(weighted),
        fence=fence,
        pcm=audio,
        audio_ms=st.integers(0, 60_000),
        stale_by=st.integers(1, 3),
        item=st.integers(0, len(ITEM_IDS) - 1),
    ).map(lambda c: c if c.kind == "append" else attrs.evolve(c, pcm=b""))


class _FencedCommandOptions(TypedDict, total=False):
    """The keywords :func:`command_programs` passes on to :func:`fenced_commands`."""

    audio: st.SearchStrategy[bytes] | None
    fence: st.SearchStrategy[FenceChoice] | None


def command_programs(
    kinds: Sequence[str] = tuple(_DEFAULT_WEIGHTS),
    *,
    min_size: int = 0,
    max_size: int = 30,
    **kw: Unpack[_FencedCommandOptions],
) -> st.SearchStrategy[list[FencedCommand]]:
    """Programs (lists) of fenced commands; bind each step to the live epoch when sending."""
    return st.lists(fenced_commands(kinds, **kw), min_size=min_size, max_size=max_size)


def commands(
    kinds: Sequence[str] = tuple(_DEFAULT_WEIGHTS),
    *,
    epochs: st.SearchStrategy[int | None] = st.none() | st.integers(0, 4),
    audio: st.SearchStrategy[bytes] | None = None,
) -> st.SearchStrategy[cmd.Command]:
    """Concrete commands with explicit (possibly stale) epochs, for fuzzing a session directly."""
    return st.builds(
        lambda step, epoch: make_command(step.kind, pcm=step.pcm, audio_ms=step.audio_ms, epoch=epoch),
        fenced_commands(kinds, audio=audio),
        epochs,
    )


# --- engine behaviour -----------------------------------------------------------------------

_WORDS = ("Hello", " there", ",", " how", " can", " I", " help", "?", " mm", "", " ok")


def engine_scripts(
    *,
    max_latency_s: float = 0.003,
    max_tokens: int = 6,
    max_packets: int = 4,
    failures: bool = True,
    hangs: bool = True,
    decisions: bool = True,
) -> st.SearchStrategy[Script]:
    """:class:`~duplex_actors.Script` instances for the ScriptedEngine.

    Latencies are drawn up to ``max_latency_s`` (0 is common: it is the racy case). With
    ``failures`` some scripts fail after a number of outputs, by an ``EngineFailure`` output or
    by raising; with ``hangs`` some never finish (the runtime must still abort them); with
    ``decisions`` unit turns may decide to keep listening.
    """
    latency = st.one_of(st.just(0.0), st.floats(0.0, max_latency_s, allow_nan=False))
    return st.builds(
        Script,
        tokens=st.lists(st.sampled_from(_WORDS), max_size=max_tokens).map(tuple),
        audio_packets=st.integers(0, max_packets),
        packet_ms=st.sampled_from((20, 40, 100)),
        first_latency_s=latency,
        token_latency_s=latency,
        packet_latency_s=latency,
        speak=st.booleans() if decisions else st.just(True),
        fail_after=(st.none() | st.integers(0, 6)) if failures else st.none(),
        fail_mode=st.sampled_from(("output", "raise")),
        hang_after=(st.none() | st.none() | st.integers(0, 4)) if hangs else st.none(),
        report_metrics=st.booleans(),
    )


class ScriptBook:
    """A script source for :class:`~duplex_actors.ScriptedEngine`: one script per request.

    Scripts are played in submission order; when the book runs out, ``default`` plays. Tests
    may ``push`` more scripts while the engine runs (thread-safe: a state machine rule pushes
    from its thread while the engine reads from the event loop's). ``played`` records which
    script each request id got.
    """

    def __init__(self, scripts: Sequence[Script] = (), default: Script = Script()) -> None:
        self._queue: deque[Script] = deque(scripts)
        self.default = default
        self.played: dict[str, Script] = {}
        self._lock = threading.Lock()

    def push(self, *scripts: Script) -> None:
        with self._lock:
            self._queue.extend(scripts)

    def __call__(self, request: ModelTurnRequest) -> Script:
        with self._lock:
            script = self._queue.popleft() if self._queue else self.default
            self.played[request.request_id] = script
        return script

    def __repr__(self) -> str:
        return f"ScriptBook({list(self._queue)!r}, default={self.default!r})"


class _ScriptOptions(TypedDict, total=False):
    """The keywords :func:`script_books` passes on to :func:`engine_scripts`."""

    max_latency_s: float
    max_tokens: int
    max_packets: int
    failures: bool
    hangs: bool
    decisions: bool


def script_books(
    min_size: int = 0, max_size: int = 8, **kw: Unpack[_ScriptOptions]
) -> st.SearchStrategy[ScriptBook]:
    """A :class:`ScriptBook` of drawn scripts (``kw`` go to :func:`engine_scripts`)."""
    return st.builds(ScriptBook, st.lists(engine_scripts(**kw), min_size=min_size, max_size=max_size))


@attrs.frozen(slots=True)
class OutputSpec:
    """An engine output without its request id: ``spec(request_id)`` builds it.

    Rules that only learn the live request id while running draw specs from a strategy built
    once (cheap), instead of building a new strategy per request id.
    """

    kind: str  # decision | text | audio | done | failure | aborted
    speak: bool = True
    text: str = ""
    tokens: int = 1
    samples: int = 320
    transcript: str = ""
    reason: str = "completed"

    def __call__(self, request_id: str, sample_rate: int = SAMPLE_RATE) -> EngineOutput:
        k = self.kind
        if k == "decision":
            return Decision(request_id, self.speak)
        if k == "text":
            return TextDelta(request_id, self.text, self.tokens)
        if k == "audio":
            return AudioPacket(request_id, bytes(2 * self.samples), sample_rate, self.transcript)
        if k == "done":
            return TurnDone(request_id, self.reason)
        if k == "failure":
            return EngineFailure(request_id, "synthetic failure")
        return Aborted(request_id)


_NON_TERMINAL_SPECS = st.one_of(
    st.builds(OutputSpec, st.just("decision"), speak=st.booleans()),
    st.builds(OutputSpec, st.just("text"), text=st.sampled_from(_WORDS), tokens=st.integers(0, 3)),
    st.builds(OutputSpec, st.just("text"), text=st.sampled_from(_WORDS), tokens=st.just(1)),
    st.builds(
        OutputSpec,
        st.just("audio"),
        samples=st.sampled_from((320, 640, 1600)),
        transcript=st.sampled_from(("", " hi")),
    ),
)
_TERMINAL_SPECS = st.one_of(
    st.builds(OutputSpec, st.just("done"), reason=st.sampled_from(("completed", "completed", "length"))),
    st.builds(OutputSpec, st.just("failure")),
    st.builds(OutputSpec, st.just("aborted")),
)
_ALL_SPECS = st.one_of(_NON_TERMINAL_SPECS, _NON_TERMINAL_SPECS, _TERMINAL_SPECS)


def engine_output_specs(*, terminal: bool | None = None) -> st.SearchStrategy[OutputSpec]:
    """:class:`OutputSpec` values: ``terminal=True`` only terminals (TurnDone, EngineFailure,
    Aborted), ``False`` only decisions, text and audio, ``None`` both (non-terminals weighted up).
    A ``Decision(speak=False)`` counts as non-terminal here: for a committed turn it is a
    protocol error the session must refuse."""
    if terminal is None:
        return _ALL_SPECS
    return _TERMINAL_SPECS if terminal else _NON_TERMINAL_SPECS


def engine_outputs(
    request_id: str, *, terminal: bool | None = None, sample_rate: int = SAMPLE_RATE
) -> st.SearchStrategy[EngineOutput]:
    """Synthetic outputs an engine could send for ``request_id`` (see :func:`engine_output_specs`)."""
    return engine_output_specs(terminal=terminal).map(lambda spec: spec(request_id, sample_rate))


def scripted_source(book: ScriptBook) -> Callable[[ModelTurnRequest], Script]:
    """For symmetry with ``ScriptedEngine(script_or_callable)``: a ScriptBook is already one."""
    return book
