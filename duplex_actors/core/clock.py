"""Clocks are injected: the core never reads time on its own, so tests drive it exactly."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic clock."""


class MonotonicClock:
    """The real clock: ``time.perf_counter()`` seconds. Tests inject :class:`ManualClock` instead."""

    __slots__ = ()

    # The builtin itself, not a method calling it: the runtime reads the clock dozens of times
    # a turn, and a Python frame per read was most of each read's cost.
    now = staticmethod(time.perf_counter)


class ManualClock:
    """A clock tests move by hand; it never goes backwards."""

    __slots__ = ("_t",)

    def __init__(self, start: float = 0.0) -> None:
        self._t = start

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go backwards")
        self._t += seconds
        return self._t


MONOTONIC = MonotonicClock()
