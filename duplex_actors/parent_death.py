"""A child process that ends with its parent, however the parent ends (Linux).

A parent killed by SIGKILL (by the OOM killer, an operator, a supervisor) runs no code, so it
cannot stop its children, and they live on as orphans: a recogniser process holds about
140 MB, a worker of ``serve --workers`` its sessions. Linux's parent-death signal
(``PR_SET_PDEATHSIG``) has the kernel signal the child instead.

Two of its rules shape the callers:

* The signal comes when the *thread* that started the child exits, and again as the child is
  passed to each of the parent's other threads while they exit: one to three times in a row,
  measured. A child must take it as idempotent (so not as a signal that means something else
  the second time, as SIGTERM does to ``serve``).
* It covers deaths after the request only: a parent that died before it is caught by comparing
  the parent's pid with the one the child was given.
"""

from __future__ import annotations

import contextlib
import os
import sys

_PR_SET_PDEATHSIG = 1


def end_with_parent(signum: int, parent_pid: int) -> bool:
    """Ask the kernel to send ``signum`` to this process once its parent dies, or exit at once
    (status 1) if the parent, ``parent_pid``, is gone already. True when asked; False where the
    platform has no such request (then nothing is done)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    asked = False
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        asked = libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    if os.getppid() != parent_pid:  # died before the request took effect: reparented already
        os._exit(1)
    return asked


__all__ = ["end_with_parent"]
