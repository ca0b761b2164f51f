"""Worker threads shared by many requests, which take queued work in fair-share order.

A ``ThreadPoolExecutor`` serves its queue first come, first served. The speech synthesiser is
one such pool shared by every response, so one client asking for many responses at once (a
session each, all of one API key) queued their phrases in front of everyone's: a neighbour's
first audio waited for all of them. Measured with the embedded engine, sixteen sessions of one
key asking for responses back to back took a neighbour's time to first audio from 0.12 s to
1.12 s at the median, and its whole response from 1.0 s to 3.8 s (10 s worst).

So jobs wait here, on the event loop, one FIFO per flow (a response), and only as many as
there are workers are handed to the threads at a time. The next one comes from
core/fair_share.py: the tenant served least recently, then its flow served least recently. A
new response's first phrase (its flow never served) goes ahead of phrases of its tenant's
other responses, and a tenant's many responses get one tenant's share.

A job cancelled while it waits is dropped; one already handed to a thread finishes there and
its result is dropped. :meth:`FairPool.end` forgets a flow when its request ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from ..core.fair_share import FairShare

T = TypeVar("T")

_Job = tuple[Callable[..., Any], tuple[Any, ...], "asyncio.Future[Any]"]


class FairPool:
    """``workers`` threads; :meth:`run` queues a call under a flow and tenant (module docstring).
    Serves one event loop at a time: the one that ran it last."""

    def __init__(self, workers: int, thread_name_prefix: str = "fair-pool") -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.workers = workers
        self._threads = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=thread_name_prefix)
        self._share: FairShare[Hashable] = FairShare()
        self._jobs: dict[Hashable, deque[_Job]] = {}
        self._tenants: dict[Hashable, Hashable] = {}
        self._busy = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self, flow: Hashable, tenant: Hashable, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread, when fair share says it is ``flow``'s turn
        (``tenant`` None: the flow is a tenant of its own)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # Its state is the loop's to touch; an idle pool may move (a talker shared by
            # tests that each run their own loop), a busy one may not.
            if self._busy or self._jobs:
                raise RuntimeError("a FairPool serves one event loop at a time")
            self._loop = loop
        future: asyncio.Future[T] = loop.create_future()
        job: _Job = (fn, args, future)
        jobs = self._jobs.get(flow)
        if jobs is None:
            jobs = self._jobs[flow] = deque()
            self._tenants[flow] = tenant
        jobs.append(job)
        self._share.wait(flow, tenant)
        self._fill()
        try:
            return await future
        except asyncio.CancelledError:
            self._withdraw(flow, job)
            raise

    def end(self, flow: Hashable) -> None:
        """``flow``'s request is over: forget it (its queued jobs, if any, are cancelled)."""
        jobs = self._jobs.pop(flow, None)
        self._tenants.pop(flow, None)
        self._share.forget(flow)
        for _, _, future in jobs or ():
            future.cancel()

    @property
    def queued(self) -> int:
        return sum(len(jobs) for jobs in self._jobs.values())

    @property
    def busy(self) -> int:
        return self._busy

    def _withdraw(self, flow: Hashable, job: _Job) -> None:
        jobs = self._jobs.get(flow)
        if jobs is None or job not in jobs:
            return  # already handed to a thread (it finishes there) or ended
        jobs.remove(job)
        if not jobs:
            self._share.leave(flow)

    def _fill(self) -> None:
        while self._busy < self.workers:
            flow = self._share.next()
            if flow is None:
                return
            jobs = self._jobs[flow]
            fn, args, future = jobs.popleft()
            if jobs:
                self._share.wait(flow, self._tenants[flow])
            if future.done():  # cancelled and not withdrawn yet: never start it
                continue
            try:
                done = self._threads.submit(fn, *args)
            except RuntimeError as exc:  # shut down: the caller hears it, nothing stays busy
                future.set_exception(exc)
                continue
            self._busy += 1
            done.add_done_callback(functools.partial(self._finished_threadsafe, future=future))

    def _finished_threadsafe(self, done: concurrent.futures.Future[Any], future: asyncio.Future[Any]) -> None:
        loop = self._loop
        assert loop is not None
        try:
            loop.call_soon_threadsafe(self._finished, done, future)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _finished(self, done: concurrent.futures.Future[Any], future: asyncio.Future[Any]) -> None:
        self._busy -= 1
        if done.cancelled():  # shut down before it started
            future.cancel()
        elif not future.done():
            exc = done.exception()
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(done.result())
        self._fill()

    def shutdown(self) -> None:
        for flow in list(self._jobs):
            self.end(flow)
        self._threads.shutdown(wait=False, cancel_futures=True)
