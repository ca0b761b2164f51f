"""The watcher process of :class:`duplex_actors.orphan_guard.OrphanGuard` (run by path).

It waits for its owner, the process that started it, to exit, then stops the processes it was
given: SIGTERM to each, so each releases what it holds and stops its own children, then
SIGKILL to whatever of their trees is left after the grace period. It imports only the
standard library and psutil, to stay small beside the processes it guards.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil


def _wait_for_exit(owner_pid: int) -> None:
    """Return once ``owner_pid``, this process's parent when it started, has exited."""
    import select

    if os.getppid() != owner_pid:  # gone before we looked: this process was passed on
        return
    try:
        pidfd = os.pidfd_open(owner_pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # not Linux 5.3+: ask psutil, which polls
        import psutil

        try:
            psutil.Process(owner_pid).wait()
        except psutil.NoSuchProcess:
            pass
        return
    if os.getppid() != owner_pid:  # it died, and its pid may be another's, before the pidfd
        os.close(pidfd)
        return
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    while not poller.poll():
        pass
    os.close(pidfd)


def _watch(owner_pid: int, pids: list[int], grace_s: float, label: str) -> int:
    import psutil

    # Known now, by pid and start time: a pid reused later is a different Process to psutil.
    guarded = []
    for pid in pids:
        try:
            guarded.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _wait_for_exit(owner_pid)
    # Their children are found while the guarded processes still live: once a parent is gone,
    # its children are no longer anyone's to find.
    tree: list[psutil.Process] = []
    for process in guarded:
        try:
            if process.is_running():
                tree.append(process)
                tree.extend(process.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    if not tree:
        return 0
    _say(f"the process {owner_pid} that owned {label} is gone; stopping {_named(tree)}")
    for process in tree:
        if process not in guarded:  # the roots stop their own children (vLLM its workers)
            continue
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    alive = _wait_gone(tree, grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    if alive:
        _say(f"killed {_named(alive)}: not stopped within {grace_s:g} s")
    return 0


def _wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of ``processes`` still running after ``timeout_s``. A zombie counts as gone: it
    has ended and only waits for its parent to read its status (psutil's own wait would take
    it for a live process, as it cannot reap a process it did not start)."""
    import time

    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for process in processes:
            try:
                # is_running() first: a pid taken over by a new process is not ours to wait for
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _named(processes: list[psutil.Process]) -> str:
    import psutil

    names = []
    for process in processes:
        try:
            names.append(f"{process.name()} ({process.pid})")
        except psutil.Error:
            names.append(f"pid {process.pid}")
    return ", ".join(names)


def _say(line: str) -> None:
    try:
        sys.stderr.write(f"duplex_actors orphan guard: {line}\n")
        sys.stderr.flush()
    except OSError:  # the owner's stderr may be gone with it
        pass


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--owner", type=int, required=True)
    parser.add_argument("--grace", type=float, default=5.0)
    parser.add_argument("--label", default="its processes")
    parser.add_argument("pids", type=int, nargs="+")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return _watch(args.owner, args.pids, args.grace, args.label)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
