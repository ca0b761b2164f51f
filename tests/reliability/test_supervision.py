"""Supervision: engine streams that raise, hang, end without a terminal or yield garbage; abort
that fails; engine restarts that fail; a session actor that crashes."""

from __future__ import annotations

import anyio
import pytest

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.core.session import SessionCore
from duplex_actors.testing.faults import Fault, FaultyEngine

from .conftest import CHUNK, Reader, audit, settle, turn

pytestmark = pytest.mark.anyio

FAST = Script(token_latency_s=0.002)


def only(session_handle):
    """Match the requests of one session."""
    return lambda request: request.fence.session_id == session_handle.id


@pytest.mark.parametrize("fault", [Fault.raise_after(3), Fault.truncate_after(3)], ids=["raise", "truncate"])
async def test_stream_failure_fails_only_that_response_exactly_once_and_next_turn_works(fault):
    engine = FaultyEngine(ScriptedEngine(FAST))
    async with Runtime(engine, reaper_interval_s=0) as rt:
        victim = await rt.open_session()
        bystanders = [await rt.open_session() for _ in range(5)]
        fault.match = only(victim)
        engine.add(fault)
        readers = {s.id: Reader(s) for s in [victim, *bystanders]}
        async with anyio.create_task_group() as tg:
            for s in [victim, *bystanders]:
                tg.start_soon(turn, s, readers[s.id])
        assert engine.injected == {fault.kind: 1}
        rv = readers[victim.id]
        assert [d.status for d in rv.of_type("response.done")] == ["failed"]
        for s in bystanders:
            assert [d.status for d in readers[s.id].of_type("response.done")] == ["completed"]
        # The session goes on: the next turn works.
        assert (await turn(victim, rv)).status == "completed"
        assert [e.code for e in rv.of_type("error")] == ["engine_error"]
        for s in [victim, *bystanders]:
            await s.close()
            audit(await readers[s.id].drain())
        await settle(rt, backend=engine)


async def test_hung_engine_is_restarted_by_the_watchdog_and_every_in_flight_response_fails_once():
    engine = FaultyEngine(ScriptedEngine(FAST), [Fault.hang_after(2, times=1)])
    async with Runtime(engine, stall_timeout_s=0.3, reaper_interval_s=0) as rt:
        hung = await rt.open_session()
        rh = Reader(hung)
        hung.append_audio(CHUNK * 5)
        await hung.commit()
        await rh.until_type("response.created")
        with anyio.fail_after(3):
            while not engine.hanging:
                await anyio.sleep(0.01)
        done = await rh.until_type("response.done", timeout=3.0)
        assert done.status == "failed"
        assert rt.engine.statistics().restarts == 1
        assert engine.inner.started == 2  # the backend was really restarted
        assert (await turn(hung, rh)).status == "completed"  # the fresh backend works
        await hung.close()
        audit(await rh.drain())
        await settle(rt, backend=engine)


async def test_watchdog_restart_fails_all_in_flight_responses_exactly_once():
    engine = FaultyEngine(
        ScriptedEngine(Script(token_latency_s=0.01, tokens=tuple(f" w{i}" for i in range(30))))
    )
    async with Runtime(engine, stall_timeout_s=0.3, reaper_interval_s=0) as rt:
        sessions = [await rt.open_session() for _ in range(6)]
        readers = [Reader(s) for s in sessions]
        engine.add(Fault.hang_after(4, match=only(sessions[0])))
        for s in sessions:
            s.append_audio(CHUNK * 5)
            await s.commit()
        for rd in readers:
            await rd.until_type("response.done", timeout=4.0)
        statuses = [rd.of_type("response.done")[0].status for rd in readers]
        assert statuses[0] == "failed"
        # The others either finished before the restart or were failed by it; never both.
        assert set(statuses[1:]) <= {"completed", "failed"}
        for s, rd in zip(sessions, readers):
            assert (await turn(s, rd)).status == "completed"
            await s.close()
            audit(await rd.drain())
        await settle(rt, backend=engine)


