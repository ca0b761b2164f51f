"""Which event loop a server process runs on (server/event_loop.py, ``serve --loop``)."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect

import pytest

from duplex_actors.server import event_loop
from duplex_actors.server.event_loop import EventLoopChoice, EventLoopUnavailable

needs_uvloop = pytest.mark.skipif(
    importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed"
)


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


@needs_uvloop
@pytest.mark.parametrize(
    ("asked", "runs"), [("auto", "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")]
)
def test_run_runs_the_loop_asked_for(asked, runs):
    assert event_loop.resolve(asked) is EventLoopChoice(runs)
    assert event_loop.run(_loop_module(), asked) == runs


@needs_uvloop
@pytest.mark.parametrize(("asked", "uses_uvloop"), [("auto", True), ("asyncio", False)])
def test_run_anyio_runs_the_loop_asked_for(asked, uses_uvloop):
    modules = event_loop.run_anyio(_loop_module, choice=asked)
    assert (modules == "uvloop") is uses_uvloop


def test_without_uvloop_auto_is_asyncio_and_asking_for_uvloop_is_a_typed_error(monkeypatch):
    monkeypatch.setattr(event_loop, "_uvloop_factory", lambda: None)
    assert event_loop.resolve("auto") is EventLoopChoice.asyncio
    assert event_loop.loop_factory("auto") is None
    assert event_loop.run(_loop_module(), "auto") == "asyncio"
    with pytest.raises(EventLoopUnavailable, match="uvloop is not installed"):
        event_loop.resolve(EventLoopChoice.uvloop)
    # The coroutine handed to run is closed, not left to warn that it was never awaited.
    main = _loop_module()
    with pytest.raises(EventLoopUnavailable):
        event_loop.run(main, "uvloop")
    assert inspect.getcoroutinestate(main) == inspect.CORO_CLOSED


def test_an_unknown_loop_is_refused():
    with pytest.raises(ValueError):
        event_loop.resolve("trio")
