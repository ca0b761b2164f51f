"""The text-only embedded backend: adapter + continuous-batching scheduler behind EngineBackend.

One ``generate`` call per model turn. The call checks the audio, submits a job to the shared
scheduler (whose worker builds the prompt through the adapter when it admits the job), and
turns the scheduler's token events into engine outputs.
Tokens travel from the worker thread to the event loop in batches (one
``call_soon_threadsafe`` per dispatch, not one per token; the scheduler dispatches every few
milliseconds, and at once when a request starts or ends). Whatever way the consumer
leaves (normal end, ``aclose``, task cancellation), the ``finally`` cancels the job, so an
aborted request's slot is free before the next decode step.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import json
import time
from collections.abc import AsyncGenerator, Sequence
from typing import cast

import attrs
import structlog
import torch

from ...core.engine_io import (
    Aborted,
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
    forced_tool,
)
from ...errors import EngineFailed, InvalidCommand
from ..base import EngineCapabilities
from ..schema_fill import TokenSource, UnfillableSchema, conforms, fill_arguments
from .adapter import ModelAdapter, Prompt, WordThinkerAdapter
from .model import Thinker, ThinkerConfig
from .sampling import SamplingParams
from .scheduler import (
    BatchScheduler,
    DecodeJob,
    SchedulerEvent,
    SequenceEnded,
    Sink,
    TokenRun,
    build_each,
)
from .vocab import Vocabulary, default_vocabulary

log = structlog.get_logger("duplex_actors.engines.embedded")

_TURN_DONE_REASON = {"eos": "completed", "length": "length", "listen": "listen"}


def output_prior(vocab: Vocabulary) -> torch.Tensor:
    """Log-prior of the output bias: Zipf over word rank, a stop or comma every ~7 words, the
    end token at about one sentence end in four. It only shapes *rates*; which word comes out
    is the random network's doing."""
    from .vocab import PUNCTUATION, WORDS

    prior = torch.full((len(vocab),), -30.0)
    word_mass = torch.tensor([1.0 / (rank + 5) for rank in range(len(WORDS))])
    word_mass = word_mass / word_mass.sum() * 0.82
    for rank, word in enumerate(WORDS):
        prior[vocab.id(word)] = torch.log(word_mass[rank])
    for mark, mass in zip(PUNCTUATION, (0.07, 0.06, 0.015, 0.005)):
        prior[vocab.id(mark)] = torch.log(torch.tensor(mass))
    # Only allowed right after punctuation (see the scheduler's masks): ~1 in 4 sentence ends.
    prior[vocab.eos] = torch.log(torch.tensor(0.25))
    prior[vocab.listen] = 0.0  # only ever compared with speak (decision mask)
    prior[vocab.speak] = 0.0
    return prior