async def test_failed_engine_restart_is_retried_and_the_runtime_survives():
    engine = FaultyEngine(ScriptedEngine(FAST), [Fault.hang_after(2)], start_failures=0)
    async with Runtime(engine, stall_timeout_s=0.3, reaper_interval_s=0) as rt:
        s = await rt.open_session()
        r = Reader(s)
        engine.start_failures = 2  # the restart's first two starts fail
        s.append_audio(CHUNK * 5)
        await s.commit()
        assert (await r.until_type("response.done", timeout=5.0)).status == "failed"
        with anyio.fail_after(5):
            while engine.inner.started < 2:  # the restart kept trying until start worked
                await anyio.sleep(0.01)
        assert engine.injected.get("start") == 2
        assert (await turn(s, r, timeout=5.0)).status == "completed"
        await s.close()
        audit(await r.drain())
        await settle(rt, backend=engine)


async def test_close_ends_with_one_session_closed_even_when_abort_fails_and_abort_is_retried():
    engine = FaultyEngine(ScriptedEngine(FAST), [Fault.hang_after(2)], abort_failures=3)
    # No stall watchdog configured: abort retries must not depend on it.
    async with Runtime(engine, reaper_interval_s=0) as rt:
        s = await rt.open_session()
        r = Reader(s)
        s.append_audio(CHUNK * 5)
        await s.commit()
        # the engine must hold the request (response.created goes out before it starts)
        await r.until_type("response.output_text.delta")
        await s.close()
        await s.close()  # closing twice is harmless
        events = await r.drain()
        audit(events)
        assert events[-1].reason == "client_closed"
        assert [d.status for d in r.of_type("response.done")] == ["cancelled"]
        rid = hung_request = engine.inner.submitted[0].request_id
        with anyio.fail_after(5):
            while rid not in engine.abort_ok:
                await anyio.sleep(0.02)
        assert engine.injected["abort"] == 3 and engine.abort_calls >= 4
        assert hung_request in engine.abort_ok
        await settle(rt, backend=engine)


async def test_garbage_from_the_engine_closes_only_that_session():
    engine = FaultyEngine(ScriptedEngine(FAST))
    async with Runtime(engine, reaper_interval_s=0) as rt:
        victim, bystander = await rt.open_session(), await rt.open_session()
        engine.add(Fault.garbage_after(2, match=only(victim)))
        rv, rb = Reader(victim), Reader(bystander)
        victim.append_audio(CHUNK * 5)
        await victim.commit()
        events = await rv.drain()
        audit(events)
        assert events[-1].reason == "session_failed"
        assert rv.of_type("error")[0].code == "internal_error"
        assert rt.session_count == 1
        assert (await turn(bystander, rb)).status == "completed"
        await settle(rt, backend=engine)


async def test_a_crashing_session_actor_closes_only_its_session(monkeypatch):
    async with Runtime(ScriptedEngine(FAST), reaper_interval_s=0) as rt:
        victim, bystander = await rt.open_session(), await rt.open_session()
        rv, rb = Reader(victim), Reader(bystander)
        real = SessionCore.on_engine_output

        def crash_for_victim(core, output):
            if core.session_id == victim.id and type(output).__name__ == "TextDelta":
                raise ZeroDivisionError("bug in the session")
            return real(core, output)

        monkeypatch.setattr(SessionCore, "on_engine_output", crash_for_victim)
        for s in (victim, bystander):
            s.append_audio(CHUNK * 5)
            await s.commit()
        events = await rv.drain()
        audit(events)
        assert events[-1].reason == "session_failed"
        assert [d.status for d in rv.of_type("response.done")] == ["cancelled"]
        assert (await rb.until_type("response.done")).status == "completed"
        monkeypatch.setattr(SessionCore, "on_engine_output", real)
        assert (await turn(bystander, rb)).status == "completed"
        await settle(rt)


async def test_close_while_the_engine_hangs_is_prompt():
    engine = FaultyEngine(ScriptedEngine(FAST), [Fault.hang_after(1)])
    async with Runtime(engine, reaper_interval_s=0) as rt:
        s = await rt.open_session()
        r = Reader(s)
        s.append_audio(CHUNK)
        await s.commit()
        with anyio.fail_after(2):
            while not engine.hanging:
                await anyio.sleep(0.005)
        # The engine never ends its turn: any bound tells prompt from waiting for it, and this
        # one leaves room for a shared host's waits for a core.
        with anyio.fail_after(2):
            await s.close()
            events = await r.drain()
        audit(events)
        await settle(rt, backend=engine)
