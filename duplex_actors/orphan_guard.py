"""A watcher that ends a library's processes when the process that owns them dies.

A process killed by SIGKILL (the OOM killer, an operator, a supervisor's timeout) runs no
clean-up. Children we start ourselves ask the kernel to end them with us
(:mod:`duplex_actors.parent_death`), but some are started by a library we cannot change:
vLLM's engine-core process and its workers hold the model's weights and KV cache (gigabytes,
and the GPU) and live on as orphans when the process that runs ``AsyncLLM`` is killed.

:class:`OrphanGuard` starts a small process of its own (``orphan_watcher.py``, run by path,
with only the standard library and psutil) that waits for the owner to exit (a pidfd on
Linux: no polling), then asks the guarded processes to stop (SIGTERM, so vLLM releases what
it holds), and kills whatever of their process trees is left after a grace period. An owner
that shuts the processes down itself stops its guard first.

The guard knows each process by its pid *and* its start time (psutil), so a pid reused after
the guarded process ended is never signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterable

import structlog

log = structlog.get_logger(__name__)

#: How long the guarded processes get to stop on SIGTERM before the rest is killed: vLLM's
#: engine core needs a few seconds to stop its workers and release their memory.
DEFAULT_GRACE_S = 10.0
#: Run by path, so the watcher imports nothing of this package (nor structlog, nor attrs).
_WATCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "orphan_watcher.py")


class OrphanGuard:
    """One watcher process over ``pids``, owned by this process (see the module docstring)."""

    def __init__(self, process: subprocess.Popen[bytes], pids: tuple[int, ...], label: str) -> None:
        self._process = process
        self.pids = pids
        self.label = label

    @property
    def watcher_pid(self) -> int:
        return self._process.pid

    @classmethod
    def start(
        cls, pids: Iterable[int], *, label: str, grace_s: float = DEFAULT_GRACE_S
    ) -> OrphanGuard | None:
        """Watch ``pids`` from a new process; None (logged) when there is nothing to guard or
        the watcher cannot run here (no psutil in this environment)."""
        pids = tuple(sorted(set(pids)))
        if not pids:
            return None
        try:
            import psutil  # noqa: F401  (the watcher needs it; say so here, not in its stderr)
        except ImportError:
            log.warning("orphan_guard.unavailable", label=label, reason="psutil is not installed")
            return None
        command = [
            sys.executable,
            "-I",  # only the interpreter's own site-packages: no PYTHONPATH, no working directory
            _WATCHER,
            "--owner",
            str(os.getpid()),
            "--grace",
            repr(grace_s),
            "--label",
            label,
            *map(str, pids),
        ]
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            # Its own session: a Ctrl-C or a hang-up to the owner's group is the owner's to
            # handle (a drain); the watcher stays for a kill that may come later.
            start_new_session=True,
        )
        log.info("orphan_guard.started", label=label, pids=list(pids), watcher=process.pid)
        return cls(process, pids, label)

    def stop(self, timeout_s: float = 2.0) -> None:
        """The owner ended the processes itself: end the watcher (blocking, briefly)."""
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


__all__ = ["DEFAULT_GRACE_S", "OrphanGuard"]
