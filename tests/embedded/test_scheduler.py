"""Continuous batching against the real (small) thinker: shared steps, abort, admission."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("torch")

from duplex_actors.core.engine_io import Aborted, Decision, SamplingOverrides, TextDelta, TurnDone, TurnKind
from duplex_actors.engines.embedded import SamplingParams, SlotReleased, StepRecord
from duplex_actors.errors import EngineCapacityError

from .helpers import request, run, small_engine

pytestmark = pytest.mark.embedded

# Long, EOS-free responses so requests are surely alive together.
LONG = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40)


def _noise(seed: int) -> bytes:
    import numpy as np

    rng = np.random.default_rng(seed)
    amplitude = [0, 30, 300, 3000, 12000][seed % 5]
    return (rng.standard_normal(16000) * amplitude).clip(-32768, 32767).astype("<i2").tobytes()


async def _drain(engine, req):
    return [out async for out in engine.generate(req)]


def _hold_decoding_after_the_first_step(engine) -> threading.Event:
    """Stop the decode thread after its first step until the returned event is set.

    Tests that fill the queue behind one running request need that request to keep its slot:
    on a fast host its 40 tokens finished first, the slot passed to the next in line and the
    queue had room again. Step 1 is the admission pass, whose dispatch carries the decision,
    so a consumer still gets its first output."""
    decoding = threading.Event()
    engine.scheduler.add_observer(
        lambda r: decoding.wait(30) if isinstance(r, StepRecord) and r.index > 1 else None
    )
    return decoding


def test_requests_of_two_sessions_share_one_decode_step():
    async def main():
        engine = small_engine(sampling=LONG)
        await engine.start()
        records: list[StepRecord] = []
        engine.scheduler.add_observer(lambda r: records.append(r) if isinstance(r, StepRecord) else None)
        try:
            a, b = await asyncio.gather(_drain(engine, request("sess_a")), _drain(engine, request("sess_b")))
        finally:
            await engine.aclose()
        return a, b, records

    a, b, records = run(main())
    assert isinstance(a[-1], TurnDone) and isinstance(b[-1], TurnDone)
    shared = [r for r in records if {"sess_a/e0/t0", "sess_b/e0/t0"} <= set(r.request_ids)]
    assert shared, "the two sessions never shared a decode step"
    # Every step decodes each live request once, so 40 tokens each needs ~40 steps, not 80.
    assert len(records) < 60


def test_cancelling_the_consumer_frees_the_slot_within_one_step():
    async def main():
        engine = small_engine(sampling=LONG)
        await engine.start()
        events: list = []
        engine.scheduler.add_observer(events.append)
        rid = "sess_x/e0/t0"
        released = asyncio.Event()
        loop = asyncio.get_running_loop()
        engine.scheduler.add_observer(
            lambda r: (
                loop.call_soon_threadsafe(released.set)
                if isinstance(r, SlotReleased) and r.request_id == rid
                else None
            )
        )
        got_text = asyncio.Event()

        async def consume():
            async for out in engine.generate(request("sess_x")):
                if isinstance(out, TextDelta) and out.text:
                    got_text.set()

        # A second live session keeps the decode loop busy while the first is cancelled.
        other = asyncio.create_task(_drain(engine, request("sess_y")))
        task = asyncio.create_task(consume())
        await got_text.wait()
        # "Within one step" counts from the moment the abort reaches the scheduler: how soon
        # the event loop runs the cancelled task depends on the loop's load, not the engine.
        scheduler = engine.scheduler
        original_cancel = scheduler.cancel
        at_cancel: list[int] = []

        def recording_cancel(request_id):
            at_cancel.append(scheduler.stats().steps)
            original_cancel(request_id)

        scheduler.cancel = recording_cancel
        task.cancel()
        await asyncio.wait_for(released.wait(), 5)
        await other
        await engine.aclose()
        assert at_cancel, "cancelling the consumer never reached the scheduler"
        return rid, at_cancel[0], events

    rid, steps_at_abort, events = run(main())
    release = next(e for e in events if isinstance(e, SlotReleased) and e.request_id == rid)
    assert release.reason == "aborted"
    assert release.steps_completed <= steps_at_abort + 1
    later = [e.index for e in events if isinstance(e, StepRecord) and rid in e.request_ids]
    assert max(later) <= steps_at_abort + 1


def test_engine_abort_ends_the_stream_with_aborted():
    async def main():
        engine = small_engine(sampling=LONG)
        await engine.start()
        req = request("sess_z")
        outs = []
        async for out in engine.generate(req):
            outs.append(out)
            if isinstance(out, TextDelta):
                await engine.abort(req.request_id)
        stats = engine.scheduler.stats()
        await engine.aclose()
        return outs, stats

    outs, stats = run(main())
    assert isinstance(outs[0], Decision) and outs[0].speak
    assert isinstance(outs[-1], Aborted)
    assert sum(isinstance(o, TextDelta) for o in outs) < 40
    assert stats.active == 0


def test_admission_past_the_queue_bound_raises_capacity_error():
    async def main():
        engine = small_engine(sampling=LONG, max_concurrency=1, max_queue=1)
        await engine.start()
        decoding = _hold_decoding_after_the_first_step(engine)
        running = engine.generate(request("sess_1"))
        first = await running.__anext__()  # admitted and decoding
        queued = asyncio.create_task(_drain(engine, request("sess_2")))
        while engine.scheduler.stats().queued == 0:
            await asyncio.sleep(0.001)
        with pytest.raises(EngineCapacityError):
            await engine.generate(request("sess_3")).__anext__()
        decoding.set()
        rest = [out async for out in running]
        second = await queued
        await engine.aclose()
        return first, rest, second

    first, rest, second = run(main())
    assert isinstance(first, Decision)
    assert isinstance(rest[-1], TurnDone) and isinstance(second[-1], TurnDone)


def test_one_tenant_fills_three_quarters_of_the_queue_at_most():
    # A client with many sessions, each asking for a response, filled the slots and then the
    # whole queue: every other client's next request was refused until it let go.
    async def main():
        engine = small_engine(sampling=LONG, max_concurrency=1, max_queue=4)
        await engine.start()
        assert engine.scheduler.max_queue_per_tenant == 3
        decoding = _hold_decoding_after_the_first_step(engine)
        running = engine.generate(request("flood_0", tenant="key:flooder"))
        await running.__anext__()  # admitted and decoding: the one slot is taken
        queued = {}

        async def queue(name: str, tenant: str) -> None:
            submitted = engine.scheduler.stats().submitted
            queued[name] = asyncio.create_task(_drain(engine, request(name, tenant=tenant)))
            while engine.scheduler.stats().submitted == submitted:
                await asyncio.sleep(0.001)

        for i in (1, 2, 3):
            await queue(f"flood_{i}", "key:flooder")
        with pytest.raises(EngineCapacityError, match="this client already has 3 requests waiting"):
            await engine.generate(request("flood_4", tenant="key:flooder")).__anext__()
        await queue("mine", "key:neighbour")  # the place kept for the others
        with pytest.raises(EngineCapacityError, match="engine queue is full"):
            await engine.generate(request("other", tenant="key:other")).__anext__()
        # A queued request cancelled gives its client's place back.
        queued.pop("flood_1").cancel()
        while engine.scheduler.stats().queued == 4:
            await asyncio.sleep(0.001)
        await queue("flood_4", "key:flooder")
        decoding.set()
        await running.aclose()
        for task in queued.values():
            task.cancel()
        await engine.aclose()

    run(main())


def test_queued_requests_are_admitted_in_fifo_order():
    async def main():
        engine = small_engine(
            sampling=SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8), max_concurrency=1
        )
        await engine.start()
        order: list[str] = []

        async def one(name):
            async for out in engine.generate(request(name)):
                if isinstance(out, Decision):
                    order.append(name)

        names = [f"sess_{i}" for i in range(5)]
        tasks = []
        for n, name in enumerate(names, start=1):
            tasks.append(asyncio.create_task(one(name)))
            while engine.scheduler.stats().submitted < n:  # submission order = name order
                await asyncio.sleep(0.0005)
        await asyncio.gather(*tasks)
        await engine.aclose()
        return names, order

    names, order = run(main())
    assert order == names


def test_a_tenants_queued_requests_do_not_hold_a_neighbours_behind_them_all():
    async def main():
        engine = small_engine(
            sampling=SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8), max_concurrency=1
        )
        await engine.start()
        # The first job's prompt is built (on the worker) only once everything is queued, so
        # the order does not depend on how fast this host decodes.
        queued = threading.Event()
        build = engine.adapter.build_prompt

        def build_when_all_queued(request, **how):
            if request.fence.session_id == "flood_0":
                queued.wait(10)
            return build(request, **how)

        engine.thinker.adapter.build_prompt = build_when_all_queued
        order: list[str] = []

        async def one(name, tenant):
            async for out in engine.generate(request(name, tenant=tenant)):
                if isinstance(out, Decision):
                    order.append(name)

        # One client's five sessions queue a request each, then a neighbour's: one slot.
        submissions = [(f"flood_{i}", "key:flooder") for i in range(5)] + [("mine", "key:neighbour")]
        tasks = []
        for n, (name, tenant) in enumerate(submissions, start=1):
            tasks.append(asyncio.create_task(one(name, tenant)))
            while engine.scheduler.stats().submitted < n:
                await asyncio.sleep(0.0005)
        queued.set()
        await asyncio.gather(*tasks)
        await engine.aclose()
        return order

    order = run(main())
    # flood_0 took the slot at once; the neighbour goes next, then the flooder's own, in order.
    assert order == ["flood_0", "mine", "flood_1", "flood_2", "flood_3", "flood_4"]


def test_unit_turns_get_a_decision_first_and_listen_is_terminal():
    async def main():
        engine = small_engine(sampling=SamplingParams(temperature=1.0, top_k=0, max_tokens=4, min_tokens=0))
        await engine.start()
        results = await asyncio.gather(
            *[
                _drain(
                    engine,
                    request(
                        f"sess_u{i}",
                        kind=TurnKind.UNIT,
                        unit=i,
                        audio=_noise(i),
                        sampling=SamplingOverrides(seed=i),
                    ),
                )
                for i in range(48)
            ]
        )
        await engine.aclose()
        return results

    results = run(main())
    for outs in results:
        assert isinstance(outs[0], Decision)
        if outs[0].speak:
            assert isinstance(outs[-1], TurnDone)
        else:
            assert outs == [outs[0]]
    decisions = {outs[0].speak for outs in results}
    assert decisions == {True, False}, "48 different units all decided the same way"


def _poison_session(engine, session_id: str, poison) -> None:
    """Give one session sampling parameters that slipped past validation (``poison`` edits the
    resolved params): what the scheduler must survive without failing that session's neighbours."""
    adapter = engine.adapter
    original = adapter.sampling_for

    def sampling_for(sid, overrides=SamplingOverrides()):
        params = original(sid, overrides)
        return poison(params) if sid == session_id else params

    adapter.sampling_for = sampling_for


