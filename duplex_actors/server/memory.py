"""Giving memory back to the operating system after a client made the server allocate it.

glibc's malloc, left to itself, keeps most of what a burst of large allocations freed:

* its mmap threshold is dynamic: once a block it had mapped (a 4 MiB inflated message) is
  freed, blocks that size come from the heap instead, where freed memory is given back only
  from the top of the heap, past a trim threshold that grows the same way;
* freed small blocks (a header block's strings) leave pages partly used all over the heap.

So the server fixes the mmap threshold (:func:`configure_allocator`: blocks of at least
``MMAP_THRESHOLD`` are mapped and unmapped on their own, and setting it turns the dynamic
adjustment off) and the trim threshold (``TRIM_THRESHOLD``), both just above what each socket
read allocates, and after refused input (:func:`trim_soon`) asks glibc to give back every free
page (``malloc_trim``), debounced: once the refusals have stopped for ``TRIM_DELAY_S``, and at
most once every ``TRIM_MIN_INTERVAL_S`` while they go on. Elsewhere than glibc both are
no-ops. The figures are in docs/reliability.md ("Bounded memory").
"""

from __future__ import annotations

import asyncio
import time
from asyncio import selector_events

import structlog

from ..glibc import GLIBC, trim_now

log = structlog.get_logger("duplex_actors.server")

#: asyncio reads every socket with ``recv(max_size)`` (256 KiB): CPython allocates that much,
#: then shrinks it to what arrived. Both thresholds are set from that read, the server's most
#: frequent large allocation, one per frame a client sends. uvloop (serve's loop where it is
#: installed: event_loop.py) reads into a buffer its loop owns and allocates only the bytes
#: that arrived, so on it no read comes near either threshold.
ASYNCIO_READ_SIZE: int = getattr(
    getattr(selector_events, "_SelectorSocketTransport", None), "max_size", 256 << 10
)
#: Blocks at least this large are mapped on their own and unmapped when freed. Above the read's
#: size: at or below it, every read mapped a fresh region, faulted its first page in and
#: unmapped it again (glibc's own default does the same, as its dynamic threshold only rises
#: when a mapped block that large is freed, and a read's block is freed after its shrink).
MMAP_THRESHOLD = 2 * ASYNCIO_READ_SIZE
#: Free memory at the top of the heap past this much goes back at once. Above twice the read:
#: a read's block is carved from the top and most of it is freed again by the shrink, which
#: past a lower threshold gave the pages back and asked for them again on the next read.
TRIM_THRESHOLD = 4 * ASYNCIO_READ_SIZE
#: A trim runs this long after the last refused input ...
TRIM_DELAY_S = 1.0
#: ... and at most once in this long.
TRIM_MIN_INTERVAL_S = 5.0

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3


_GLIBC = GLIBC
_configured = False


def configure_allocator(
    mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int | None = TRIM_THRESHOLD
) -> bool:
    """Fix glibc's mmap and trim thresholds for this process (once; ``trim_threshold`` None
    leaves glibc's); False where there is no glibc."""
    global _configured
    if _GLIBC is None:
        return False
    if not _configured:
        _configured = bool(_GLIBC.mallopt(_M_MMAP_THRESHOLD, mmap_threshold))
        if trim_threshold is not None:
            _configured = bool(_GLIBC.mallopt(_M_TRIM_THRESHOLD, trim_threshold)) and _configured
    return _configured


class _Trimmer:
    """One per process: the allocator is the process's."""

    __slots__ = ("_handle", "_loop", "_last", "_first_asked", "trims", "trim_s")

    def __init__(self) -> None:
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last = float("-inf")
        self._first_asked: float | None = None
        self.trims = 0
        self.trim_s = 0.0

    def request(self, loop: asyncio.AbstractEventLoop) -> None:
        if _GLIBC is None:
            return
        now = time.monotonic()
        if self._first_asked is None:
            self._first_asked = now
        if self._handle is not None and self._loop is loop and not loop.is_closed():
            self._handle.cancel()  # refusals go on: wait for them to stop ...
        # ... but not past the interval: a steady attack still gets a trim that often.
        due = max(TRIM_DELAY_S, self._last + TRIM_MIN_INTERVAL_S - now)
        due = min(due, max(self._first_asked + TRIM_MIN_INTERVAL_S - now, 0.0))
        self._loop = loop
        self._handle = loop.call_later(due, self._run)

    def _run(self) -> None:
        self._handle = None
        self._first_asked = None
        self._last = time.monotonic()
        took = trim_now()
        self.trims += 1
        self.trim_s += took
        log.debug("server.memory_trimmed", took_ms=round(took * 1000, 2))


TRIMMER = _Trimmer()


def trim_soon(loop: asyncio.AbstractEventLoop) -> None:
    """Input was refused or dropped: give its memory back once such refusals stop."""
    TRIMMER.request(loop)