class EmbeddedThinker:
    """EngineBackend producing text (Decision, TextDelta, TurnDone) from the embedded thinker."""

    name = "embedded-thinker"

    def __init__(
        self,
        config: ThinkerConfig | None = None,
        *,
        adapter: ModelAdapter | None = None,
        defaults: SamplingParams = SamplingParams(),
        max_concurrency: int = 64,
        max_queue: int = 256,
        torch_threads: int | None = None,
        seed: int = 0,
        dispatch_interval_s: float = 0.005,
    ) -> None:
        self.vocab = default_vocabulary()
        self.config = config or ThinkerConfig(vocab_size=len(self.vocab), max_slots=max(64, max_concurrency))
        if self.config.vocab_size != len(self.vocab):
            raise ValueError("ThinkerConfig.vocab_size must match the vocabulary")
        self.adapter: ModelAdapter = adapter or WordThinkerAdapter(self.config, self.vocab, defaults)
        self.capabilities = EngineCapabilities(
            model_native=True,
            produces_audio=False,
            unit_samples=16000,
            max_concurrency=max_concurrency,
            # What sampling_for applies: the default, never past the cache's max_new_tokens.
            max_output_tokens=min(self.adapter.defaults.max_tokens, self.config.max_new_tokens),
            max_output_tokens_limit=self.config.max_new_tokens,
        )
        self._max_concurrency = max_concurrency
        self._max_queue = max_queue
        self._torch_threads = torch_threads
        self._seed = seed
        self._dispatch_interval_s = dispatch_interval_s
        self.model: Thinker | None = None
        self.scheduler: BatchScheduler | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        if self.scheduler is not None:
            return
        self._loop = asyncio.get_running_loop()
        if self._torch_threads:
            torch.set_num_threads(self._torch_threads)
        self.model = await asyncio.to_thread(Thinker, self.config, output_prior(self.vocab))
        self.scheduler = BatchScheduler(
            self.model,
            self.vocab,
            self._dispatch,
            max_concurrency=self._max_concurrency,
            max_queue=self._max_queue,
            seed=self._seed,
            dispatch_interval_s=self._dispatch_interval_s,
            build_prompts=functools.partial(_build_prompts, self.adapter),
        )
        self.scheduler.start()
        log.info(
            "embedded.thinker_started",
            params=self.model.parameter_count(),
            d_model=self.config.d_model,
            layers=self.config.n_layers,
            vocab=len(self.vocab),
            max_concurrency=self._max_concurrency,
            device=self.config.device,
            cuda_graphs=self.config.cuda_graphs,
        )

    async def aclose(self) -> None:
        if self.scheduler is None:
            return
        scheduler, self.scheduler = self.scheduler, None
        await asyncio.to_thread(scheduler.close)

    def _dispatch(self, batch: list[tuple[Sink, SchedulerEvent]]) -> None:
        # Called on the worker thread (once per step at most); fans out on the event loop.
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(_fan_out, batch)
        except RuntimeError:  # the loop closed between the check and the call
            pass

    # --- EngineBackend --------------------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        if self.scheduler is not None:
            self.scheduler.cancel(request_id)

    async def generate(self, request: ModelTurnRequest) -> AsyncGenerator[EngineOutput, None]:
        rid = request.request_id
        scheduler = self.scheduler
        if scheduler is None:
            raise EngineFailed("the embedded thinker is not started")
        try:
            # Checked here, where a bad request can still be refused as the caller's fault; the
            # prompt itself (log-mel FFTs) is built on the worker thread when admitted.
            self.adapter.audio_budget(request.audio, request.sample_rate)
        except InvalidCommand as exc:
            yield EngineFailure(rid, exc.message, retryable=False, produced_at=time.perf_counter())
            return
        tool = forced_tool(request)
        params = self.adapter.sampling_for(request.fence.session_id, request.sampling)
        if tool is not None:
            # Random weights cannot choose a tool, so this engine calls a function only when
            # the client forces one (tool_choice "required" or a function's name). The model
            # still writes the arguments: it decodes as for an answer, and its tokens fill
            # the tool's schema (schema_fill), so they are valid for it.
            params = attrs.evolve(params, max_tokens=min(params.max_tokens, _CALL_TOKENS))
        inbox = _Inbox(asyncio.get_running_loop())
        # The prompt is built on the worker thread at admission; kept to report what was read.
        built: list[Prompt] = []
        job = DecodeJob(rid, _TurnPrompt(self.adapter, request, built), params, request.share_tenant)
        scheduler.submit(job, inbox.put)  # EngineCapacityError propagates, nothing queued
        if tool is not None:
            async for output in self._call(request, tool, inbox, built):
                yield output
            return
        accepted_at = time.perf_counter()
        ended = False
        events = inbox.events
        render = self.vocab.render
        try:
            unit = request.kind is TurnKind.UNIT
            snapshot: list[int] = []
            decided = not unit
            began = False
            token_times: list[float] = []
            while True:
                while not events:
                    await inbox.wait()
                event = events.popleft()
                if type(event) is TokenRun:
                    ids, times = event.token_ids, event.produced_at
                    start = 0
                    while not decided and start < len(ids):
                        # A unit's first tokens decide whether to speak.
                        snapshot.append(ids[start])
                        speak = self.adapter.decide(snapshot)
                        start += 1
                        if speak is None:
                            continue
                        decided = True
                        began = speak
                        yield Decision(rid, speak=speak, produced_at=times[start - 1])
                        if not speak:
                            # Listen ends the unit; the scheduler already freed the slot.
                            ended = True
                            return
                    if start == len(ids):
                        continue
                    if not began:  # the first word of a response: the decision goes first
                        began = True
                        yield Decision(rid, speak=True, produced_at=times[start])
                    # This runs on the event loop for every live request at every dispatch,
                    # while the worker waits for the GIL, so it is kept to the minimum: every
                    # token that reached the loop (several dispatches, if the loop fell behind)
                    # goes out as one delta, which everything downstream handles once.
                    first_at = times[start]
                    if token_times:
                        text = "".join([render(t, first=False) for t in ids[start:]])
                    else:  # the response's very first word has no leading space
                        text = render(ids[start], first=True)
                        text += "".join([render(t, first=False) for t in ids[start + 1 :]])
                    token_times += times[start:] if start else times
                    count = len(ids) - start
                    while events and type(events[0]) is TokenRun:
                        more = cast(TokenRun, events.popleft())
                        text += "".join([render(t, first=False) for t in more.token_ids])
                        token_times += more.produced_at
                        count += len(more.token_ids)
                    yield TextDelta(rid, text, count, first_at)
                    continue
                assert isinstance(event, SequenceEnded)
                ended = True
                if event.reason == "aborted":
                    yield Aborted(rid, produced_at=event.produced_at)
                elif event.reason in ("failed", "closed"):
                    yield EngineFailure(
                        rid, event.message or f"engine {event.reason}", produced_at=event.produced_at
                    )
                elif event.reason == "listen" and not decided:
                    # The scheduler ended the unit on a listen token that the adapter
                    # did not recognise as a decision: still tell the session "listen".
                    yield Decision(rid, speak=False, produced_at=event.produced_at)
                else:
                    if not began:
                        yield Decision(rid, speak=True, produced_at=event.produced_at)
                    yield TurnDone(
                        rid,
                        _TURN_DONE_REASON.get(event.reason, event.reason),
                        _metrics(accepted_at, token_times),
                        produced_at=event.produced_at,
                        input=_read(built),
                    )
                return
        finally:
            if not ended:
                scheduler.cancel(rid)

    async def _call(
        self, request: ModelTurnRequest, tool: str, inbox: _Inbox, built: list[Prompt]
    ) -> AsyncGenerator[EngineOutput, None]:
        """A forced call: the decode's tokens become the arguments, then the turn ends."""
        rid = request.request_id
        ids: list[int] = []
        ended = False
        try:
            while True:
                while not inbox.events:
                    await inbox.wait()
                event = inbox.events.popleft()
                if isinstance(event, TokenRun):
                    ids += event.token_ids
                    continue
                ended = True
                if event.reason == "aborted":
                    yield Aborted(rid, produced_at=event.produced_at)
                    return
                if event.reason in ("failed", "closed"):
                    yield EngineFailure(
                        rid, event.message or f"engine {event.reason}", produced_at=event.produced_at
                    )
                    return
                break
        finally:
            if not ended and self.scheduler is not None:
                self.scheduler.cancel(rid)
        schema_text = next(t.parameters for t in request.tools if t.name == tool)
        try:
            schema = json.loads(schema_text)
        except ValueError:
            schema = {}
        if isinstance(schema, dict) and "type" not in schema:
            schema = {"type": "object", **schema}  # a function's parameters are an object
        words = [self.vocab.render(t, first=True) for t in ids]
        # Off the event loop: the schema is the client's, and checking its patterns may take
        # up to PATTERN_TIME_S (the filler's own work is bounded by its limits).
        arguments, problem = await asyncio.to_thread(_arguments_for, schema, words, ids)
        now = time.perf_counter()
        if problem is not None or not isinstance(arguments, dict):
            # Never a call the client's function would refuse: the response fails instead.
            why = problem or "the schema does not describe an object"
            yield EngineFailure(
                rid,
                f"no arguments valid for {tool!r} could be generated: {why}",
                retryable=False,
                produced_at=now,
            )
            return
        yield Decision(rid, speak=True, produced_at=now)
        yield FunctionCall(
            rid,
            "call_" + hashlib.blake2s(rid.encode(), digest_size=8).hexdigest(),
            tool,
            json.dumps(arguments),
            produced_at=now,
            token_count=len(ids),
        )
        yield TurnDone(rid, "completed", produced_at=time.perf_counter(), input=_read(built))


