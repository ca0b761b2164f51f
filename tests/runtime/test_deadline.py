"""actors/deadline.fail_after: anyio.fail_after's contract, on asyncio through asyncio.timeout
and under trio through anyio, so the runtime's asks keep their meaning on both."""

from __future__ import annotations

import anyio
import pytest

from duplex_actors.actors.deadline import fail_after

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


async def test_a_body_past_its_deadline_raises_timeout_error_at_the_deadline():
    began = anyio.current_time()
    with pytest.raises(TimeoutError):
        async with fail_after(0.05):
            await anyio.sleep(10)
    assert 0.04 <= anyio.current_time() - began < 5


async def test_a_body_inside_its_deadline_or_without_one_runs_to_its_end():
    done = []
    async with fail_after(5):
        await anyio.sleep(0.01)
        done.append("timed")
    async with fail_after(None):
        await anyio.sleep(0.01)
        done.append("untimed")
    assert done == ["timed", "untimed"]


async def test_a_cancellation_from_outside_is_not_mistaken_for_the_deadline():
    """An enclosing scope's cancel propagates as a cancellation: the deadline's own timeout is
    the only one turned into TimeoutError."""
    reached = []
    with anyio.CancelScope() as outer:
        async with anyio.create_task_group() as tg:

            async def cancel_soon() -> None:
                await anyio.sleep(0.02)
                outer.cancel()

            tg.start_soon(cancel_soon)
            try:
                async with fail_after(10):
                    await anyio.sleep(10)
            except TimeoutError:
                reached.append("timeout")
            reached.append("after")  # pragma: no cover - the cancellation skips it
    assert outer.cancelled_caught and reached == []


async def test_the_inner_of_two_deadlines_fires_first_and_the_outer_still_holds():
    with pytest.raises(TimeoutError):
        async with fail_after(0.3):
            with pytest.raises(TimeoutError):
                async with fail_after(0.02):
                    await anyio.sleep(10)
            await anyio.sleep(10)  # the outer deadline ends this one
