"""Which event loop a server process runs on: asyncio's own, or uvloop's.

A ``serve`` process spends most of its time in the event loop's plumbing around each frame:
waking on a readable socket, reading it, calling the protocol, writing replies. asyncio's
selector loop does that in Python, over Python transports; uvloop does it in C over libuv, and
reads every socket into one buffer the loop keeps, where asyncio allocates a fresh
``max_size`` block per read and shrinks it (server/memory.py). The server's code is the same on
both (tests/server runs once more on uvloop in CI); the measurements that chose the default are
in docs/benchmarks.md ("uvloop as serve's loop").

``auto`` (the default) takes uvloop where it can be imported (the ``server`` extra installs it
on the platforms it supports), asyncio elsewhere. ``asyncio`` asks for asyncio's loop whatever
is installed; ``uvloop`` asks for uvloop and fails with :class:`EventLoopUnavailable` without
it, rather than quietly running something else.

Every process of a ``serve --workers`` tree (front, workers, engine) runs the same choice.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class EventLoopChoice(str, enum.Enum):
    auto = "auto"
    asyncio = "asyncio"
    uvloop = "uvloop"


class EventLoopUnavailable(RuntimeError):
    """The event loop asked for cannot run here (uvloop is not installed, or has no build for
    this platform)."""


def _uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def resolve(choice: EventLoopChoice | str) -> EventLoopChoice:
    """The loop ``choice`` means here: ``asyncio`` or ``uvloop``, never ``auto``."""
    choice = EventLoopChoice(choice)
    if choice is EventLoopChoice.asyncio:
        return choice
    if _uvloop_factory() is not None:
        return EventLoopChoice.uvloop
    if choice is EventLoopChoice.uvloop:
        raise EventLoopUnavailable(
            "uvloop is not installed (pip install 'duplex-actors[server]' on Linux or macOS), "
            "or choose the asyncio loop"
        )
    return EventLoopChoice.asyncio


def loop_factory(choice: EventLoopChoice | str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What builds the loop ``choice`` means (None: asyncio's default policy)."""
    if resolve(choice) is EventLoopChoice.uvloop:
        return _uvloop_factory()
    return None


def run(main: Coroutine[Any, Any, T], choice: EventLoopChoice | str) -> T:
    """``asyncio.run(main)`` on the loop ``choice`` means."""
    try:
        factory = loop_factory(choice)
    except EventLoopUnavailable:
        main.close()  # never awaited: say nothing of it, the error says why
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def run_anyio(func: Callable[..., Awaitable[T]], *args: Any, choice: EventLoopChoice | str) -> T:
    """``anyio.run(func, *args)`` on asyncio, on the loop ``choice`` means."""
    import anyio

    uvloop = resolve(choice) is EventLoopChoice.uvloop
    return anyio.run(func, *args, backend="asyncio", backend_options={"use_uvloop": uvloop})


__all__ = ["EventLoopChoice", "EventLoopUnavailable", "loop_factory", "resolve", "run", "run_anyio"]