def _arguments_for(schema: object, words: list[str], ids: list[int]) -> tuple[object, str | None]:
    """A forced call's arguments from the model's words, and why they are not valid (None: they
    are)."""
    try:
        arguments = fill_arguments(schema, TokenSource(words, ids))
    except UnfillableSchema as exc:
        return None, str(exc)
    return arguments, conforms(arguments, schema)


#: Tokens decoded for a forced call's arguments: enough words for a few string values.
_CALL_TOKENS = 16


class _TurnPrompt:
    """A job's ``prompt``: builds one turn's prompt alone when called; :func:`_build_prompts`
    reads ``request`` to build the turns admitted together at once. Either way the prompt is
    kept in ``built``, to report what the model read."""

    __slots__ = ("adapter", "request", "built")

    def __init__(self, adapter: ModelAdapter, request: ModelTurnRequest, built: list[Prompt]) -> None:
        self.adapter = adapter
        self.request = request
        self.built = built

    def __call__(self) -> Prompt:
        prompt = self.adapter.build_prompt(self.request)
        self.built.append(prompt)
        return prompt


def _build_prompts(adapter: ModelAdapter, jobs: Sequence[DecodeJob]) -> list[Prompt | Exception]:
    """The scheduler's prompt builder (on its worker): this engine's turns through the
    adapter's ``build_prompts`` together, anything else through its own ``prompt()``."""
    ours = [job for job in jobs if isinstance(job.prompt, _TurnPrompt)]
    batch = getattr(adapter, "build_prompts", None)  # optional for an adapter of one's own
    if len(ours) < 2 or batch is None:
        return build_each(jobs)
    turns = [cast(_TurnPrompt, job.prompt) for job in ours]
    prompts = list(batch([turn.request for turn in turns]))
    if len(prompts) != len(turns):
        raise RuntimeError(f"the adapter built {len(prompts)} prompts for {len(turns)} turns")
    for turn, prompt in zip(turns, prompts):
        if not isinstance(prompt, Exception):
            turn.built.append(prompt)
    mine = iter(prompts)
    others = iter(build_each([job for job in jobs if not isinstance(job.prompt, _TurnPrompt)]))
    return [next(mine) if isinstance(job.prompt, _TurnPrompt) else next(others) for job in jobs]


