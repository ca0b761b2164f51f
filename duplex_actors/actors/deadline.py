"""A deadline around an await that raises :class:`TimeoutError`: ``anyio.fail_after``, cheaper
on asyncio.

The runtime and the server put one around every ask, every resume's first frame and every
burst a connection writes, so its own cost is paid per message. ``anyio.fail_after`` looks up
the running library (sniffio) and the backend's clock, and builds a generator-based context
manager and a cancel scope, on each use, which made it cost about twice what asyncio's own
``asyncio.timeout`` does. On asyncio this is ``asyncio.timeout``; under any other library
(trio, through anyio) it is still ``anyio.fail_after``.

Both cancel the task at the deadline and turn only their own cancellation into
``TimeoutError``: a cancellation from outside (an anyio scope, a task group) still propagates.
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from types import TracebackType

import anyio


class _AnyioDeadline:
    """``anyio.fail_after`` behind the same ``async with`` as ``asyncio.timeout``."""

    __slots__ = ("_scope",)

    def __init__(self, seconds: float | None) -> None:
        self._scope = anyio.fail_after(seconds)

    async def __aenter__(self) -> None:
        self._scope.__enter__()

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        return self._scope.__exit__(kind, error, tb)


def fail_after(seconds: float | None) -> AbstractAsyncContextManager[object]:
    """``async with fail_after(s):`` raises TimeoutError if the body takes longer than ``s``
    seconds (None: no deadline)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (trio under anyio)
        return _AnyioDeadline(seconds)
    return asyncio.timeout(seconds)
