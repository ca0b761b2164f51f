"""Barge-in: aborting a streaming request ends its stream at once and frees it inside vLLM."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

pytest.importorskip("vllm")

from .support import (
    Aborted,
    TextDelta,
    TurnDone,
    check_protocol,
    make_request,
    probe_running,
    wait_until,
)

pytestmark = pytest.mark.vllm

LONG = 900  # far more tokens than the test lets it produce before aborting


def test_abort_ends_the_stream_with_aborted_and_frees_the_request(vllm):
    engine = vllm.engine
    request = make_request(LONG)

    async def scenario():
        outputs, abort_at, end_at = [], None, None
        async for out in engine.generate(request):
            outputs.append(out)
            if abort_at is None and sum(isinstance(o, TextDelta) for o in outputs) == 3:
                abort_at = time.perf_counter()
                await engine.abort(request.request_id)
        end_at = time.perf_counter()
        return outputs, end_at - abort_at

    outputs, stop_s = vllm.run(scenario())
    check_protocol(outputs, request.request_id)
    assert isinstance(outputs[-1], Aborted)
    produced = sum(o.token_count for o in outputs if isinstance(o, TextDelta))
    assert produced < LONG
    assert stop_s < 0.5, f"the stream took {stop_s:.3f} s to end after abort"
    assert engine.num_unfinished_requests() == 0
    assert not engine.in_flight
    # The engine core no longer decodes it: a fresh request runs alone.
    assert vllm.run(probe_running(engine)) == 1


def test_cancelling_the_consumer_aborts_the_vllm_request(vllm):
    engine = vllm.engine
    request = make_request(LONG)

    async def scenario():
        three = asyncio.Event()
        seen = []

        async def consume():
            async for out in engine.generate(request):
                seen.append(out)
                if sum(isinstance(o, TextDelta) for o in seen) >= 3:
                    three.set()

        task = asyncio.create_task(consume())
        await three.wait()
        assert engine.num_unfinished_requests() == 1
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        freed = await wait_until(lambda: engine.num_unfinished_requests() == 0, timeout=2.0)
        return seen, freed

    seen, freed = vllm.run(scenario())
    assert freed, "vLLM still tracks the request after its consumer was cancelled"
    assert not engine.in_flight
    assert not any(isinstance(o, TurnDone) for o in seen)
    assert vllm.run(probe_running(engine)) == 1


def test_closing_the_stream_early_aborts_the_vllm_request(vllm):
    """A consumer that stops iterating and closes the generator (``aclosing``) frees it too."""
    engine = vllm.engine
    request = make_request(LONG)

    async def scenario():
        async with contextlib.aclosing(engine.generate(request)) as stream:
            async for out in stream:
                if isinstance(out, TextDelta):
                    break
        return engine.num_unfinished_requests()

    assert vllm.run(scenario()) == 0
    assert vllm.run(probe_running(engine)) == 1


def test_abort_of_one_session_leaves_the_others_streaming(vllm):
    engine = vllm.engine
    victim, others = make_request(LONG), [make_request(40) for _ in range(3)]

    async def scenario():
        async def run(request, abort_after=None):
            outputs = []
            async for out in engine.generate(request):
                outputs.append(out)
                if abort_after and sum(isinstance(o, TextDelta) for o in outputs) == abort_after:
                    await engine.abort(request.request_id)
            return outputs

        return await asyncio.gather(run(victim, abort_after=2), *(run(r) for r in others))

    victim_out, *other_outs = vllm.run(scenario())
    assert isinstance(victim_out[-1], Aborted)
    for request, outputs in zip(others, other_outs, strict=True):
        check_protocol(outputs, request.request_id)
        assert isinstance(outputs[-1], TurnDone)
        assert sum(o.token_count for o in outputs if isinstance(o, TextDelta)) == 40


def test_abort_of_unknown_or_finished_ids_is_a_no_op(vllm):
    engine = vllm.engine
    request = make_request(4)

    async def scenario():
        outputs = [out async for out in engine.generate(request)]
        await engine.abort(request.request_id)
        await engine.abort("sess_nobody/e0/t0")
        return outputs

    outputs = vllm.run(scenario())
    assert isinstance(outputs[-1], TurnDone)
    assert engine.num_unfinished_requests() == 0
