"""Cancellation at the await points a client has: ask, resume, open, and reading events.
Nothing accepted may be lost or duplicated, nothing reserved may leak."""

from __future__ import annotations

import random

import anyio
import pytest

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.core import commands as cmd
from duplex_actors.errors import AskTimeout, ResourceExhausted

from .conftest import CHUNK, Reader, audit, settle

pytestmark = pytest.mark.anyio


async def test_cancelling_a_task_blocked_in_ask_neither_loses_nor_duplicates_the_command():
    engine = ScriptedEngine(Script(token_latency_s=0.001))
    async with Runtime(engine, reaper_interval_s=0) as rt:
        s = await rt.open_session()
        r = Reader(s)
        s.append_audio(CHUNK * 5)
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.commit)
            tg.cancel_scope.cancel()  # cancelled while waiting for the reply
        done = await r.until_type("response.done")
        assert done.status == "completed"
        assert len(r.of_type("input_audio_buffer.committed")) == 1
        assert len(engine.submitted) == 1
        await s.close()
        audit(await r.drain())
        await settle(rt)


async def test_ask_timeout_leaves_the_command_accepted_and_processed_once(monkeypatch):
    async with Runtime(ScriptedEngine(), reaper_interval_s=0) as rt:
        s = await rt.open_session()
        r = Reader(s)
        s.append_audio(CHUNK)
        await s.heartbeat()
        # A dispatcher too busy to get to this session in time: nothing gets scheduled.
        monkeypatch.setattr(rt, "_schedule", lambda actor: None)
        with pytest.raises(AskTimeout):
            await s.ask(cmd.CommitInput(), timeout=0.05)
        monkeypatch.undo()
        rt._schedule(s._actor)  # the dispatcher gets there at last
        await r.until_type("response.done")
        assert len(r.of_type("input_audio_buffer.committed")) == 1
        await s.close()
        audit(await r.drain())


async def test_open_in_a_cancelled_scope_reserves_exactly_what_it_returns():
    async with Runtime(ScriptedEngine(), max_sessions=5, reaper_interval_s=0) as rt:
        handles = []
        for _ in range(5):
            with anyio.CancelScope() as scope:
                scope.cancel()
                handles.append(await rt.open_session())
        # open has no await before it reserves the slot, so a cancelled caller still gets its
        # handle; what matters is that every reserved slot has a handle that can close it.
        assert rt.session_count == len(handles) == 5
        with pytest.raises(ResourceExhausted):
            await rt.open_session()
        for h in handles:
            await h.close()
        assert rt.session_count == 0


async def test_a_reader_that_stops_mid_batch_loses_nothing():
    """An application that breaks out of ``events()`` and later reads again (or a reader task
    cancelled between two events of one batch) must pick up exactly where it stopped."""
    async with Runtime(ScriptedEngine(), reaper_interval_s=0) as rt:
        s = await rt.open_session()
        s.append_audio(CHUNK * 5)
        await s.commit()
        await anyio.sleep(0.05)  # the whole response is queued: one big batch
        got = []
        while True:
            async for event in s.events():
                got.append(event)
                break  # stop after every single event, then read again
            if got[-1].type == "response.done":
                break
        await s.close()
        async for event in s.events():
            got.append(event)
        audit(got)


async def test_reader_cancelled_while_waiting_loses_nothing():
    async with Runtime(ScriptedEngine(Script(token_latency_s=0.003)), reaper_interval_s=0) as rt:
        s = await rt.open_session()
        got = []
        s.append_audio(CHUNK * 5)
        await s.commit()
        rng = random.Random(7)
        while not got or got[-1].type != "response.done":
            with anyio.move_on_after(rng.choice([0, 0.001, 0.002, 0.005])):
                async for event in s.events():
                    got.append(event)
        await s.close()
        async for event in s.events():
            got.append(event)
        audit(got)


@pytest.mark.parametrize("seed", range(12))
async def test_random_cancellation_of_client_operations_keeps_every_invariant(seed):
    """A client whose operations are cancelled at random points (it gives up, times out,
    reconnects). After all of it: exactly-once terminals, no seq gap, nothing leaked."""
    rng = random.Random(seed)
    engine = ScriptedEngine(Script(token_latency_s=0.001, packet_latency_s=0.001))
    async with Runtime(engine, reaper_interval_s=0) as rt:
        s = await rt.open_session()
        got = []

        async def reader():
            async for event in s.events():
                got.append(event)

        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            for _ in range(25):
                op = rng.choice(["turn", "barge", "cancel", "detach_resume", "heartbeat", "clear"])
                with anyio.move_on_after(rng.choice([0, 0, 0.0005, 0.002, 0.01, 1.0])):
                    try:
                        if op == "turn":
                            s.append_audio(CHUNK * rng.randint(1, 5))
                            await s.commit()
                        elif op == "barge":
                            await s.barge_in()
                        elif op == "cancel":
                            await s.cancel()
                        elif op == "detach_resume":
                            await s.detach()
                            await rt.resume(
                                s.id,
                                s.generation,
                                s.resume_token,
                                last_seq=got[-1].seq if got else 0,
                                control_id=f"c{rng.random()}",
                            )
                        elif op == "heartbeat":
                            await s.heartbeat()
                        else:
                            await s.clear()
                    except Exception as err:  # refusals are fine: typed, state unchanged
                        assert getattr(err, "code", None), err
                await anyio.sleep(rng.choice([0, 0.001, 0.003]))
            await s.close()
        # Resume replays re-send already-seen seqs: a client drops seq <= the highest seen.
        fresh, last = [], 0
        for e in got:
            if e.seq > last:
                fresh.append(e)
                last = e.seq
        audit(fresh)
        await settle(rt)
