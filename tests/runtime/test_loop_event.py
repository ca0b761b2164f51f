"""actors/loop_event: the runtime's one-shot event keeps anyio.Event's contract on asyncio (and
is anyio.Event itself under trio), so the dispatcher, readers, asks and parked pumps that wait
on it behave as they did."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from duplex_actors.actors.loop_event import LoopEvent, event_class

# A waiter never woken hangs its task group: fail in seconds, not at the suite's timeout.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


def _new():
    return event_class()()


async def _wait_then_note(event, woke: list, name: object = True) -> None:
    await event.wait()
    woke.append(name)


async def test_the_event_class_is_the_lean_one_on_asyncio_and_anyios_elsewhere(anyio_backend):
    cls = event_class()
    if anyio_backend == "asyncio":
        assert cls is LoopEvent
    else:
        assert cls is type(anyio.Event())


async def test_a_wait_returns_once_set_and_a_set_event_stays_set():
    event = _new()
    woke: list = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_wait_then_note, event, woke)
        await anyio.wait_all_tasks_blocked()
        assert not event.is_set() and woke == []
        event.set()
        event.set()  # a second set changes nothing
    assert event.is_set() and woke == [True]
    with anyio.fail_after(1):
        await event.wait()  # set already: returns


async def test_a_wait_on_a_set_event_is_still_a_checkpoint(anyio_backend):
    """As anyio.Event.wait on asyncio: a task ready to run gets to run before the wait returns
    (trio's scheduler promises no such order for a checkpoint)."""
    if anyio_backend != "asyncio":
        pytest.skip("asyncio's run order")
    event = _new()
    event.set()
    ran = []

    async def other() -> None:
        ran.append(True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        await event.wait()
        assert ran == [True]


async def test_every_waiter_is_woken_once():
    event = _new()
    woke: list = []
    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(_wait_then_note, event, woke, i)
        await anyio.wait_all_tasks_blocked()
        event.set()
    assert sorted(woke) == [0, 1, 2]


async def test_a_cancelled_waiter_leaves_the_event_usable():
    """A waiter cancelled by its scope (a deadline) does not set the event, nor keep the next
    waiter from being woken by the set."""
    event = _new()
    with anyio.move_on_after(0.01) as scope:
        await event.wait()
    assert scope.cancelled_caught and not event.is_set()
    woke: list = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_wait_then_note, event, woke)
        await anyio.wait_all_tasks_blocked()
        event.set()
    assert woke == [True]


async def test_a_waiter_cancelled_beside_others_does_not_cost_them_their_wake_up():
    event = _new()
    woke: list = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(_wait_then_note, event, woke, "first")
        async with anyio.create_task_group() as doomed:
            doomed.start_soon(_wait_then_note, event, woke, "cancelled")
            tg.start_soon(_wait_then_note, event, woke, "last")
            await anyio.wait_all_tasks_blocked()
            doomed.cancel_scope.cancel()
        event.set()
    assert sorted(woke) == ["first", "last"]


async def test_a_set_from_the_waiters_own_step_before_it_waits_is_not_lost():
    """Set between making the event and waiting on it (nothing awaited in between): the wait
    returns at once, as the runtime relies on when a reader's events arrive that soon."""
    event = _new()
    event.set()
    with anyio.fail_after(1):
        await event.wait()
    await anyio.lowlevel.checkpoint()
