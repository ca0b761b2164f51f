"""Fault-injecting engine wrappers, for reliability tests and the soak.

:class:`FaultyEngine` wraps any :class:`~duplex_actors.engines.base.EngineBackend` and injects
the failures a real backend shows, per request, as plain data:

* ``Fault.raise_after(n)``: the stream raises after ``n`` outputs (a crash mid-stream);
* ``Fault.hang_after(n)``: the stream stops producing after ``n`` outputs and never ends (only
  the engine actor's watchdog gets it unstuck);
* ``Fault.truncate_after(n)``: the stream ends after ``n`` outputs *without* a terminal output;
* ``Fault.garbage_after(n)``: the stream yields an object that is no engine output at all;
* ``Fault.slow(delay_s)``: every output is delayed (a slow but healthy engine);
* ``abort_failures``: the next *n* ``abort`` calls raise (cleanup failing);
* ``start_failures``: the next *n* ``start`` calls raise (a restart that does not come up at
  once).

A fault applies to the requests its ``match`` selects (default: every request) for at most
``times`` requests (default: 1; ``None`` = forever). Faults are tried in order; the first that
still has uses and matches is the one a request gets. Everything injected is counted
(:attr:`FaultyEngine.injected`), so a test can assert the fault really happened before it
asserts the runtime survived it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import TypedDict, Unpack

import anyio
import attrs

from ..core.engine_io import EngineOutput, ModelTurnRequest
from ..engines.base import EngineBackend

__all__ = ["Fault", "FaultyEngine", "InjectedFault", "Garbage"]


class InjectedFault(RuntimeError):
    """Raised by a fault on purpose; a test that sees it escape has found a supervision hole."""


@attrs.frozen(slots=True)
class Garbage:
    """Not an engine output: what a buggy backend might yield. Carries a real request id so
    the router hands it to the session, which has to cope."""

    request_id: str


class _FaultOptions(TypedDict, total=False):
    """The keywords a ``Fault.*_after`` constructor passes on to :class:`Fault`."""

    delay_s: float
    times: int | None
    match: Callable[[ModelTurnRequest], bool] | None


class _SlowFaultOptions(TypedDict, total=False):
    """The keywords :meth:`Fault.slow` passes on to :class:`Fault`."""

    after: int
    times: int | None
    match: Callable[[ModelTurnRequest], bool] | None


@attrs.define(slots=True)
class Fault:
    kind: str  # "raise" | "hang" | "truncate" | "garbage" | "slow"
    after: int = 0
    delay_s: float = 0.0
    times: int | None = 1
    match: Callable[[ModelTurnRequest], bool] | None = None

    @classmethod
    def raise_after(cls, n: int = 1, **kw: Unpack[_FaultOptions]) -> Fault:
        return cls("raise", after=n, **kw)

    @classmethod
    def hang_after(cls, n: int = 1, **kw: Unpack[_FaultOptions]) -> Fault:
        return cls("hang", after=n, **kw)

    @classmethod
    def truncate_after(cls, n: int = 1, **kw: Unpack[_FaultOptions]) -> Fault:
        return cls("truncate", after=n, **kw)

    @classmethod
    def garbage_after(cls, n: int = 1, **kw: Unpack[_FaultOptions]) -> Fault:
        return cls("garbage", after=n, **kw)

    @classmethod
    def slow(cls, delay_s: float, **kw: Unpack[_SlowFaultOptions]) -> Fault:
        kw.setdefault("times", None)
        return cls("slow", delay_s=delay_s, **kw)

    def takes(self, request: ModelTurnRequest) -> bool:
        if self.times is not None and self.times <= 0:
            return False
        return self.match is None or bool(self.match(request))


class FaultyEngine:
    """An engine backend that delegates to ``inner`` and injects :class:`Fault` s."""

    def __init__(
        self,
        inner: EngineBackend,
        faults: list[Fault] | tuple[Fault, ...] = (),
        *,
        abort_failures: int = 0,
        start_failures: int = 0,
    ) -> None:
        self.inner = inner
        self.name = f"faulty:{inner.name}"
        self.capabilities = inner.capabilities
        self.faults: list[Fault] = list(faults)
        self.abort_failures = abort_failures
        self.start_failures = start_failures
        self.injected: dict[str, int] = {}
        self.abort_calls = 0
        self.abort_ok: list[str] = []
        self.hanging: set[str] = set()  # requests parked in a hang right now

    # -- helpers -----------------------------------------------------------------------------

    @property
    def active(self) -> set[str]:
        """Requests the inner engine still holds (ScriptedEngine tracks them)."""
        return getattr(self.inner, "active", set())

    def add(self, fault: Fault) -> None:
        self.faults.append(fault)

    def _count(self, kind: str) -> None:
        self.injected[kind] = self.injected.get(kind, 0) + 1

    def _pick(self, request: ModelTurnRequest) -> Fault | None:
        for fault in self.faults:
            if fault.takes(request):
                if fault.times is not None:
                    fault.times -= 1
                return fault
        return None

    # -- the EngineBackend protocol ----------------------------------------------------------

    async def start(self) -> None:
        if self.start_failures > 0:
            self.start_failures -= 1
            self._count("start")
            raise InjectedFault("injected: engine start failed")
        await self.inner.start()

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def abort(self, request_id: str) -> None:
        self.abort_calls += 1
        if self.abort_failures > 0:
            self.abort_failures -= 1
            self._count("abort")
            raise InjectedFault(f"injected: abort of {request_id} failed")
        await self.inner.abort(request_id)
        self.abort_ok.append(request_id)

    async def generate(self, request: ModelTurnRequest) -> AsyncGenerator[EngineOutput, None]:
        fault = self._pick(request)
        rid = request.request_id
        emitted = 0
        async with contextlib.aclosing(self.inner.generate(request)) as stream:
            async for output in stream:
                if fault is not None and fault.kind != "slow" and emitted >= fault.after:
                    self._count(fault.kind)
                    if fault.kind == "raise":
                        raise InjectedFault(f"injected: stream of {rid} raised after {emitted}")
                    if fault.kind == "hang":
                        self.hanging.add(rid)
                        try:
                            await anyio.sleep_forever()
                        finally:
                            self.hanging.discard(rid)
                    if fault.kind == "truncate":
                        return
                    if fault.kind == "garbage":
                        yield Garbage(rid)  # type: ignore[misc]
                        fault = None  # once per request; then the real stream goes on
                if fault is not None and fault.kind == "slow" and fault.delay_s > 0:
                    await anyio.sleep(fault.delay_s)
                yield output
                emitted += 1
