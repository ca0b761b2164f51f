"""Server VAD for every session of the loop, scored in batches.

Each session's server VAD asks the model about each 32 ms window of its audio. One window at a
time, the Silero network costs a server busy with real-time sessions far more than it costs on
its own (between two windows the loop's other work pushes the network's weights out of the
cache), and it was a large share of such a server's CPU. The network takes a batch
(:meth:`~duplex_actors.audio.vad.SileroVad.score_batch`), which reads the weights once for all
its windows.

So a connection's reader hands the windows an append completes to the :class:`VadBatcher`
instead of scoring them itself. The batcher scores what it was handed together, at most its
window after the first (see :class:`VadBatcher` for what may wait and what may not).

A session's commands still reach it in the order its frames came (a commit never overtakes the
audio before it): the batcher delivers jobs in the order they were submitted, so a later
append's job comes after an earlier one's, and a frame that tells the session anything else
first has the batch scored (SessionReader._tell). The reader does not wait for its job before
reading the client's next frame. It used to, and that cost two or three passes of the loop per
append (the flush, then the waiter's wake-up): on a loop busy with other clients' readers, a
real-time client with server VAD could no longer keep up with its own audio and fell behind
for good, its heartbeats answered later and later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from ..audio.vad import score_frames
from . import frame_cost

if TYPE_CHECKING:
    from ..audio.server_vad import ServerVad
    from ..core.commands import AppendAudio

log = structlog.get_logger("duplex_actors.server.vad_batch")


class VadJob:
    """One append's windows, waiting for their speech probabilities."""

    __slots__ = ("vad", "command", "frames", "deliver", "done", "_batcher", "_waiter")

    def __init__(
        self,
        batcher: VadBatcher,
        vad: ServerVad,
        command: AppendAudio,
        frames: list[bytes],
        deliver: Callable[[VadJob, list[float] | None], None],
    ) -> None:
        self.vad = vad
        self.command = command
        self.frames = frames
        #: Called once, in the order jobs were submitted: the job and the model's probability of
        #: each frame (None: the model failed).
        self.deliver = deliver
        self.done = False
        self._batcher = batcher
        self._waiter: asyncio.Event | None = None

    async def settled(self) -> None:
        """Return once the job has been delivered; a job someone waits for is scored at the
        next pass, not at the end of the batching window."""
        if not self.done:
            # Created only when someone waits: most jobs are delivered before the next frame.
            # Shared by all who wait (the reader, and a resume pushing its connection out).
            if self._waiter is None:
                # asyncio's own event, as the batcher's timers are asyncio's: anyio.Event()
                # looks the backend up on every call, and a server short of CPU has a reader
                # waiting here on nearly every frame.
                self._waiter = asyncio.Event()
            self._batcher.hurry()
            await self._waiter.wait()

    def _finish(self) -> None:
        self.done = True
        if self._waiter is not None:
            self._waiter.set()


