"""Continuous batching: one worker thread decodes every live sequence of every session together.

Theory of operation. Callers (the backend, on the event loop) ``submit`` jobs and ``cancel``
request ids; both only touch a lock-protected inbox and return at once. The worker thread
owns everything else (slots, the model's cache, sampling state) and loops:

1. take the inbox: drop cancelled sequences (their slots free *before* the next compute, so
   an abort takes effect within one decode step), then admit queued jobs while slots are
   free, prefilling all their prompts into their slots in one batched pass. Queued jobs are
   admitted in fair-share order (core/fair_share.py): the tenant admitted least recently goes
   first, so one client's hundred queued requests do not hold a neighbour's behind them all;
   a tenant's own jobs go in the order they came;
2. run one batched decode step over all live sequences, sample one token per row;
3. hand the produced tokens and endings to the caller's ``dispatch`` in one call, and free
   finished slots at once. A pass that admitted or ended a sequence dispatches at once (first
   tokens, decisions and endings are what turn-taking waits on); between those, tokens are
   held until ``dispatch_interval_s`` has passed since the last dispatch. Each row holds its
   own tokens and hands them over as one :class:`TokenRun` per dispatch (before its ending,
   when it ends).

Why hold tokens at all: every dispatch wakes the event loop, and while the loop runs Python
the worker waits for the GIL at each of the ~70 torch ops of its step. With one live request
(a 1.4 ms step) a wake per step cost the decode loop about a fifth of its speed on this
project's 2-core host (2026-12-01: 0.75-0.85x of a bare loop, against 0.9-1.0x with one wake
per request). A few milliseconds of coalescing is far below what a listener, or a speech
synthesiser waiting for whole words, can notice; batched steps (6+ ms at 64 rows) still
dispatch every step.

Live sequences always sit in slots ``0 .. n-1`` (see model.py): a sequence that leaves is
replaced by the last one, whose cache rows are copied over. Admission is bounded twice: at
most ``max_concurrency`` live sequences, then a queue of at most ``max_queue`` waiting jobs;
a submit past that raises :class:`EngineCapacityError` and changes nothing. One tenant's jobs
may take at most ``max_queue_per_tenant`` of the queue's places (three quarters by default):
a client with 320 sessions each asking for a response would otherwise fill the slots and the
queue, and every other client's next request would be refused until it let go. Jobs without
a tenant are each a tenant of their own.

Observers (tests, benchmarks, metrics) get a :class:`StepRecord` after every step and a
:class:`SlotReleased` whenever a slot is given back; they run on the worker thread and must be
quick.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Union

import attrs
import structlog
import torch

from ...core.fair_share import FairShare
from ...errors import EngineCapacityError, EngineFailed
from .model import Thinker
from .sampling import SamplingParams, sample_batch
from .vocab import Vocabulary

if TYPE_CHECKING:
    from .adapter import Prompt

log = structlog.get_logger("duplex_actors.engines.embedded.scheduler")


@attrs.frozen(slots=True, eq=False)
class DecodeJob:
    """Everything the worker needs to run one request: how to build its prompt, and the
    resolved sampling parameters.

    ``prompt`` is called on the worker thread when the job is admitted (it computes the audio
    features: FFTs that belong off the event loop, and that cost less there than a thread-pool
    hop per request does). It returns a :class:`~.adapter.Prompt`; if it raises, the job ends
    ``failed`` alone.
    """

    request_id: str
    prompt: Callable[[], Prompt]
    params: SamplingParams
    #: Whom the job counts against when slots are scarce (None: the request alone).
    tenant: Hashable = None


class TokenRun:
    """Tokens of one request from consecutive decode steps, handed over together: what its
    row produced since the last dispatch (``produced_at[i]``: when ``token_ids[i]`` was read,
    at step ``first_step + i``).

    One event per request per dispatch, not one per token: the worker builds it and the event
    loop handles it while every other row waits (for the worker's GIL, or for the next step),
    and at 256 rows an event per token was most of both threads' per-token work. A plain
    slotted class, not attrs: it is made for every live row at every dispatch. Nothing mutates
    one."""

    __slots__ = ("request_id", "token_ids", "first_step", "produced_at")

    def __init__(
        self, request_id: str, token_ids: list[int], first_step: int, produced_at: list[float]
    ) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.first_step = first_step
        self.produced_at = produced_at

    def __repr__(self) -> str:
        return f"TokenRun({self.request_id!r}, {self.token_ids!r}, first_step={self.first_step})"


@attrs.frozen(slots=True)
class SequenceEnded:
    """The last event of a job. ``reason``: eos, length, listen, aborted, closed, failed."""

    request_id: str
    reason: str
    step: int
    produced_at: float
    message: str = ""


SchedulerEvent = Union[TokenRun, SequenceEnded]
Sink = Callable[[SchedulerEvent], None]
Dispatch = Callable[[list[tuple[Sink, SchedulerEvent]]], None]
#: Where a step collects its events for the next dispatch.
_Outbox = list[tuple[Sink, SchedulerEvent]]
#: Builds the prompts of the jobs admitted together, in order, an exception in the place of a
#: job whose prompt cannot be built (the engine shares the audio front end's work across them).
PromptBuilder = Callable[[Sequence[DecodeJob]], Sequence["Prompt | Exception"]]


def build_each(jobs: Sequence[DecodeJob]) -> list[Prompt | Exception]:
    """The default :data:`PromptBuilder`: each job's own ``prompt()``."""
    out: list[Prompt | Exception] = []
    for job in jobs:
        try:
            out.append(job.prompt())
        except Exception as exc:
            out.append(exc)
    return out


@attrs.frozen(slots=True)
class StepRecord:
    """One batched decode step: which requests it decoded, which joined just before it."""

    index: int
    request_ids: tuple[str, ...]
    admitted: tuple[str, ...]
    finished: tuple[str, ...]
    duration_s: float

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)


