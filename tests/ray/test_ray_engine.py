"""RayEngine against a real local Ray: the scripted engine runs in a Ray actor process and the
runtime talks to it only through RayEngine."""

from __future__ import annotations

import contextlib
import os

import anyio
import pytest

ray = pytest.importorskip("ray")

from duplex_actors import (  # noqa: E402
    Aborted,
    EngineFailure,
    ModelTurnRequest,
    Runtime,
    Script,
    ScriptedEngine,
    TurnDone,
    TurnKind,
)
from duplex_actors.core.fence import Fence  # noqa: E402
from duplex_actors.engines.ray_engine import RayEngine  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.anyio, pytest.mark.timeout(60)]

CHUNK = b"\x01\x00" * 320  # 20 ms of 16 kHz pcm16
#: num_cpus=0: test actors never wait for a CPU slot held by an actor being torn down.
ACTOR_OPTIONS = {"num_cpus": 0}
LONG = Script(
    tokens=tuple(f" w{i}" for i in range(200)), audio_packets=200, token_latency_s=0.01, packet_latency_s=0.01
)
#: Never finishes on its own: only a working abort or cancellation frees it.
HANG = Script(hang_after=4)


@contextlib.asynccontextmanager
async def runtime_on(engine: RayEngine):
    """A Runtime on the engine, and the engine's actor closed afterwards.

    The explicit ``aclose`` is there because ``Runtime.__aexit__`` does not reach
    ``EngineActor.run``'s ``backend.aclose()`` today (the cancellation re-raised by the engine
    actor's task group skips it); ``aclose`` is idempotent, so this stays right once it does.
    """
    try:
        async with Runtime(engine) as rt:
            yield rt
    finally:
        await engine.aclose()


def ray_engine(script, **kw) -> RayEngine:
    return RayEngine(lambda: ScriptedEngine(script), actor_options=ACTOR_OPTIONS, **kw)


async def until(session, type_, timeout=10.0):
    seen = []
    with anyio.fail_after(timeout):
        async for event in session.events():
            seen.append(event)
            if event.type == type_:
                return seen
    raise AssertionError(f"stream ended before {type_}: {[e.type for e in seen]}")


async def one_turn(session, timeout=10.0):
    session.append_audio(CHUNK * 5)
    await session.commit()
    return await until(session, "response.done", timeout)


async def eventually(predicate, timeout=5.0, interval=0.01):
    with anyio.fail_after(timeout):
        while True:
            value = await predicate()
            if value:
                return value
            await anyio.sleep(interval)


async def _empty(awaitable):
    return not await awaitable


async def _nonempty(awaitable):
    return bool(await awaitable)


def shape(events):
    """What a client sees, minus ids and times: (type, text delta) in order."""
    return [(e.type, getattr(e, "delta", None) if e.type.endswith("text.delta") else None) for e in events]


async def test_conversation_matches_in_process_engine_and_runs_in_another_process(ray_cluster):
    script = Script(token_latency_s=0.001)
    async with Runtime(ScriptedEngine(script)) as rt:
        local = await one_turn(await rt.open_session())

    def per_request(request):  # the third turn raises inside the actor
        return (
            Script(token_latency_s=0.001, fail_after=2, fail_mode="raise")
            if request.request_id.endswith("/t2")
            else script
        )

    engine = RayEngine(lambda: ScriptedEngine(per_request), actor_options=ACTOR_OPTIONS)
    async with runtime_on(engine) as rt:
        assert engine.running and engine.actor_pid != os.getpid()
        assert engine.backend_name == "scripted" and engine.capabilities.model_native
        session = await rt.open_session()
        remote = await one_turn(session)
        second = await one_turn(session)
        assert shape(remote) == shape(local)
        assert remote[-1].status == "completed" and second[-1].status == "completed"
        text = "".join(e.delta for e in remote if e.type == "response.output_text.delta")
        assert text == "Hello there, how can I help?"
        assert sum(e.type == "response.output_audio.delta" for e in remote) == 3
        # A backend exception in the actor fails that turn only; it is not an actor death.
        assert (await one_turn(session))[-1].status == "failed"
        assert (await one_turn(session))[-1].status == "completed"
        assert engine.running and engine.statistics().actor_deaths == 0
        submitted = await engine.call(lambda b: [r.request_id for r in b.submitted])
        assert submitted == [f"{session.id}/e0/t{i}" for i in range(4)]
        assert engine.active == frozenset() and await engine.remote_active() == frozenset()
    assert not engine.running


def long_first_turn(request):
    return HANG if request.request_id.endswith("/e0/t0") else Script(token_latency_s=0.001)


async def test_barge_in_aborts_the_remote_request(ray_cluster):
    engine = RayEngine(lambda: ScriptedEngine(long_first_turn), actor_options=ACTOR_OPTIONS)
    async with runtime_on(engine) as rt:
        session = await rt.open_session()
        session.append_audio(CHUNK * 5)
        await session.commit()
        await until(session, "response.output_audio.delta")
        rid = f"{session.id}/e0/t0"
        assert await engine.remote_active() == {rid}
        await session.barge_in()
        done = (await until(session, "response.done"))[-1]
        assert done.status == "cancelled"
        await eventually(lambda: _empty(engine.remote_active()))
        assert await engine.call(lambda b: list(b.aborted)) == [rid]
        assert engine.active == frozenset()
        # The next turn works under the new epoch, on the same actor.
        pid = engine.actor_pid
        later = await one_turn(session, timeout=20)
        assert later[-1].status == "completed" and all(e.epoch == 1 for e in later)
        assert engine.actor_pid == pid


