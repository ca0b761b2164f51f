"""EngineActor.submit starts a request's stream from the submitting task: no actor-loop hop,
and the stream starts ahead of whatever the same step woke. The invariants stay: exactly one
terminal per request, and a request aborted before its stream started never reaches the engine."""

from __future__ import annotations

import anyio
import pytest

from duplex_actors.actors.engine_actor import EngineActor
from duplex_actors.core.engine_io import Aborted, EngineFailure, ModelTurnRequest, TurnDone, TurnKind
from duplex_actors.core.fence import Fence
from duplex_actors.engines.scripted import Script, ScriptedEngine

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


def request(turn: int = 0) -> ModelTurnRequest:
    fence = Fence("sess_submit00000000000000", 0, turn)
    return ModelTurnRequest(fence.request_id(), fence, TurnKind.RESPONSE, b"\0\0" * 160)


class Recording(ScriptedEngine):
    def __init__(self, order: list[str]) -> None:
        super().__init__(Script(tokens=("a",), audio_packets=1, packet_ms=20))
        self.order = order

    async def generate(self, request):
        self.order.append("engine started")
        async for output in super().generate(request):
            yield output


# asyncio runs what was started in one step in that order; trio deliberately does not promise
# any order among tasks that became runnable together, so this ordering is asyncio's only.
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_stream_starts_ahead_of_tasks_woken_in_the_same_step():
    order: list[str] = []
    actor = EngineActor(Recording(order))
    woken = anyio.Event()
    done = anyio.Event()

    async def other_task() -> None:  # e.g. the connection's writer, woken by the same step
        await woken.wait()
        order.append("woken task ran")

    def deliver(output) -> None:
        if isinstance(output, TurnDone):
            done.set()

    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        tg.start_soon(other_task)
        await anyio.sleep(0.01)  # other_task is waiting
        actor.submit(request(), deliver)
        woken.set()
        with anyio.fail_after(5):
            await done.wait()
        tg.cancel_scope.cancel()
    assert order == ["engine started", "woken task ran"]


async def test_a_request_aborted_in_the_step_that_submitted_it_never_reaches_the_engine():
    backend = ScriptedEngine(Script(tokens=("a",), audio_packets=1, packet_ms=20))
    actor = EngineActor(backend)
    received: list = []
    req = request()
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        actor.submit(req, received.append)
        actor.abort([req.request_id])
        with anyio.fail_after(5):
            while not received:
                await anyio.sleep(0.001)
        await anyio.sleep(0.02)  # anything after the terminal would arrive now
        tg.cancel_scope.cancel()
    assert [type(o) for o in received] == [Aborted]
    assert backend.submitted == []  # generate() was never called
    stats = actor.statistics()
    assert (stats.in_flight, stats.routes, stats.aborted, stats.completed) == (0, 0, 1, 0)


async def test_a_request_submitted_before_the_actor_runs_is_started_when_it_does():
    actor = EngineActor(ScriptedEngine(Script(tokens=("a",), audio_packets=1, packet_ms=20)))
    received: list = []
    actor.submit(request(), received.append)
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        with anyio.fail_after(5):
            while not received or not isinstance(received[-1], TurnDone):
                await anyio.sleep(0.001)
        tg.cancel_scope.cancel()
    assert sum(isinstance(o, TurnDone) for o in received) == 1


async def test_submitting_to_a_stopped_actor_queues_instead_of_failing():
    actor = EngineActor(ScriptedEngine())
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        tg.cancel_scope.cancel()
    actor.submit(request(), lambda output: None)  # no task group to start it in: queued
    assert actor.statistics().submitted == 1


async def test_the_scripted_engine_waits_its_latencies_with_the_sleep_it_is_given():
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    script = Script(tokens=("a", "b"), audio_packets=1, first_latency_s=0.5, token_latency_s=0.25)
    engine = ScriptedEngine(script, sleep=sleep)
    outputs = [o async for o in engine.generate(request())]
    assert waits == [0.5, 0.25, 0.25]  # no real time passed: the given sleep was used
    assert isinstance(outputs[-1], TurnDone)