@attrs.frozen(slots=True)
class SlotReleased:
    request_id: str
    reason: str
    #: Decode steps completed when the slot was given back.
    steps_completed: int


@attrs.frozen(slots=True)
class SchedulerStats:
    steps: int
    active: int
    queued: int
    max_concurrency: int
    max_queue: int
    tokens: int
    #: Jobs accepted by submit() since start (admitted or still queued or done).
    submitted: int
    #: Decode steps launched ahead of the host's bookkeeping (see BatchScheduler._chain).
    steps_ahead: int = 0


Observer = Callable[[StepRecord | SlotReleased], None]
#: A step's tokens on their way to the host: the tensor itself, or (on a GPU) a pinned copy and
#: the event that marks it done.
_HostCopy = Union[torch.Tensor, tuple[torch.Tensor, torch.cuda.Event]]

# Mask rows indexed by a sequence's phase (see _build_masks).
_DECIDE, _AFTER_WORD, _AFTER_PUNCT_EARLY, _AFTER_PUNCT = 0, 1, 2, 3


class _Live:
    """Worker-owned state of one live sequence (mutable on purpose: it changes every step)."""

    __slots__ = (
        "job",
        "sink",
        "slot",
        "position",
        "next_input",
        "generated",
        "deciding",
        "after_punct",
        "generator",
        "samples",
        "held",
        "held_at",
        "held_from",
    )

    def __init__(
        self,
        job: DecodeJob,
        prompt: Prompt,
        sink: Sink,
        slot: int,
        position: int,
        generator: torch.Generator | None,
    ) -> None:
        self.job = job
        self.sink = sink
        self.slot = slot
        self.position = position
        self.next_input = prompt.suffix_ids[-1]
        self.generated = 0
        # Model-native unit: the first token is forced to be a listen or speak decision.
        self.deciding = prompt.decide_first
        self.after_punct = True  # the start of a response behaves like a sentence start
        self.generator = generator
        self.samples = _samples(job.params)
        #: Tokens made since the last dispatch and when (see TokenRun), handed over together.
        self.held: list[int] = []
        self.held_at: list[float] = []
        self.held_from = 0  # the step of held[0]

    def flush(self, outbox: _Outbox) -> None:
        """Hand what this row holds to ``outbox``, as one :class:`TokenRun`."""
        if self.held:
            outbox.append((self.sink, TokenRun(self.job.request_id, self.held, self.held_from, self.held_at)))
            self.held = []
            self.held_at = []


