"""Whether a worker of ``serve --workers`` still runs its event loop: the front's pings, the
worker's answers, and what the front makes of the silence between them.

Theory of operation
-------------------
A worker that dies is easy: its process sentinel closes and the front ends its connections
(:mod:`.front_ledger`). A worker that *hangs* (its loop blocked in a C call, a deadlock, a
``SIGSTOP``) is not: its process lives and its hand-off socket still takes the sockets the
front passes, so a share of every new client would wait for a handshake that never comes, and
its own clients hear nothing, for as long as it hangs.

So the front pings each worker over the hand-off socket (``["p", n]``) and the worker answers
from its loop (``["q", n]``): an answer proves the loop turned after the ping was sent. At
most one ping is outstanding per worker, so the *silence* is simply how long ago the
unanswered one went out (zero while none is). Two thresholds read it:

* **unresponsive** (``unresponsive_after_s``): the front hands new connections to the other
  workers while there is one that answers. Only new ones: a resume still goes to the worker
  holding the session (no other can serve it). A worker that answers again is used again.
* **hung** (``hung_after_s``, ``serve --worker-timeout-s``; None: never): the front stops the
  process, and its death is handled as any other (its clients are told, it starts again).

Silence is only what the front saw while it ran itself: when the whole machine stops (a
suspended VM, a frozen cgroup, the process group stopped), the front wakes up with every
ping long unanswered, and stopping every worker for it would turn a pause into an outage. So
when the front's own pass comes late (by more than ``FRONT_LATE_S``), the time it was away is
forgiven (:meth:`Liveness.forgive`).

The engine process is watched the same way (``serve --engine-timeout-s``), its pings being
the engine channel's ``stats`` requests (:mod:`duplex_actors.engines.engine_process`), which
its loop answers.

This module is sans-IO: the clock is passed in, nothing here sends or kills.
"""

from __future__ import annotations

import attrs

#: How often the front pings each worker (at most: never a second ping while one is unanswered).
PING_INTERVAL_S = 1.0
#: Silence after which new connections go to the other workers.
UNRESPONSIVE_AFTER_S = 2.0
#: Silence after which the worker is stopped (``serve --worker-timeout-s``' default).
HUNG_AFTER_S = 10.0
#: Silence after which the engine process is stopped (``serve --engine-timeout-s``' default):
#: longer, as stopping it fails every worker's turns in flight, and its stall watchdog
#: (``--stall-timeout-s``) already ends a turn that waits on it.
ENGINE_HUNG_AFTER_S = 30.0
#: A pass of the front's pinger this much later than planned means the front itself did not
#: run meanwhile: the gap is nobody's silence.
FRONT_LATE_S = 1.0


def time_away(last_pass: float | None, now: float, every_s: float) -> float:
    """How long a watcher that runs every ``every_s`` and last ran at ``last_pass`` was itself
    not running, judged at ``now``: 0 unless its pass comes more than FRONT_LATE_S late."""
    if last_pass is None:
        return 0.0
    late = now - last_pass - every_s
    return late if late > FRONT_LATE_S else 0.0


@attrs.define(slots=True)
class Liveness:
    """One worker process's pings and answers (a new process starts a new one)."""

    #: When the worker last answered; built with its start, which counts as an answer (the
    #: first ping goes one interval later).
    last_answer: float
    unresponsive_after_s: float = UNRESPONSIVE_AFTER_S
    #: None: a silent worker is never stopped, only passed over.
    hung_after_s: float | None = HUNG_AFTER_S
    #: The last ping's number (0: none yet), and when the unanswered one went out.
    sent: int = 0
    outstanding_since: float | None = None

    def __attrs_post_init__(self) -> None:
        if self.unresponsive_after_s <= 0:
            raise ValueError("unresponsive_after_s must be positive")
        if self.hung_after_s is not None and self.hung_after_s <= 0:
            raise ValueError("hung_after_s must be positive (None: never)")

    def ping_due(self, now: float, interval_s: float = PING_INTERVAL_S) -> bool:
        """Whether a ping should go out now: none is outstanding and the last answer is
        ``interval_s`` old."""
        return self.outstanding_since is None and now - self.last_answer >= interval_s

    def ping(self, now: float) -> int:
        """A ping goes out now; its number, which the answer carries."""
        if self.outstanding_since is not None:
            raise RuntimeError("a ping is already outstanding")
        self.sent += 1
        self.outstanding_since = now
        return self.sent

    def answered(self, number: object, now: float) -> bool:
        """The worker answered ping ``number``; False (and nothing changes) for anything but
        the outstanding ping's number: a stale or forged answer proves nothing."""
        if self.outstanding_since is None or type(number) is not int or number != self.sent:
            return False
        self.outstanding_since = None
        self.last_answer = now
        return True

    def forgive(self, seconds: float) -> None:
        """The front itself was away for ``seconds``: that much of the silence (and of the
        time since the last answer) is not the worker's."""
        if seconds <= 0:
            return
        if self.outstanding_since is not None:
            self.outstanding_since += seconds
        self.last_answer += seconds

    def silence(self, now: float) -> float:
        """How long the outstanding ping has waited (0 while none is outstanding)."""
        since = self.outstanding_since
        return 0.0 if since is None else max(now - since, 0.0)

    def responsive(self, now: float) -> bool:
        return self.silence(now) < self.unresponsive_after_s

    def hung(self, now: float) -> bool:
        return self.hung_after_s is not None and self.silence(now) >= self.hung_after_s


__all__ = [
    "Liveness",
    "time_away",
    "PING_INTERVAL_S",
    "UNRESPONSIVE_AFTER_S",
    "HUNG_AFTER_S",
    "ENGINE_HUNG_AFTER_S",
    "FRONT_LATE_S",
]