class VadBatcher:
    """Collects jobs and scores them together, at most ``window_s`` after the first.

    ``window_s`` is what a batch gets to fill. In a server with many real-time sessions, scoring
    at the next loop pass made batches too small to be cheaper than one window at a time; a few
    milliseconds of waiting fill batches that are. Waiting is only for windows whose answer
    nobody waits on: a job that may end the user's turn (``urgent``: its windows could complete
    server VAD's silence) is scored at the next pass, with whatever is pending, and so is a job
    someone waits for (settled: a resume taking the connection over, the connection's end).
    What waits is the verdict on audio in the middle of speech or silence, and a
    speech_started, which is sent up to ``window_s`` later (a 32 ms window's verdict, after the
    ~100-250 ms a VAD needs to hear speech begin).
    """

    def __init__(self, window_s: float = 0.0) -> None:
        if window_s < 0:
            raise ValueError("window_s must be >= 0")
        self.window_s = window_s
        #: What scoring and delivering one window has cost of late (seconds of the loop
        #: thread's CPU, collections excepted: frame_cost). A client is billed this much a
        #: window when it hands its audio over, not when the batch runs: the readers handling
        #: frames in the meantime must see the bill (billed at the flush, every session of a
        #: flooding client passed the share's check in one pass, and it took several shares).
        self.cost_per_window = 0.0
        self._jobs: list[VadJob] = []
        self._soon = False  # a flush is queued for the next pass
        self._timer: asyncio.TimerHandle | None = None
        self.flushes = 0
        self.windows = 0
        self.largest_batch = 0

    def submit(
        self,
        vad: ServerVad,
        command: AppendAudio,
        frames: list[bytes],
        deliver: Callable[[VadJob, list[float] | None], None],
        *,
        urgent: bool = False,
    ) -> VadJob:
        job = VadJob(self, vad, command, frames, deliver)
        self._jobs.append(job)
        if urgent or not self.window_s:
            self.hurry()
        elif self._timer is None and not self._soon:
            self._timer = asyncio.get_running_loop().call_later(self.window_s, self.flush)
        return job

    def hurry(self) -> None:
        """Score what is pending at the next pass of the loop."""
        if self._jobs and not self._soon:
            self._soon = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> float:
        """Score every job submitted so far and deliver each, in submission order. Returns the
        loop thread's CPU it took (frame_cost), which each job's client was billed in advance."""
        self._soon = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        jobs, self._jobs = self._jobs, []
        if not jobs:
            return 0.0
        began = frame_cost.mark()
        scored = self._score(jobs)
        for job in jobs:
            try:
                job.deliver(job, scored.get(id(job)))
            except Exception as exc:  # one session's failure is not its neighbours'
                log.error("server.vad_delivery_failed", error=repr(exc))
            finally:
                job._finish()
        windows = sum(len(job.frames) for job in jobs)
        took = frame_cost.billed_since(began)
        per_window = took / windows
        # A recent average: a single flush is noisy (a collection, a cold cache).
        self.cost_per_window = (
            per_window
            if not self.flushes
            else self.cost_per_window + 0.1 * (per_window - self.cost_per_window)
        )
        self.flushes += 1
        self.windows += windows
        return took

    def _score(self, jobs: list[VadJob]) -> dict[int, list[float]]:
        """Each job's probabilities by ``id(job)``; a job whose model failed is left out.

        A stream's windows depend on each other (the network is recurrent), so each round
        scores at most one window of each stream: the r-th window of every stream that has r+1
        in this flush, in order."""
        queues: dict[int, list[tuple[VadJob, int]]] = {}
        for job in jobs:
            queue = queues.setdefault(id(job.vad), [])
            queue.extend((job, k) for k in range(len(job.frames)))
        results: dict[int, list[float]] = {id(job): [0.0] * len(job.frames) for job in jobs}
        failed: set[int] = set()
        depth = max(len(queue) for queue in queues.values())
        for r in range(depth):
            entries = [queue[r] for queue in queues.values() if len(queue) > r]
            entries = [(job, k) for job, k in entries if id(job.vad) not in failed]
            if not entries:
                continue
            self.largest_batch = max(self.largest_batch, len(entries))
            try:
                probabilities = score_frames(
                    [job.vad.model for job, _ in entries], [job.frames[k] for job, k in entries]
                )
            except Exception as exc:
                # One model's failure fails the whole batch: score the round one by one, so
                # that it costs only the streams whose own model fails.
                log.warning("server.vad_batch_failed", error=repr(exc), windows=len(entries))
                probabilities = []
                for job, k in entries:
                    try:
                        probabilities.append(job.vad.model.probability(job.frames[k]))
                    except Exception as one:
                        log.error("server.vad_failed", error=repr(one))
                        failed.add(id(job.vad))
                        probabilities.append(0.0)
            for (job, k), p in zip(entries, probabilities):
                results[id(job)][k] = p
        return {id(job): results[id(job)] for job in jobs if id(job.vad) not in failed}