def _samples(params: SamplingParams) -> bool:
    """Whether a row goes through the sampler. Knobs that cannot even be compared do too: the
    sampler is what fails them, alone (BatchScheduler._sample)."""
    try:
        return bool(params.temperature > 0.0)
    except TypeError:
        return True


def _phase(seq: _Live) -> int:
    if seq.deciding:
        return _DECIDE
    if not seq.after_punct:
        return _AFTER_WORD
    return _AFTER_PUNCT_EARLY if seq.generated < seq.job.params.min_tokens else _AFTER_PUNCT


class BatchScheduler:
    def __init__(
        self,
        model: Thinker,
        vocab: Vocabulary,
        dispatch: Dispatch,
        *,
        max_concurrency: int = 64,
        max_queue: int = 256,
        seed: int = 0,
        dispatch_interval_s: float = 0.005,
        max_queue_per_tenant: int | None = None,
        build_prompts: PromptBuilder = build_each,
    ) -> None:
        if not 1 <= max_concurrency <= model.cfg.max_slots:
            raise ValueError(f"max_concurrency must be in 1..{model.cfg.max_slots}")
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if max_queue_per_tenant is not None and max_queue_per_tenant < 0:
            raise ValueError("max_queue_per_tenant must be >= 0")
        if not dispatch_interval_s >= 0:
            raise ValueError("dispatch_interval_s must be >= 0")
        self.dispatch_interval_s = dispatch_interval_s
        self._model = model
        self._vocab = vocab
        self._dispatch = dispatch
        self._build_prompts = build_prompts
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        #: The places one tenant may take (module doc); the rest are kept for the others.
        self.max_queue_per_tenant = (
            max_queue - max_queue // 4 if max_queue_per_tenant is None else max_queue_per_tenant
        )
        self._shared_gen = torch.Generator().manual_seed(seed)
        # On a GPU the step's logits stay there: the grammar's masks and their row index go
        # too (the sampler copies the logits to the CPU only for rows that sample).
        self._device = None if model.device.type == "cpu" else model.device
        self._masks = self._build_masks()
        if self._device is not None:
            self._masks = self._masks.to(self._device)
        self._punctuation = vocab.punctuation_ids
        #: Whether a token is punctuation, as a tensor where the steps run (see _chain).
        is_punctuation = torch.zeros(len(vocab), dtype=torch.bool)
        is_punctuation[list(vocab.punctuation_ids)] = True
        self._is_punctuation = is_punctuation if self._device is None else is_punctuation.to(self._device)
        #: Steps launched ahead of the host's bookkeeping (_chain): on with CUDA graphs, where a
        #: step costs the host one launch and its bookkeeping is what the device waits for.
        #: Off eager, where launching the step's kernels is itself the host's work (measured
        #: slower there), and on the CPU, whose step the host computes.
        self.lookahead = self._device is not None and model.cfg.cuda_graphs
        self._pinned: torch.Tensor | None = None
        self._steps_ahead = 0

        self._lock = threading.Condition()
        #: Queued jobs by request id, and the order they are admitted in.
        self._pending: dict[str, tuple[DecodeJob, Sink]] = {}
        self._line: FairShare[str] = FairShare()
        #: Queued jobs of each named tenant.
        self._queued_of: dict[Hashable, int] = {}
        self._cancelled: set[str] = set()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._observers: list[Observer] = []
        self._submitted = 0

        # Worker-owned.
        self._live: list[_Live] = []
        #: Live rows that sample (temperature > 0); while there are none, a step takes the
        #: argmax without building the sampler's per-row lists.
        self._sampling_rows = 0
        self._steps = 0
        self._tokens = 0
        self._live_count = 0  # mirrored under the lock for stats()
        #: Whether this pass of the worker made a token (rows hold them until a dispatch).
        self._produced = False

    def _build_masks(self) -> torch.Tensor:
        # A tiny grammar on top of the random network: no punctuation at the start or twice
        # in a row, and the end token only right after punctuation (responses end on a
        # sentence boundary) and only once min_tokens exist.
        v = self._vocab
        masks = torch.zeros(4, len(v))
        masks[_DECIDE] = float("-inf")
        masks[_DECIDE, [v.listen, v.speak]] = 0.0
        punct = list(v.punctuation_ids)
        for cid in v.control_ids:
            masks[_AFTER_WORD, cid] = float("-inf")
            masks[_AFTER_PUNCT_EARLY, cid] = float("-inf")
            if cid != v.eos:
                masks[_AFTER_PUNCT, cid] = float("-inf")
        masks[_AFTER_PUNCT_EARLY, punct] = float("-inf")
        masks[_AFTER_PUNCT, punct] = float("-inf")
        return masks

    # --- caller side (any thread) ---------------------------------------------------------

    def add_observer(self, observer: Observer) -> Callable[[], None]:
        self._observers.append(observer)
        return lambda: self._observers.remove(observer)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="embedded-thinker", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker; every live or queued job ends with reason ``closed``."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, job: DecodeJob, sink: Sink) -> None:
        with self._lock:
            if self._closing:
                raise EngineFailed("the embedded engine is closed")
            tenant = job.tenant
            if self._free_slots_locked() == 0:
                if len(self._pending) >= self.max_queue:
                    raise EngineCapacityError(
                        f"engine queue is full ({self.max_queue} waiting, "
                        f"{self.max_concurrency} running); retry later"
                    )
                if tenant is not None and self._queued_of.get(tenant, 0) >= self.max_queue_per_tenant:
                    raise EngineCapacityError(
                        f"this client already has {self.max_queue_per_tenant} requests waiting for "
                        f"the engine, its most ({self.max_queue} places in all); retry later"
                    )
            rid = job.request_id
            if rid in self._pending:
                raise EngineFailed(f"request {rid!r} is already queued")
            self._pending[rid] = (job, sink)
            self._line.wait(rid, tenant)
            if tenant is not None:
                self._queued_of[tenant] = self._queued_of.get(tenant, 0) + 1
            self._submitted += 1
            self._lock.notify_all()

    def cancel(self, request_id: str) -> None:
        """Free ``request_id``'s slot before the next decode step (or drop it from the queue
        now). Unknown or finished ids are a no-op."""
        released = None
        with self._lock:
            queued = self._pending.pop(request_id, None)
            if queued is not None:
                self._unqueued(queued[0])
                released = SlotReleased(request_id, "aborted", self._steps)
            else:
                self._cancelled.add(request_id)
                self._lock.notify_all()
        if released is not None:
            self._notify(released)

    def stats(self) -> SchedulerStats:
        with self._lock:
            return SchedulerStats(
                steps=self._steps,
                active=self._live_count,
                queued=len(self._pending),
                max_concurrency=self.max_concurrency,
                max_queue=self.max_queue,
                tokens=self._tokens,
                submitted=self._submitted,
                steps_ahead=self._steps_ahead,
            )

    def _free_slots_locked(self) -> int:
        # Jobs already queued will take free slots first; only the rest is really free.
        return max(0, self.max_concurrency - self._live_count - len(self._pending))

    def _notify(self, record: StepRecord | SlotReleased) -> None:
        for observer in list(self._observers):
            try:
                observer(record)
            except Exception:  # an observer must never break decoding
                log.exception("scheduler.observer_failed")

    # --- worker thread --------------------------------------------------------------------

    def _run(self) -> None:
        log.info("scheduler.started", max_concurrency=self.max_concurrency, max_queue=self.max_queue)
        # Events produced but not dispatched yet (see the module docstring on holding tokens).
        outbox: list[tuple[Sink, SchedulerEvent]] = []
        last_dispatch = 0.0
        while True:
            with self._lock:
                while not (self._closing or self._pending or self._live or self._cancelled):
                    self._lock.wait()
                if self._closing:
                    break
                cancelled, self._cancelled = self._cancelled, set()
                room = self.max_concurrency - len(self._live)
                admits = [self._take_queued() for _ in range(min(room, len(self._pending)))]
            queued_events = len(outbox)
            self._produced = False
            live_before = len(self._live)
            try:
                self._release_cancelled(cancelled, outbox)
                admitted = self._admit(admits, outbox)
                if self._live:
                    self._step(admitted, outbox)
            except Exception as exc:  # a model failure fails its batch, not the engine
                log.exception("scheduler.step_failed")
                self._fail_all(f"decode step failed: {exc!r}", outbox)
            with self._lock:
                self._live_count = len(self._live)
            if len(outbox) == queued_events and not self._produced:
                continue
            # At once when anyone joined or left in this pass: first tokens, decisions and
            # endings (including failed admissions). An ending is also what guarantees that
            # nothing stays held once the last live sequence is gone.
            now = time.perf_counter()
            if (
                admits
                or len(self._live) != live_before + len(admits)
                or now - last_dispatch >= self.dispatch_interval_s
            ):
                last_dispatch = now
                for seq in self._live:  # (a row that left handed its tokens over already)
                    seq.flush(outbox)
                self._dispatch(outbox)
                outbox = []
        if outbox:  # closing: what was held goes before the endings _shutdown sends
            self._dispatch(outbox)
        self._shutdown()

    def _take_queued(self) -> tuple[DecodeJob, Sink]:
        # Under the lock. A job is admitted once: its flow ends here, and its tenant's place
        # in line is kept while the tenant has other jobs queued.
        rid = self._line.next()
        assert rid is not None, "a queued job is in line"
        taken = self._pending.pop(rid)
        self._unqueued(taken[0])
        return taken

    def _unqueued(self, job: DecodeJob) -> None:
        """Under the lock: ``job`` left the queue (admitted or cancelled)."""
        self._line.forget(job.request_id)
        tenant = job.tenant
        if tenant is not None:
            left = self._queued_of[tenant] - 1
            if left:
                self._queued_of[tenant] = left
            else:
                del self._queued_of[tenant]

    def _release_cancelled(self, cancelled: set[str], outbox: _Outbox) -> None:
        if not cancelled:
            return
        gone = [live for live in self._live if live.job.request_id in cancelled]
        for live in gone:
            live.flush(outbox)
            outbox.append(
                (live.sink, SequenceEnded(live.job.request_id, "aborted", self._steps, time.perf_counter()))
            )
        self._release(gone, "aborted")

    def _admit(self, admits: list[tuple[DecodeJob, Sink]], outbox: _Outbox) -> tuple[str, ...]:
        # A prompt that cannot run fails alone; the rest are prefilled together in one pass
        # (a burst of joiners costs about what a few single prefills do).
        ready: list[tuple[DecodeJob, Sink, Prompt, torch.Tensor, torch.Generator | None]] = []
        if not admits:
            return ()
        jobs = [job for job, _ in admits]
        try:
            prompts = list(self._build_prompts(jobs))
            if len(prompts) != len(jobs):
                raise RuntimeError(f"{len(prompts)} prompts built for {len(jobs)} jobs")
        except Exception:  # the shared builder broke: each job alone, so none fails for another
            log.exception("scheduler.prompt_batch_failed", jobs=len(jobs))
            prompts = build_each(jobs)
        built: list[tuple[DecodeJob, Sink, Prompt, torch.Generator | None]] = []
        for (job, sink), prompt in zip(admits, prompts):
            try:
                # A seed torch cannot take fails this job here, alone.
                gen = None if job.params.seed is None else torch.Generator().manual_seed(job.params.seed)
            except Exception as exc:
                self._fail_admission(job, sink, exc, outbox)
                continue
            if isinstance(prompt, Exception):
                self._fail_admission(job, sink, prompt, outbox)
                continue
            built.append((job, sink, prompt, gen))
        embedded_all = self._model.embed_prompts(
            [(prompt.prefix_ids, prompt.audio_features, prompt.suffix_ids) for _, _, prompt, _ in built]
        )
        for (job, sink, prompt, gen), embedded in zip(built, embedded_all):
            if isinstance(embedded, Exception):
                self._fail_admission(job, sink, embedded, outbox)
                continue
            ready.append((job, sink, prompt, embedded, gen))
        if not ready:
            return ()
        first = len(self._live)
        try:
            positions = self._model.prefill_many(first, [entry[3] for entry in ready])
        except Exception as exc:
            for job, sink, _, _, _ in ready:
                self._fail_admission(job, sink, exc, outbox)
            return ()
        for offset, ((job, sink, prompt, _, gen), position) in enumerate(zip(ready, positions)):
            self._live.append(_Live(job, prompt, sink, first + offset, position, gen))
            self._sampling_rows += self._live[-1].samples
        return tuple(entry[0].request_id for entry in ready)

    def _fail_admission(self, job: DecodeJob, sink: Sink, exc: Exception, outbox: _Outbox) -> None:
        log.warning("scheduler.prefill_failed", request_id=job.request_id, error=repr(exc))
        outbox.append(
            (sink, SequenceEnded(job.request_id, "failed", self._steps, time.perf_counter(), repr(exc)))
        )

    def _step(self, admitted: tuple[str, ...], outbox: _Outbox) -> None:
        began = time.perf_counter()
        live = self._live
        tokens = torch.tensor([s.next_input for s in live])
        positions = torch.tensor([s.position for s in live])
        logits = self._model.decode(tokens, positions)
        phases = [_phase(s) for s in live]
        if self._device is None:
            logits = logits + self._masks[torch.tensor(phases)]
        else:
            logits = logits + self._masks[torch.tensor(phases).to(self._device, non_blocking=True)]
        if self.lookahead and not admitted and self._may_look_ahead():
            self._chain(logits, positions, began, outbox)
            return
        picks, sampling_errors = self._sample(logits, live)
        finished, reasons, record = self._account(live, picks, sampling_errors, admitted, began, outbox)
        self._release(finished, reasons)
        if record is not None:
            self._notify(record)

    def _may_look_ahead(self) -> bool:
        """Whether the next step's inputs can be computed on the device from this one's tokens:
        every row greedy and past its decision (a sampled token comes from a CPU generator, a
        decision ends or turns a row), and nobody waiting to join or leave (they go in between
        steps; read without the lock: a late one waits one chain)."""
        if self._sampling_rows or self._pending or self._cancelled:
            return False
        return not any(s.deciding for s in self._live)

    def _chain(self, logits: torch.Tensor, positions: torch.Tensor, began: float, outbox: _Outbox) -> None:
        """Decode steps run ahead: step k+1 is launched on the device from step k's tokens
        (still on the device) before the host reads them, so the device computes while the
        host does step k's bookkeeping, instead of waiting for it. What the host would feed
        step k+1 is a function of step k's tokens and the rows' state: the token, its position
        plus one, and the grammar's phase (punctuation or not, past ``min_tokens`` or not).

        The chain ends when a row ends (its slot must be released, which moves another row's
        cache), when someone waits to join or leave, or after ``dispatch_interval_s`` (so that
        tokens go out on time); a step launched ahead for a row that had just ended is dropped.
        Steps launched are steps taken, and each is fed what one step at a time would feed it
        (tests/embedded/test_lookahead.py); only a row that ended one step early still shares
        the step launched ahead (as a padded row of a bucket does)."""
        model = self._model
        live = list(self._live)
        device = logits.device
        picks_dev = logits.argmax(dim=-1)
        positions_dev = positions.to(device, non_blocking=True)
        generated = torch.tensor([s.generated for s in live]).to(device, non_blocking=True)
        min_tokens = torch.tensor([s.job.params.min_tokens for s in live]).to(device, non_blocking=True)
        max_position = max(s.position for s in live)
        max_len = model.cfg.max_len
        stop_at = began + self.dispatch_interval_s
        ended: set[int] = set()  # id() of rows that ended inside the chain
        finished_all: list[_Live] = []
        reasons_all: list[str] = []
        records: list[StepRecord] = []
        step_began = began
        pending: torch.Tensor | None = picks_dev
        try:
            while pending is not None:
                copy = self._host_copy(pending)
                launched = None
                if (
                    not ended
                    and max_position + 1 < max_len
                    and time.perf_counter() < stop_at
                    and not (self._pending or self._cancelled)  # nobody waits to join or leave
                ):
                    # Step k+1's inputs, on the device, as the host would write them.
                    positions_dev = positions_dev + 1
                    max_position += 1
                    generated = generated + 1
                    phases = torch.where(
                        self._is_punctuation[pending],
                        torch.where(generated < min_tokens, _AFTER_PUNCT_EARLY, _AFTER_PUNCT),
                        _AFTER_WORD,
                    )
                    ahead = model.decode(pending, positions_dev, max_position=max_position)
                    launched = (ahead + self._masks[phases]).argmax(dim=-1)
                    self._steps_ahead += 1
                picks = self._host_values(copy)
                rows = [s for s in live if id(s) not in ended] if ended else live
                if ended:
                    picks = [t for s, t in zip(live, picks) if id(s) not in ended]
                finished, reasons, record = self._account(rows, picks, {}, (), step_began, outbox)
                step_began = time.perf_counter()
                ended.update(id(s) for s in finished)
                finished_all += finished
                reasons_all += reasons
                if record is not None:
                    records.append(record)
                pending = launched
        finally:
            # Also when a step fails: rows that already ended (and got their ending) leave
            # now, so the failure ends only the others (one terminal event each).
            self._release(finished_all, reasons_all)
        for record in records:
            self._notify(record)

    def _host_copy(self, tokens: torch.Tensor) -> _HostCopy:
        """Start copying a step's tokens to the host; :meth:`_host_values` waits for them. On
        a GPU, into pinned memory with an event, so that waiting for this copy does not also
        wait for a step launched after it."""
        if tokens.device.type != "cuda":
            return tokens
        if self._pinned is None:  # one buffer for the most rows a step can have
            self._pinned = torch.empty(self._model.cfg.max_slots, dtype=tokens.dtype, pin_memory=True)
        buffer = self._pinned[: tokens.shape[0]]
        buffer.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch: untyped __new__
        done.record()
        return buffer, done

    @staticmethod
    def _host_values(copy: _HostCopy) -> list[int]:
        if isinstance(copy, tuple):
            buffer, done = copy
            done.synchronize()
            return buffer.tolist()
        return copy.tolist()

    def _account(
        self,
        live: list[_Live],
        picks: Sequence[int | None],
        sampling_errors: dict[str, Exception],
        admitted: tuple[str, ...],
        began: float,
        outbox: _Outbox,
    ) -> tuple[list[_Live], list[str], StepRecord | None]:
        """One step's tokens (``picks[i]`` for ``live[i]``, None where sampling failed) into
        events and row state; the rows that ended and why, and the step's record (if anyone
        observes steps). Their slots are released by the caller."""
        now = time.perf_counter()
        self._steps += 1
        step = self._steps
        listen, eos = self._vocab.listen, self._vocab.eos  # (properties: looked up once a step)
        max_len = self._model.cfg.max_len
        punctuation = self._punctuation
        finished: list[_Live] = []
        reasons: list[str] = []
        for seq, token in zip(live, picks):
            if token is None:
                rid = seq.job.request_id
                seq.flush(outbox)
                error = f"sampling failed: {sampling_errors[rid]!r}"
                outbox.append((seq.sink, SequenceEnded(rid, "failed", step, now, error)))
                finished.append(seq)
                reasons.append("failed")
                continue
            seq.position += 1
            seq.next_input = token
            if seq.deciding:
                # The decision token goes out (the consumer reads the decision from it).
                if not seq.held:
                    seq.held_from = step
                seq.held.append(token)
                seq.held_at.append(now)
                if token == listen:
                    finished.append(seq)
                    reasons.append("listen")
                else:
                    seq.deciding = False
                continue
            if token == eos:
                finished.append(seq)
                reasons.append("eos")
                continue
            held = seq.held
            if not held:
                seq.held_from = step
            held.append(token)
            seq.held_at.append(now)
            seq.generated += 1
            seq.after_punct = token in punctuation
            self._tokens += 1
            if seq.generated >= seq.job.params.max_tokens or seq.position + 1 >= max_len:
                finished.append(seq)
                reasons.append("length")
        for seq, reason in zip(finished, reasons):
            if reason != "failed":  # a failed row got its SequenceEnded, with the error, above
                seq.flush(outbox)  # its tokens before its ending
                outbox.append((seq.sink, SequenceEnded(seq.job.request_id, reason, step, now)))
        self._produced = True
        # Built only for an observer: its tuple of every row's id is per-step work.
        record = (
            StepRecord(
                index=step,
                request_ids=tuple(s.job.request_id for s in live),
                admitted=admitted,
                finished=tuple(s.job.request_id for s in finished),
                duration_s=now - began,
            )
            if self._observers
            else None
        )
        return finished, reasons, record

    def _sample(
        self, logits: torch.Tensor, live: list[_Live]
    ) -> tuple[list[int | None], dict[str, Exception]]:
        """One token per live sequence. Should the batched sampler fail (one request's knobs it
        cannot take), each row is sampled alone and only the rows that still fail end
        ``failed``: one request's parameters never fail its batch neighbours."""
        if not self._sampling_rows:  # every row greedy (what sample_batch would do, less its lists)
            return logits.argmax(dim=-1).tolist(), {}
        try:
            return sample_batch(
                logits, [s.job.params for s in live], [s.generator for s in live], self._shared_gen
            ).tolist(), {}
        except Exception as batch_exc:
            log.warning("scheduler.batch_sampling_failed", error=repr(batch_exc), batch=len(live))
        picks: list[int | None] = []
        errors: dict[str, Exception] = {}
        for row, seq in enumerate(live):
            try:
                picks.append(
                    sample_batch(
                        logits[row : row + 1], [seq.job.params], [seq.generator], self._shared_gen
                    ).tolist()[0]
                )
            except Exception as exc:
                picks.append(None)
                errors[seq.job.request_id] = exc
        return picks, errors

    def _release(self, gone: list[_Live], reason: str | list[str]) -> None:
        """Give slots back at once, keeping live sequences packed into slots 0..n-1; ``reason``
        is one for all of them, or one per sequence of ``gone``."""
        if not gone:
            return
        reasons = [reason] * len(gone) if isinstance(reason, str) else reason
        why = {id(s): reasons[i] for i, s in enumerate(gone)}
        for seq in sorted(gone, key=lambda s: s.slot, reverse=True):
            last = self._live[-1]
            if last is not seq:
                self._model.move_slot(last.slot, seq.slot, last.position)
                last.slot = seq.slot
                self._live[seq.slot] = last
            self._live.pop()
            self._sampling_rows -= seq.samples
            self._notify(SlotReleased(seq.job.request_id, why[id(seq)], self._steps))

    def _fail_all(self, message: str, outbox: _Outbox) -> None:
        now = time.perf_counter()
        for seq in self._live:
            seq.flush(outbox)
            outbox.append((seq.sink, SequenceEnded(seq.job.request_id, "failed", self._steps, now, message)))
        self._release(list(self._live), "failed")

    def _shutdown(self) -> None:
        now = time.perf_counter()
        outbox: list[tuple[Sink, SchedulerEvent]] = []
        for seq in self._live:
            seq.flush(outbox)
            outbox.append((seq.sink, SequenceEnded(seq.job.request_id, "closed", self._steps, now)))
        self._live.clear()
        self._sampling_rows = 0
        with self._lock:
            outbox += [
                (sink, SequenceEnded(job.request_id, "closed", self._steps, now))
                for job, sink in self._pending.values()
            ]
            self._pending.clear()
            self._queued_of.clear()
            self._line = FairShare()
            self._live_count = 0
        if outbox:
            self._dispatch(outbox)
        log.info("scheduler.stopped", steps=self._steps)
