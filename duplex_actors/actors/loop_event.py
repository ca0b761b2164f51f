"""A one-shot event (``set``, ``is_set``, ``wait``): ``anyio.Event``, cheaper on asyncio.

The runtime makes one for every wait of its busiest tasks: the dispatcher's between rounds, a
session reader's between bursts of events, an ask's reply, a parked engine pump. On asyncio
``anyio.Event`` wraps an ``asyncio.Event``, which keeps a deque of waiters and binds itself to
the loop (under a global lock) on its first wait: each event is three objects before its
waiter's future, and each wait, set and wake-up passes through both classes' frames. An event
that is made, waited on once and set once needs little more than that future, so on asyncio
:func:`event_class` gives :class:`LoopEvent`: the same contract (a set event stays set;
waiting on it returns after a checkpoint, as ``anyio.Event.wait`` does; any number of waiters,
each woken once) with a flag and the waiters' futures as its only state. Under any other
library (trio, through anyio) it is ``anyio.Event`` itself.

A waiter cancelled while it waits (a task group's cancel, a deadline) has its future
cancelled by asyncio: ``set`` skips a future already done, and the waiter forgets it on its
way out, so a later ``set`` or wait is unaffected.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import anyio


class OneShotEvent(Protocol):
    """What the runtime asks of an event: ``anyio.Event``'s set, is_set and wait."""

    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    async def wait(self) -> None: ...


class LoopEvent:
    """``anyio.Event`` on asyncio, as a flag and its waiters' futures (module doc)."""

    __slots__ = ("_set", "_waiter", "_more")

    def __init__(self) -> None:
        self._set = False
        # The first waiter's future, and any later ones': nearly every event has one waiter.
        self._waiter: asyncio.Future[None] | None = None
        self._more: list[asyncio.Future[None]] | None = None

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self._more is not None:
            for waiter in self._more:
                if not waiter.done():
                    waiter.set_result(None)

    def is_set(self) -> bool:
        return self._set

    async def wait(self) -> None:
        if self._set:
            # anyio.Event.wait checkpoints on a set event too: a wait is always one.
            await asyncio.sleep(0)
            return
        waiter = asyncio.get_running_loop().create_future()
        if self._waiter is None:
            self._waiter = waiter
        else:
            if self._more is None:
                self._more = []
            self._more.append(waiter)
        try:
            await waiter
        finally:
            if self._waiter is waiter:
                self._waiter = None
            elif self._more is not None:
                self._more.remove(waiter)


def event_class() -> Callable[[], OneShotEvent]:
    """The event class for the running async library: :class:`LoopEvent` on asyncio, else the
    library's ``anyio.Event`` (made directly: ``anyio.Event()`` looks the library up on every
    call)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (trio under anyio)
        return type(anyio.Event())
    return LoopEvent


__all__ = ["LoopEvent", "OneShotEvent", "event_class"]