async def test_two_sessions_stream_concurrently_without_mixing(ray_cluster):
    # Each request speaks its own id, so a misrouted output would show in the other's text.
    def per_request(request):
        return Script(
            tokens=tuple(f"[{request.request_id}:{i}]" for i in range(30)),
            audio_packets=0,
            token_latency_s=0.02,
        )

    engine = RayEngine(lambda: ScriptedEngine(per_request), actor_options=ACTOR_OPTIONS)
    async with runtime_on(engine) as rt:
        a, b = await rt.open_session(), await rt.open_session()
        for s in (a, b):
            s.append_audio(CHUNK * 5)
            await s.commit()
        for s in (a, b):
            await until(s, "response.output_text.delta")
        # Both are in flight in the actor at the same time (each takes >= 0.6 s).
        assert await engine.remote_active() == {f"{a.id}/e0/t0", f"{b.id}/e0/t0"}
        results = {}

        async def finish(s):
            results[s.id] = await until(s, "response.done")

        async with anyio.create_task_group() as tg:
            tg.start_soon(finish, a)
            tg.start_soon(finish, b)
        for s in (a, b):
            assert results[s.id][-1].status == "completed"
            rid = f"{s.id}/e0/t0"
            # The first delta was read above; the rest arrive here, in order, all our own.
            text = "".join(e.delta for e in results[s.id] if e.type == "response.output_text.delta")
            assert text == "".join(f"[{rid}:{i}]" for i in range(1, 30))


async def test_actor_killed_mid_stream_fails_the_turn_then_restarts(ray_cluster):
    engine = ray_engine(LONG)
    async with runtime_on(engine) as rt:
        a, b = await rt.open_session(), await rt.open_session()
        for s in (a, b):
            s.append_audio(CHUNK * 5)
            await s.commit()
        for s in (a, b):
            await until(s, "response.output_text.delta")
        old_pid = engine.actor_pid
        ray.kill(engine.actor)
        for s in (a, b):  # every in-flight turn ends, failed, promptly
            done = (await until(s, "response.done", timeout=10))[-1]
            assert done.status == "failed"
        assert engine.statistics().actor_deaths == 1
        assert engine.active == frozenset()
        # The next turn starts a fresh actor and completes on it.
        engine.factory = lambda: ScriptedEngine(Script(token_latency_s=0.001))
        later = await one_turn(a, timeout=30)
        assert later[-1].status == "completed"
        assert engine.actor_pid not in (None, old_pid)
        assert engine.statistics().actors_started == 2
        assert rt.engine.statistics().in_flight == 0


async def test_without_auto_restart_start_can_be_called_again(ray_cluster):
    engine = ray_engine(LONG, restart_on_death=False)
    async with runtime_on(engine) as rt:
        s = await rt.open_session()
        s.append_audio(CHUNK * 5)
        await s.commit()
        await until(s, "response.output_text.delta")
        ray.kill(engine.actor)
        assert (await until(s, "response.done"))[-1].status == "failed"
        assert not engine.running
        assert (await one_turn(s))[-1].status == "failed"  # no actor, no silent restart
        engine.factory = lambda: ScriptedEngine(Script())
        await engine.start()
        assert (await one_turn(s, timeout=30))[-1].status == "completed"


# --- the backend contract, without the runtime ------------------------------------------------


def request(rid: str) -> ModelTurnRequest:
    return ModelTurnRequest(rid, Fence("s", 0, 0), TurnKind.RESPONSE, b"\0\0" * 160)


async def test_abort_and_cancellation_free_the_remote_request(ray_cluster):
    from duplex_actors.errors import EngineFailed

    engine = ray_engine(HANG)
    with pytest.raises(EngineFailed):  # not started: fails loudly, never hangs
        async for _ in engine.generate(request("s/e0/t9")):
            pass
    await engine.start()
    try:
        # abort(request_id) while the stream is consumed: it ends with Aborted, nothing else.
        outputs = []

        async def consume():
            async for out in engine.generate(request("s/e0/t0")):
                outputs.append(out)

        with anyio.fail_after(10):  # a stream that abort does not end fails here, not hangs
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await eventually(lambda: _nonempty(engine.remote_active()))
                await engine.abort("s/e0/t0")
        assert isinstance(outputs[-1], Aborted)
        assert not any(isinstance(o, (TurnDone, EngineFailure)) for o in outputs)
        await eventually(lambda: _empty(engine.remote_active()))
        assert await engine.call(lambda b: list(b.aborted)) == ["s/e0/t0"]
        await engine.abort("unknown")  # forwarded; a no-op for the backend, not an error

        # Cancelling the consumer alone (no abort call) frees the remote request too.
        got = 0
        with anyio.move_on_after(0.5):
            async for _ in engine.generate(request("s/e0/t1")):
                got += 1
        assert got > 0 and engine.active == frozenset()
        await eventually(lambda: _empty(engine.remote_active()))
        assert await engine.call(lambda b: list(b.aborted)) == ["s/e0/t0", "unknown"]
    finally:
        await engine.aclose()
    assert not engine.running
    with pytest.raises(EngineFailed):  # closed: no silent restart
        async for _ in engine.generate(request("s/e0/t2")):
            pass