def _read(built: list[Prompt]) -> InputUsage | None:
    """What the model read: the prompt's text tokens (prefix, kind token) and audio tokens.
    None if the job never reached admission (its prompt was never built)."""
    if not built:
        return None
    prompt = built[0]
    return InputUsage(
        text_tokens=len(prompt.prefix_ids) + len(prompt.suffix_ids), audio_tokens=prompt.budget.tokens
    )


def _fan_out(batch: list[tuple[Sink, SchedulerEvent]]) -> None:
    for sink, event in batch:
        sink(event)


class _Inbox:
    """One request's scheduler events, on the event loop: a deque and at most one waiter.

    Lighter than asyncio.Queue on purpose: the loop handles one event per live request per
    decode step, and while it does, the worker thread waits for the GIL; every microsecond
    spent here is taken from the decode steps of all sessions.
    """

    __slots__ = ("events", "_waiter", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.events: collections.deque[SchedulerEvent] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._loop = loop

    def put(self, event: SchedulerEvent) -> None:
        self.events.append(event)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def wait(self) -> asyncio.Future[None]:
        """A future the next :meth:`put` completes; await it only while ``events`` is empty.

        A future rather than a coroutine: awaiting it directly saves a coroutine object and
        frame per wait. A consumer cancelled while waiting leaves a cancelled future behind,
        which ``put`` skips."""
        waiter = self._waiter = self._loop.create_future()
        return waiter


def _metrics(accepted_at: float, token_times: list[float]) -> EngineMetrics:
    gaps = tuple(b - a for a, b in zip(token_times, token_times[1:]))
    return EngineMetrics(
        source="embedded",
        first_token_s=(token_times[0] - accepted_at) if token_times else None,
        token_count=len(token_times),
        inter_token_s=gaps,
    )