class _FakeClock:
    """perf_counter for the scripted engine: moves only when the engine sleeps or the test says."""

    def __init__(self) -> None:
        self.t = 100.0
        self.waits: list[float] = []

    def perf_counter(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.waits.append(round(seconds, 6))
        self.t += seconds


@pytest.mark.parametrize("paced_from_start", [False, True])
async def test_a_lagging_consumer_delays_a_from_start_answer_only_until_it_catches_up(
    monkeypatch, paced_from_start
):
    """A consumer 50 ms late for the first of five 20 ms tokens: paced after each output the
    whole answer slips by those 50 ms; paced from the start, as a real engine's queue, the
    outputs already due come at once and the answer ends when it was due (100 ms)."""
    from duplex_actors.engines import scripted

    clock = _FakeClock()
    monkeypatch.setattr(scripted, "time", clock)
    script = Script(
        tokens=("a",) * 5, audio_packets=0, token_latency_s=0.02, paced_from_start=paced_from_start
    )
    engine = ScriptedEngine(script, sleep=clock.sleep)
    began = clock.t
    outputs = []
    async for output in engine.generate(request()):
        outputs.append(output)
        if len(outputs) == 2:  # the decision, then the first token: the consumer is late for it
            clock.t += 0.05
    assert len(outputs) == 7 and isinstance(outputs[-1], TurnDone)
    if paced_from_start:
        assert clock.waits == [0.02, 0.01, 0.02]  # two tokens overdue: no wait for them
        assert round(clock.t - began, 6) == 0.1
    else:
        assert clock.waits == [0.02] * 5
        assert round(clock.t - began, 6) == 0.15


async def test_pump_tasks_are_reused_and_every_request_still_ends_once():
    """A pump parks after its stream and takes the next request: requests one after another
    run on one task, each answered with exactly one terminal."""
    actor = EngineActor(ScriptedEngine(Script(tokens=("a",), audio_packets=0)))
    received: list = []
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        for turn in range(5):
            actor.submit(request(turn), received.append)
            with anyio.fail_after(5):
                while sum(isinstance(o, TurnDone) for o in received) <= turn:
                    await anyio.sleep(0.001)
            assert len(actor._idle_pumps) == 1  # the same pump, parked again
        tg.cancel_scope.cancel()
    assert sum(isinstance(o, TurnDone) for o in received) == 5
    stats = actor.statistics()
    assert (stats.in_flight, stats.routes, stats.completed) == (0, 0, 5)


async def test_a_request_handed_to_a_parked_pump_as_the_actor_stops_still_gets_its_terminal():
    actor = EngineActor(ScriptedEngine(Script(tokens=("a",), audio_packets=0)))
    received: list = []
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        actor.submit(request(0), received.append)
        with anyio.fail_after(5):
            while not received or not isinstance(received[-1], TurnDone):
                await anyio.sleep(0.001)
        assert len(actor._idle_pumps) == 1
        received.clear()
        actor.submit(request(1), received.append)  # handed to the parked pump...
        tg.cancel_scope.cancel()  # ...which is cancelled before it runs
    terminals = [o for o in received if isinstance(o, (TurnDone, Aborted, EngineFailure))]
    assert len(terminals) == 1
    assert actor.statistics().routes == 0


async def test_a_parked_pump_keeps_no_request_alive():
    import gc
    import weakref

    actor = EngineActor(ScriptedEngine(Script(tokens=("a",), audio_packets=0), record=False))
    received: list = []
    req = request(0)
    ref = weakref.ref(req)
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        actor.submit(req, received.append)
        del req
        with anyio.fail_after(5):
            while not received or not isinstance(received[-1], TurnDone):
                await anyio.sleep(0.001)
        await anyio.sleep(0.01)
        received.clear()
        gc.collect()
        assert len(actor._idle_pumps) == 1
        assert ref() is None  # the parked pump let go of its last request (and its audio)
        tg.cancel_scope.cancel()
