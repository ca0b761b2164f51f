"""FairPool (engines/fair_pool.py): threads shared in fair-share order, not first come first
served; cancelled waiting jobs never run; ended flows hold nothing."""

from __future__ import annotations

import asyncio
import threading

import pytest

from duplex_actors.engines.fair_pool import FairPool


def run(coro, timeout: float = 10.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _started(pool: FairPool, n: int) -> None:
    while pool.busy < n:
        await asyncio.sleep(0.001)


def held_jobs():
    """A gate, the names of the jobs run so far, and a job that waits for the gate, then
    notes its name and returns it."""
    gate = threading.Event()
    ran: list[str] = []

    def job(name: str) -> str:
        gate.wait(5)
        ran.append(name)
        return name

    return gate, ran, job


def test_a_neighbour_waits_for_one_of_a_flooders_jobs_not_all():
    async def main():
        pool = FairPool(1)
        gate, order, job = held_jobs()
        tasks = [asyncio.create_task(pool.run(f"flood{i}", "flooder", job, f"flood{i}")) for i in range(4)]
        await _started(pool, 1)  # flood0 holds the one thread
        tasks.append(asyncio.create_task(pool.run("mine", "neighbour", job, "mine")))
        await asyncio.sleep(0.01)
        assert pool.queued == 4
        gate.set()
        results = await asyncio.gather(*tasks)
        pool.shutdown()
        return order, results

    order, results = run(main())
    assert order == ["flood0", "mine", "flood1", "flood2", "flood3"]
    assert results == ["flood0", "flood1", "flood2", "flood3", "mine"]


def test_a_job_cancelled_while_waiting_never_runs_and_a_running_one_finishes():
    async def main():
        pool = FairPool(1)
        gate, ran, job = held_jobs()
        running = asyncio.create_task(pool.run("a", "a", job, "a"))
        await _started(pool, 1)
        waiting = asyncio.create_task(pool.run("b", "b", job, "b"))
        after = asyncio.create_task(pool.run("c", "c", job, "c"))
        await asyncio.sleep(0.01)
        waiting.cancel()
        running.cancel()  # already on the thread: it finishes there, its result dropped
        gate.set()
        assert await after == "c"
        with pytest.raises(asyncio.CancelledError):
            await waiting
        with pytest.raises(asyncio.CancelledError):
            await running
        queued, busy = pool.queued, pool.busy
        pool.shutdown()
        return ran, queued, busy

    ran, queued, busy = run(main())
    assert ran == ["a", "c"]
    assert (queued, busy) == (0, 0)


def test_a_jobs_exception_reaches_its_caller_and_the_pool_goes_on():
    async def main():
        pool = FairPool(2)

        def boom() -> None:
            raise ValueError("no voice")

        with pytest.raises(ValueError, match="no voice"):
            await pool.run("f", "t", boom)
        value = await pool.run("g", "t", lambda: 42)
        pool.shutdown()
        return value

    assert run(main()) == 42


def test_ended_flows_hold_nothing():
    async def main():
        pool = FairPool(2)
        for i in range(200):
            await pool.run(f"r{i}", f"tenant{i % 5}", lambda: None)
            pool.end(f"r{i}")
        held = pool._share.held(), len(pool._jobs), len(pool._tenants)
        pool.shutdown()
        return held

    share_held, jobs, tenants = run(main())
    # Five tenants' stamps remembered (bounded), nothing per flow.
    assert (jobs, tenants) == (0, 0)
    assert share_held <= 5 + 16


def test_a_job_after_shutdown_fails_at_once_and_holds_nothing():
    async def main():
        pool = FairPool(1)
        assert await pool.run("f", "t", lambda: 1) == 1
        pool.shutdown()
        with pytest.raises(RuntimeError):
            await pool.run("g", "t", lambda: 2)
        return pool.busy

    assert run(main()) == 0
