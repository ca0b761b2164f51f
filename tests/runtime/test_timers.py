"""The runtime's timers on both anyio backends: the queue itself, and server VAD's idle timeout
through a real Runtime (it was asyncio's call_later, which does not exist under trio)."""

from __future__ import annotations

import anyio
import pytest

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.actors.timers import TimerQueue

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


async def test_timers_fire_in_due_order_and_a_cancelled_one_never_fires():
    timers = TimerQueue()
    fired: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(timers.run)
        # Seconds apart, so that a loaded CI host cannot reorder them by running late.
        timers.call_later(2.0, lambda: fired.append("late"))
        cancelled = timers.call_later(0.5, lambda: fired.append("cancelled"))
        timers.call_later(1.5, lambda: fired.append("early"))
        cancelled.cancel()
        await anyio.sleep(0.05)
        # Set while the runner sleeps towards a later one: it wakes for this one.
        timers.call_later(0.0, lambda: fired.append("now"))
        with anyio.fail_after(5):
            while len(fired) < 3:
                await anyio.sleep(0.005)
        tg.cancel_scope.cancel()
    assert fired == ["now", "early", "late"]
    assert len(timers) == 0


async def test_server_vads_idle_timeout_prompts_the_user_under_either_backend():
    engine = ScriptedEngine(Script(tokens=("Hi",), audio_packets=1, packet_ms=20))
    async with Runtime(engine) as runtime:
        session = await runtime.open_session(server_vad=True, idle_timeout_ms=200, respond_on_commit=False)
        await session.create_response()
        seen: list[str] = []
        with anyio.fail_after(10):
            async for event in session.events():
                seen.append(event.type)
                if event.type == "input_audio_buffer.timeout_triggered":
                    break
        await session.close()
    # The first response ended, then (nobody speaking) the idle timer fired and started another.
    assert seen.count("response.done") >= 1
    assert seen[-1] == "input_audio_buffer.timeout_triggered"
