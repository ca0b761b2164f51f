"""Timers for many sessions on one task, on any anyio backend.

A session under server VAD with ``idle_timeout_ms`` needs a timer that may move on every
response. ``loop.call_later`` gave one per session but exists only on asyncio (the runtime must
also run under trio), so the runtime keeps every timer in one heap, served by one task that
sleeps until the earliest is due. Cancelling only marks a timer: it leaves the heap when it
comes due, which bounds what is kept by the timers set within one timeout's span.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

import anyio


class Timer:
    __slots__ = ("callback", "cancelled")

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class TimerQueue:
    """``call_later(delay, callback)`` for callers on the loop; :meth:`run` fires them."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._order = itertools.count()  # ties fire in the order they were set
        self._wake: anyio.Event | None = None

    def __len__(self) -> int:
        return len(self._heap)

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(callback)
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
                if not timer.cancelled:
                    timer.callback()
            self._wake = wake = anyio.Event()
            delay = heap[0][0] - now if heap else math.inf
            with anyio.move_on_after(delay):
                await wake.wait()
            self._wake = None


__all__ = ["Timer", "TimerQueue"]
