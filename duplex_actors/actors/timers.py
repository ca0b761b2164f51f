"""Timers for many sessions on one task, on any anyio backend.

A session under server VAD with ``idle_timeout_ms`` needs a timer that may move on every
response. ``loop.call_later`` gave one per session but exists only on asyncio (the runtime must
also run under trio), so the runtime keeps every timer in one heap, served by one task that
sleeps until the earliest is due.

Cancelling a timer lets go of its callback at once, and the heap is rebuilt without the
cancelled timers once they are most of it. Cancelling used to only mark a timer, which left the
heap when it came due: a session's idle timer (a bound method: the session, its journal, its
conversation) kept a closed session whole until the timeout it had been set for, up to an hour
of a client's choosing, and a client moving its timeout over and over added an entry each time.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

import anyio


def _nothing() -> None:
    """What a cancelled timer calls: nothing, and it holds nothing alive."""


class Timer:
    __slots__ = ("callback", "cancelled", "_queue")

    def __init__(self, callback: Callable[[], None], queue: TimerQueue | None = None) -> None:
        self.callback = callback
        self.cancelled = False
        self._queue = queue

    def cancel(self) -> None:
        if self.cancelled:
            return
        self.cancelled = True
        self.callback = _nothing  # what the callback holds goes now, not when the timer is due
        queue, self._queue = self._queue, None
        if queue is not None:
            queue._cancelled_one()


class TimerQueue:
    """``call_later(delay, callback)`` for callers on the loop; :meth:`run` fires them."""

    #: The heap is rebuilt without its cancelled timers once they are more than half of it and
    #: at least this many: a rebuild then costs about as much as the cancels since the last.
    COMPACT_AT = 64

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._order = itertools.count()  # ties fire in the order they were set
        self._wake: anyio.Event | None = None
        #: Cancelled timers still in the heap.
        self._cancelled = 0

    def __len__(self) -> int:
        """Timers in the heap, cancelled ones not yet dropped included."""
        return len(self._heap)

    @property
    def pending(self) -> int:
        """Timers that will still fire."""
        return len(self._heap) - self._cancelled

    def _cancelled_one(self) -> None:
        self._cancelled += 1
        heap = self._heap
        if self._cancelled >= self.COMPACT_AT and 2 * self._cancelled > len(heap):
            # In place: the runner holds this list. Dropping entries keeps the others' order
            # (due, then the order they were set), and a heap of them is rebuilt in linear time.
            heap[:] = [entry for entry in heap if not entry[2].cancelled]
            heapq.heapify(heap)
            self._cancelled = 0

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(callback, self)
        due = anyio.current_time() + max(delay, 0.0)
        heapq.heappush(self._heap, (due, next(self._order), timer))
        if self._heap[0][2] is timer and self._wake is not None:
            self._wake.set()  # due before whatever the runner sleeps towards
        return timer

    async def run(self) -> None:
        """Fire each timer when due, until cancelled."""
        heap = self._heap
        while True:
            now = anyio.current_time()
            while heap and heap[0][0] <= now:
                _, _, timer = heapq.heappop(heap)
                if timer.cancelled:
                    self._cancelled -= 1
                else:
                    timer._queue = None  # fired: a cancel from now on changes no count
                    timer.callback()
            self._wake = wake = anyio.Event()
            delay = heap[0][0] - now if heap else math.inf
            with anyio.move_on_after(delay):
                await wake.wait()
            self._wake = None


__all__ = ["Timer", "TimerQueue"]
