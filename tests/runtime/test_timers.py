"""The runtime's timers on both anyio backends: the queue itself, and server VAD's idle timeout
through a real Runtime (it was asyncio's call_later, which does not exist under trio)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.actors.timers import TimerQueue


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.mark.anyio
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


@pytest.mark.anyio
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


@pytest.mark.anyio
async def test_a_closed_sessions_idle_timer_does_not_keep_the_session_alive():
    # A session with a long idle_timeout_ms (a client's choice: an hour here) had its timer's
    # heap entry hold its actor (the callback is a bound method), and with it the journal and
    # the conversation, until the timer came due: 256 closed sessions held a GiB for the hour
    # (a probe through serve, 2026-12-07). Closing lets go of it now.
    import gc
    import weakref

    engine = ScriptedEngine(Script(tokens=("Hi",), audio_packets=0))
    async with Runtime(engine) as runtime:
        session = await runtime.open_session(
            server_vad=True, idle_timeout_ms=3_600_000, respond_on_commit=False
        )
        await session.create_response()
        with anyio.fail_after(10):
            async with contextlib.aclosing(session.events()) as events:
                async for event in events:
                    if event.type == "response.done":
                        break
        assert runtime.timers.pending == 1  # the idle timer, set once the response ended
        actor = weakref.ref(session._actor)
        await session.close()
        del session
        gc.collect()
        assert actor() is None, [
            (type(r).__name__, list(r)[:5] if isinstance(r, dict) else r) for r in gc.get_referrers(actor())
        ]
        assert runtime.timers.pending == 0


def test_a_cancelled_timer_lets_go_of_its_callback_at_once():
    import gc
    import weakref

    class Callback:
        def __call__(self) -> None:
            raise AssertionError("a cancelled timer fired")

    timers = TimerQueue()
    callback = Callback()
    held = weakref.ref(callback)
    with _at_time_zero():
        timer = timers.call_later(3600.0, callback)
    del callback
    timer.cancel()
    timer.cancel()  # twice: counted once
    gc.collect()
    assert held() is None
    assert (len(timers), timers.pending) == (1, 0)  # the entry goes when due, or at a rebuild


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("set"), st.floats(0.0, 100.0)),
            st.tuples(st.just("cancel"), st.integers(0, 10**6)),
        ),
        max_size=400,
    )
)
@settings(max_examples=200, deadline=None)
def test_cancelled_timers_never_outnumber_the_live_ones_by_more_than_the_rebuild_threshold(steps):
    # A client moving its idle timeout over and over cancelled a timer and set another each
    # time; each cancelled one stayed in the heap until due (up to an hour). The heap is rebuilt
    # once they are most of it: it holds at most the live timers twice, or COMPACT_AT more.
    timers = TimerQueue()
    live: list[Any] = []
    every: list[Any] = []
    # A low threshold, so that short sequences rebuild the heap often.
    with _at_time_zero(), patch.object(TimerQueue, "COMPACT_AT", 4):
        for op, value in steps:
            if op == "set":
                timer = timers.call_later(value, lambda: None)
                live.append(timer)
                every.append(timer)
            elif live:
                live.pop(value % len(live)).cancel()
            assert timers.pending == len(live)
            assert len(timers) <= max(len(live) + TimerQueue.COMPACT_AT - 1, 2 * len(live))
            # The heap holds every live timer, each once, and is still a heap.
            entries = [entry[2] for entry in timers._heap]
            assert {id(t) for t in live} <= {id(t) for t in entries} and len(set(map(id, entries))) == len(
                entries
            )
            assert all(timers._heap[(i - 1) // 2] <= timers._heap[i] for i in range(1, len(timers._heap)))


@contextlib.contextmanager
def _at_time_zero() -> Iterator[None]:
    """``anyio.current_time`` outside an event loop, for the queue's pure bookkeeping."""
    with patch("duplex_actors.actors.timers.anyio.current_time", lambda: 0.0):
        yield


def test_a_timer_moved_ten_thousand_times_leaves_a_bounded_heap():
    # What a session.update resetting idle_timeout_ms after each response does: cancel the
    # timer, set another. Each cancelled one stayed in the heap until due (40,000 such updates
    # left about 89k more objects alive, for the hour they were set for).
    timers = TimerQueue()
    with _at_time_zero():
        timer = timers.call_later(3600.0, lambda: None)
        for _ in range(10_000):
            timer.cancel()
            timer = timers.call_later(3600.0, lambda: None)
    assert timers.pending == 1
    assert len(timers) <= TimerQueue.COMPACT_AT
