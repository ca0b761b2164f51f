"""Committed turns waiting for the recogniser, shared fairly between sessions.

The recogniser is one worker process (PocketSphinx holds the GIL and decodes at 0.1-0.8 of
real time here, depending on the audio), shared by every session that asks for input
transcription. Served first come, first served, one session committing faster than the
recogniser decodes (server pacing lets a client send 4x real time) queued its turns in front of
everyone else's, without limit: a neighbour's transcript waited for all of them, and each
waiting turn held its audio.

So the queue is sans-IO and fair:

* one FIFO per session, and sessions take turns (round robin): a neighbour's turn waits for the
  turns being decoded and at most one more turn of each other session with work queued,
  whatever their backlogs;
* each session's backlog is bounded in seconds of audio (``max_backlog_s``): a turn past it is
  refused at once, and the runtime answers it with a transcription ``failed`` event saying
  why. Every turn is transcribed or refused exactly once; memory held is at most the bound per
  session;
* a closed session's queued turns are forgotten: nobody is left to tell.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

import attrs

from ..core.actions import InputTranscript, TranscribeInput


@attrs.frozen(slots=True)
class TranscriptionJob:
    """One committed turn to transcribe, and where its result goes."""

    session_id: str
    action: TranscribeInput
    deliver: Callable[[InputTranscript], None] = attrs.field(eq=False)

    @property
    def seconds(self) -> float:
        return len(self.action.audio) / (2 * self.action.sample_rate)


class TranscriptionQueue:
    """Per-session FIFOs served round robin; each session's backlog at most ``max_backlog_s``."""

    __slots__ = ("max_backlog_s", "_queues", "_backlog_s")

    def __init__(self, max_backlog_s: float) -> None:
        if max_backlog_s <= 0:
            raise ValueError("need max_backlog_s > 0")
        self.max_backlog_s = max_backlog_s
        # Sessions with work queued, in the order they are served next.
        self._queues: OrderedDict[str, deque[TranscriptionJob]] = OrderedDict()
        self._backlog_s: dict[str, float] = {}

    def offer(self, job: TranscriptionJob) -> bool:
        """Queue ``job``; False (nothing queued) if its session's backlog would pass the bound.

        A single turn longer than the bound is still taken when nothing of its session waits:
        the bound is against piling up, not against long turns."""
        sid = job.session_id
        backlog = self._backlog_s.get(sid, 0.0)
        if backlog and backlog + job.seconds > self.max_backlog_s:
            return False
        self._backlog_s[sid] = backlog + job.seconds
        queue = self._queues.get(sid)
        if queue is None:
            queue = self._queues[sid] = deque()
        queue.append(job)
        return True

    def take(self) -> TranscriptionJob | None:
        """The next job: the oldest of the session whose turn it is (None: nothing queued)."""
        if not self._queues:
            return None
        sid, queue = next(iter(self._queues.items()))
        job = queue.popleft()
        if queue:
            self._queues.move_to_end(sid)  # its next turn comes after every other session's
        else:
            del self._queues[sid]
        return job

    def done(self, job: TranscriptionJob) -> None:
        """``job`` (from :meth:`take`) has been answered: its audio no longer counts."""
        left = self._backlog_s.get(job.session_id, 0.0) - job.seconds
        if left > 1e-9:
            self._backlog_s[job.session_id] = left
        else:
            self._backlog_s.pop(job.session_id, None)

    def forget(self, session_id: str) -> int:
        """Drop a closed session's queued turns; how many were dropped."""
        queue = self._queues.pop(session_id, None)
        if queue is None:
            return 0
        for job in queue:
            self.done(job)
        return len(queue)

    def backlog_s(self, session_id: str) -> float:
        """Seconds of ``session_id``'s audio queued or being transcribed."""
        return self._backlog_s.get(session_id, 0.0)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())
