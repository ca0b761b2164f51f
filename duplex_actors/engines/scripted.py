"""ScriptedEngine: a deterministic engine for tests and runtime benchmarks.

Each request plays a :class:`Script`: an optional decision, text tokens, audio packets, with
configurable latencies, and optional failure or hang. Function tools follow one rule (see
:meth:`ScriptedEngine.tool_call_for`): a request that offers tools and carries no function
output calls one tool; a request carrying function outputs answers with the outputs followed
by the script's tokens, so a test can see the output reached the engine. A script may be fixed or chosen per
request by a function, so property tests can generate engine behaviour. It records what it was
asked (``submitted``, ``aborted``, ``active``) so tests can assert that nothing reached the
engine after close and that aborted requests were freed.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Union

import anyio
import attrs

from ..core.engine_io import (
    AudioPacket,
    Decision,
    EngineFailure,
    EngineMetrics,
    EngineOutput,
    FunctionCall,
    InputUsage,
    ModelTurnRequest,
    TextDelta,
    TurnDone,
    TurnKind,
)
from ..errors import EngineFailed
from .base import EngineCapabilities


@attrs.frozen(slots=True)
class Script:
    """What the scripted engine says and how fast: its tokens, audio packets and latencies."""

    tokens: tuple[str, ...] = ("Hello", " there", ",", " how", " can", " I", " help", "?")
    audio_packets: int = 3
    packet_ms: int = 100
    #: The packets' rate; None: the rate the request asks for (``audio_out_rate``), as a
    #: speaking engine that synthesises at any rate does.
    sample_rate: int | None = None
    first_latency_s: float = 0.0
    token_latency_s: float = 0.0
    packet_latency_s: float = 0.0
    #: Whether the latencies add up from the request's start, as a real engine's do: it decodes
    #: at its own rate in its own thread or process, so a consumer that lags receives several
    #: outputs at once and the answer still ends on time. False (the default): each latency is
    #: waited after the previous output was taken, so every late wake-up of the event loop
    #: running this engine stretches the whole answer (what tests of slow consumers rely on).
    paced_from_start: bool = False
    #: Each packet its own bytes, as a real engine's are. False: every packet of a length and
    #: rate is one cached tone, so what a server holds of many packets does not show in its
    #: memory (benches of held audio need this).
    fresh_packets: bool = False
    #: For UNIT turns: speak or keep listening.
    speak: bool = True
    #: Fail the request after this many outputs: ``"output"`` yields EngineFailure, ``"raise"``
    #: raises out of the stream (the engine actor must turn that into a terminal).
    fail_after: int | None = None
    fail_mode: str = "output"
    #: Never finish (a hung engine), after this many outputs.
    hang_after: int | None = None
    #: Report engine-side metrics on TurnDone (as vLLM does).
    report_metrics: bool = False
    #: The JSON arguments of a function call made by the tool rule; None: an example built from
    #: the tool's parameter schema (see :func:`example_arguments`).
    tool_arguments: str | None = None


ScriptSource = Union[Script, Callable[[ModelTurnRequest], Script]]


_EXAMPLES = {
    "string": "example",
    "integer": 1,
    "number": 1,
    "boolean": True,
    "array": [],
    "object": {},
    "null": None,
}


def example_arguments(parameters: str) -> str:
    """Arguments that satisfy a JSON schema's required properties, deterministically: the
    first ``enum`` value, else a fixed example per type. A real client validates the call's
    arguments against its function's signature before running it, so ``{}`` would be refused
    by any function with a required parameter."""
    try:
        schema = json.loads(parameters)
    except ValueError:
        return "{}"
    if not isinstance(schema, dict):
        return "{}"
    props = schema.get("properties")
    props = props if isinstance(props, dict) else {}
    required = schema.get("required")
    args = {}
    for name in required if isinstance(required, list) else ():
        if not isinstance(name, str):
            continue  # the client's schema, not JSON Schema: a required name is a string
        found = props.get(name)
        prop: dict[str, Any] = found if isinstance(found, dict) else {}
        enum = prop.get("enum")
        if isinstance(enum, list) and enum:
            args[name] = enum[0]
        else:
            # A schema is the client's: a type may be a list (its first name) or anything else.
            kind = prop.get("type", "string")
            if isinstance(kind, list):
                kind = next((k for k in kind if isinstance(k, str)), "string")
            args[name] = _EXAMPLES.get(kind, "example") if isinstance(kind, str) else "example"
    return json.dumps(args)


#: The scripted engine's stand-in tokenizer: one audio token per this many ms of audio.
AUDIO_TOKEN_MS = 100


def input_usage(request: ModelTurnRequest) -> InputUsage:
    """What the scripted engine reads of a request, by a fixed rule a test can recompute: one
    text token per whitespace-separated word of its instructions, text input and function
    outputs, one audio token per started ``AUDIO_TOKEN_MS`` of its audio."""
    # A plain loop rather than generators: every scripted turn of the benchmarks asks this.
    words = len((request.instructions or "").split()) + len(request.input_text.split())
    for result in request.function_results:
        words += len(result.output.split())
    audio_ms = len(request.audio) / 2 / request.sample_rate * 1000 if request.sample_rate else 0.0
    return InputUsage(text_tokens=words, audio_tokens=math.ceil(audio_ms / AUDIO_TOKEN_MS))


def _tone(ms: int, rate: int, freq: float = 220.0) -> bytes:
    n = rate * ms // 1000
    samples = (int(3000 * math.sin(2 * math.pi * freq * i / rate)) for i in range(n))
    return b"".join(s.to_bytes(2, "little", signed=True) for s in samples)


class ScriptedEngine:
    """A deterministic engine for tests and demos without a model: plays a :class:`Script` (or one
    chosen per request) with the given latencies, and honours aborts.
    """

    name = "scripted"

    def __init__(
        self,
        script: ScriptSource = Script(),
        *,
        produces_audio: bool = True,
        record: bool = True,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    ) -> None:
        self._script = script
        #: How the script's latencies are waited out. The default is the event loop's timer,
        #: which asyncio rounds up to whole milliseconds past whatever the loop is busy with
        #: when it next waits; the wire bench passes a thread's sleep instead, which wakes the
        #: loop like a real engine's output does (see bench/wire_bench.py).
        self._sleep = sleep
        self.capabilities = EngineCapabilities(
            model_native=True, produces_audio=produces_audio, unit_samples=16000, max_concurrency=1 << 20
        )
        #: Keep every request (with its audio) in ``submitted`` and every abort in ``aborted``
        #: for tests to assert on. A long benchmark passes False: the lists would otherwise
        #: keep each request's audio alive and count as the runtime's memory.
        self.record = record
        self.submitted: list[ModelTurnRequest] = []
        self.aborted: list[str] = []
        self.active: set[str] = set()
        self.started = 0
        self.closed = 0
        self._packets: dict[tuple[int, int], bytes] = {}

    def script_for(self, request: ModelTurnRequest) -> Script:
        return self._script(request) if callable(self._script) else self._script

    @staticmethod
    def tool_call_for(request: ModelTurnRequest) -> str | None:
        """The tool rule: which function this request calls, if any. A RESPONSE turn that
        offers tools (``tool_choice`` not "none") and carries no function output calls the
        tool ``tool_choice`` names, else the first declared one. A turn that carries function
        outputs is the follow-up: it answers instead of calling again."""
        if request.kind is not TurnKind.RESPONSE or not request.tools or request.function_results:
            return None
        if request.tool_choice == "none":
            return None
        names = [t.name for t in request.tools]
        return request.tool_choice if request.tool_choice in names else names[0]

    async def start(self) -> None:
        self.started += 1

    async def aclose(self) -> None:
        self.closed += 1

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        if self.record:
            self.aborted.append(request_id)
        self.active.discard(request_id)

    def _packet(self, ms: int, rate: int) -> bytes:
        key = (ms, rate)
        if key not in self._packets:
            self._packets[key] = _tone(ms, rate)
        return self._packets[key]

    async def generate(self, request: ModelTurnRequest) -> AsyncGenerator[EngineOutput, None]:
        script = self.script_for(request)
        rid = request.request_id
        rate = script.sample_rate or request.audio_out_rate
        if self.record:
            self.submitted.append(request)
        self.active.add(rid)
        emitted = 0
        first_token_at = None
        token_times: list[float] = []

        due = time.perf_counter()  # when the next output is due, with paced_from_start

        async def pause(seconds: float) -> None:
            nonlocal due
            if seconds <= 0:
                return
            if not script.paced_from_start:
                await self._sleep(seconds)
                return
            due += seconds
            wait = due - time.perf_counter()
            if wait > 0:  # already overdue (the loop was busy): no wait, as a real engine's queue
                await self._sleep(wait)

        def budget_left() -> bool:
            return script.fail_after is None or emitted < script.fail_after

        try:
            await pause(script.first_latency_s)
            if request.kind is TurnKind.UNIT and not script.speak:
                yield Decision(rid, speak=False, produced_at=time.perf_counter())
                return
            yield Decision(rid, speak=True, produced_at=time.perf_counter())
            emitted += 1
            tool = self.tool_call_for(request)
            if tool is not None:
                # A call-only response, as Realtime models answer when they use a tool.
                # Deterministic and unique: the request id names session, epoch and turn.
                call_id = "call_" + hashlib.blake2s(rid.encode(), digest_size=8).hexdigest()
                arguments = script.tool_arguments
                if arguments is None:
                    schema = next(t.parameters for t in request.tools if t.name == tool)
                    arguments = example_arguments(schema)
                yield FunctionCall(rid, call_id, tool, arguments, produced_at=time.perf_counter())
                yield TurnDone(rid, "completed", produced_at=time.perf_counter(), input=input_usage(request))
                return
            tokens = script.tokens if "text" in request.modalities else ()
            # The function outputs come first, so the first audio packet's transcript carries
            # them too (audio-only clients read the transcript, which covers only as many
            # tokens as there are packets).
            if tokens and request.function_results:
                tokens = tuple(f"{result.output} " for result in request.function_results) + tokens
            packets = script.audio_packets if "audio" in request.modalities else 0
            # Interleave text and audio the way a thinker + talker pipeline does.
            steps = max(len(tokens), packets)
            # The request's token limit (a response's or session's max_output_tokens) ends the
            # answer where a real engine's would: at that many tokens, and its speech with
            # them, reason "length" (the response is then incomplete).
            limit = request.sampling.max_tokens
            cut = False
            if limit is not None and len(tokens) > limit:
                cut = True
                tokens = tokens[:limit]
                steps = limit
            for i in range(steps):
                if script.hang_after is not None and emitted >= script.hang_after:
                    await anyio.sleep_forever()
                if not budget_left():
                    break
                if i < len(tokens):
                    await pause(script.token_latency_s)
                    now = time.perf_counter()
                    first_token_at = first_token_at or now
                    token_times.append(now)
                    yield TextDelta(rid, tokens[i], 1, produced_at=now)
                    emitted += 1
                if i < packets and budget_left():
                    await pause(script.packet_latency_s)
                    word = tokens[i] if i < len(tokens) else ""
                    pcm = self._packet(script.packet_ms, rate)
                    yield AudioPacket(
                        rid,
                        bytes(bytearray(pcm)) if script.fresh_packets else pcm,
                        rate,
                        transcript=word,
                        produced_at=time.perf_counter(),
                    )
                    emitted += 1
            if not budget_left():
                if script.fail_mode == "raise":
                    raise EngineFailed(f"scripted failure after {script.fail_after} outputs")
                yield EngineFailure(rid, f"scripted failure after {script.fail_after} outputs")
                return
            metrics = None
            if script.report_metrics:
                itl = tuple(b - a for a, b in zip(token_times, token_times[1:]))
                metrics = EngineMetrics(
                    "engine:scripted",
                    None if first_token_at is None else first_token_at - request.submitted_at,
                    len(token_times),
                    itl,
                )
            yield TurnDone(
                rid,
                "length" if cut else "completed",
                metrics,
                produced_at=time.perf_counter(),
                input=input_usage(request),
            )
        finally:
            self.active.discard(rid)
