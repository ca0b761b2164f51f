"""Crash and restart. Named to run last: it kills the shared engine (the ``vllm`` fixture
starts it again for any test that runs after)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

pytest.importorskip("vllm")

from .support import (
    Aborted,
    EngineFailure,
    TextDelta,
    TurnDone,
    check_protocol,
    collect,
    make_request,
)

pytestmark = pytest.mark.vllm


def _alive(pid: int) -> bool:
    """Running, not a zombie (a stopped watcher is waited for by its owner)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_engine_death_fails_in_flight_streams_and_start_restarts(vllm):
    engine = vllm.engine
    victims = [make_request(2000) for _ in range(2)]
    starts_before = engine.starts
    old_guard = engine.orphan_guard
    assert old_guard is not None and old_guard.pids == tuple(sorted(engine.engine_process_ids()))

    async def crash():
        streaming = asyncio.Event()

        async def consume(request):
            outputs = []
            async for out in engine.generate(request):
                outputs.append(out)
                if isinstance(out, TextDelta):
                    streaming.set()
            return outputs

        tasks = [asyncio.create_task(consume(r)) for r in victims]
        await streaming.wait()
        pids = engine.engine_process_ids()
        assert pids, "no engine-core process to kill"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    results = vllm.run(crash())
    for request, outputs in zip(victims, results, strict=True):
        check_protocol(outputs, request.request_id)
        failure = outputs[-1]
        assert isinstance(failure, EngineFailure) and failure.retryable, outputs[-1]
    assert not engine.running
    assert not engine.in_flight

    # While dead, new turns fail at once instead of hanging.
    late = make_request(4)
    dead_outputs = vllm.run(collect(engine, late))
    assert len(dead_outputs) == 1 and isinstance(dead_outputs[0], EngineFailure)
    assert dead_outputs[0].retryable

    vllm.run(engine.start(), timeout=300)
    assert engine.running and engine.starts == starts_before + 1
    # The dead engine's watcher was stopped, not left beside the new engine's.
    assert not _alive(old_guard.watcher_pid)
    new_guard = engine.orphan_guard
    assert new_guard is not None and _alive(new_guard.watcher_pid)
    assert new_guard.pids == tuple(sorted(engine.engine_process_ids()))
    request = make_request(8)
    outputs = vllm.run(collect(engine, request))
    check_protocol(outputs, request.request_id)
    assert isinstance(outputs[-1], TurnDone) and outputs[-1].metrics.source == "vllm"


def test_aclose_ends_in_flight_streams_with_aborted(vllm):
    engine = vllm.engine
    request = make_request(2000)

    async def scenario():
        streaming = asyncio.Event()
        outputs = []

        async def consume():
            async for out in engine.generate(request):
                outputs.append(out)
                streaming.set()

        task = asyncio.create_task(consume())
        await streaming.wait()
        await engine.aclose()
        await asyncio.wait_for(task, 10)
        return outputs

    guard = engine.orphan_guard
    assert guard is not None
    outputs = vllm.run(scenario())
    check_protocol(outputs, request.request_id)
    assert isinstance(outputs[-1], Aborted)
    assert not engine.running
    assert engine.orphan_guard is None and not _alive(guard.watcher_pid)
    # Started again by the fixture for any later test; closing twice is harmless.
    vllm.run(engine.aclose())