@pytest.mark.parametrize("poison", ["seed_past_64_bits", "unsamplable_temperature"])
def test_one_request_with_bad_sampling_fails_alone_and_its_batch_neighbours_complete(poison):
    import attrs

    def seed_past_64_bits(params):
        return attrs.evolve(params, seed=2**70)  # torch's manual_seed refuses it at admission

    def unsamplable_temperature(params):
        params = attrs.evolve(params, temperature=0.7)
        object.__setattr__(params, "temperature", complex(1, 1))  # fails in the batched sampler
        return params

    async def main():
        engine = small_engine(sampling=LONG)
        _poison_session(
            engine,
            "sess_bad",
            {"seed_past_64_bits": seed_past_64_bits, "unsamplable_temperature": unsamplable_temperature}[
                poison
            ],
        )
        await engine.start()
        try:
            return await asyncio.gather(
                *(_drain(engine, request(sid)) for sid in ("sess_a", "sess_bad", "sess_b"))
            )
        finally:
            await engine.aclose()

    a, bad, b = run(main())
    assert isinstance(a[-1], TurnDone) and isinstance(b[-1], TurnDone), "a neighbour was failed"
    assert all(sum(o.token_count for o in outs if isinstance(o, TextDelta)) >= 10 for outs in (a, b))
    assert not isinstance(bad[-1], TurnDone), f"the bad request should fail: {bad[-1]!r}"


def test_a_greedy_request_says_the_same_alone_and_beside_a_sampled_one():
    """Steps whose rows are all greedy skip the sampler (argmax only); a step with a sampled
    row goes through it. The greedy request's words must not depend on which one ran, and the
    fast path must come back once the sampled request has left."""
    sampled = SamplingOverrides(temperature=1.0, top_k=0, seed=7, max_tokens=12)

    async def main():
        engine = small_engine(sampling=LONG)
        await engine.start()
        try:
            alone = await _drain(engine, request("sess_g", turn=0))
            beside, _ = await asyncio.gather(
                _drain(engine, request("sess_g", turn=1)), _drain(engine, request("sess_s", sampling=sampled))
            )
            rows_left = engine.scheduler._sampling_rows
            after = await _drain(engine, request("sess_g", turn=2))
        finally:
            await engine.aclose()
        return alone, beside, after, rows_left

    def words(outs) -> str:
        assert isinstance(outs[-1], TurnDone), outs[-1]
        return "".join(o.text for o in outs if isinstance(o, TextDelta))

    alone, beside, after, rows_left = run(main())
    assert words(alone) and words(alone) == words(beside) == words(after)
    assert rows_left == 0
