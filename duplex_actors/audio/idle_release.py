"""Letting a recogniser's costly resource go once nothing has used it for a while.

A recogniser is loaded by the first turn that asks for transcription: Moonshine's model is
about 650 MiB in the serving process, PocketSphinx's worker processes about 130 MB each. One
client's one transcribed turn used to keep that for the process's life. :class:`IdleRelease`
counts the uses in progress and, from a daemon thread that runs only while something is held,
calls ``release`` once none has been in progress for ``idle_s``.

A thread rather than a loop timer: Moonshine's decodes run in worker threads with no event
loop of their own, and a thread that sleeps until the idle time is due costs nothing per use.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import structlog

from ..glibc import trim_now

log = structlog.get_logger("duplex_actors.transcription")


class IdleRelease:
    """Calls ``release`` once no use has been in progress for ``idle_s`` seconds (None: never).

    ``release`` runs on the watcher thread under this object's lock, so no use starts while it
    runs; it returns whether it let anything go (counted in :attr:`releases`, logged as
    ``transcriber.unloaded``, and followed by a trim, since glibc keeps freed pages otherwise).
    A use after a release loads the resource again, which is the user's job, not this one's.

    ``release`` must be a bound method; it is held weakly, so the watcher never keeps its owner
    alive (a recogniser dropped without ``close`` is still collected, and its finaliser runs).
    """

    def __init__(self, idle_s: float | None, release: Callable[[], bool], *, name: str) -> None:
        if idle_s is not None and idle_s <= 0:
            raise ValueError("idle_s must be > 0, or None to keep the resource for good")
        self.idle_s = idle_s
        self.name = name
        self._release = weakref.WeakMethod(release)
        self._lock = threading.Lock()
        self._in_use = 0
        self._last_used = 0.0
        self._watching = False  # at most one watcher thread
        self._closed = threading.Event()
        #: Times ``release`` let something go for being idle.
        self.releases = 0

    @contextlib.contextmanager
    def using(self) -> Iterator[None]:
        """Around each use: the resource is not let go while one is in progress, and is idle
        from the end of the last."""
        with self._lock:
            self._in_use += 1
            if self.idle_s is not None and not self._watching and not self._closed.is_set():
                self._watching = True
                threading.Thread(target=self._watch, name=f"{self.name}-idle-release", daemon=True).start()
        try:
            yield
        finally:
            with self._lock:
                self._in_use -= 1
                self._last_used = time.monotonic()

    def close(self) -> None:
        """Stop watching (the owner lets its resource go itself)."""
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.is_set():
            due_in = self._release_if_idle()
            if due_in is None:
                return
            self._closed.wait(due_in)
        with self._lock:
            self._watching = False

    def _release_if_idle(self) -> float | None:
        """Seconds until the idle time may be up, or None once it was (the watcher ends)."""
        assert self.idle_s is not None
        with self._lock:
            if self._in_use:
                return self.idle_s  # a use in progress: look again later
            idle = time.monotonic() - self._last_used
            if idle < self.idle_s:
                return self.idle_s - idle
            self._watching = False
            release = self._release()
            if release is None or not release():
                return None
            self.releases += 1
        # Outside the lock: a use that starts meanwhile need not wait for the trim.
        log.info("transcriber.unloaded", transcriber=self.name, idle_s=round(idle, 1))
        trim_now()
        return None


class ReleasedWhenIdle:
    """A recogniser whose costly resource its ``_idle`` (an :class:`IdleRelease`) lets go."""

    _idle: IdleRelease
    #: Times the resource was loaded (the recogniser counts them).
    loads: int

    @property
    def unloads(self) -> int:
        """Times the resource was let go for being idle."""
        return self._idle.releases

    @property
    def idle_unload_s(self) -> float | None:
        """Seconds unused before the resource is let go (None: never)."""
        return self._idle.idle_s
