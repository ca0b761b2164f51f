"""How many descriptors ``serve`` may hold open, raised at its start to what it was told to carry.

Every connection costs the process serving it a descriptor, and under ``serve --workers`` the
front keeps a duplicate of each connection it hands over (front_ledger.py), so the front needs
one per connection of every worker. The soft limit a shell gives a process (``ulimit -n``) is
often 1,024, a tenth of the default ``--max-connections``. Past it ``accept`` fails: a single
process resets each new client without a word in its log, and the front of ``--workers`` leaves
them waiting while it logs the failure ten times a second. Health probes are among those
clients, so a few hundred idle connections could get a healthy server restarted.

An unprivileged process may raise its own soft limit up to the hard one, which is usually far
higher, so ``serve`` does at its start (the processes it starts inherit it). When even the hard
limit is short of what ``--max-connections`` needs, ``serve`` says so and runs anyway: fewer
connections than asked for beats none.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

try:  # POSIX only; elsewhere the limit is left alone
    import resource
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]

#: Descriptors a serving process holds besides its connections: the listening socket, the
#: engine channel, model and log files, pipes to child processes, the event loop's own.
RESERVE = 256


def descriptors_needed(max_connections: int, workers: int = 1, tls: bool = False) -> int:
    """The most descriptors one process of ``serve`` may need with these options.

    One process: a descriptor per connection. ``--workers N``: the front holds a duplicate of
    each of the N workers' connections, and under TLS a worker that relays a resume to the
    session's owner holds the client's socket and the relay's, so up to two per connection."""
    if workers <= 1:
        return max_connections + RESERVE
    front = workers * max_connections
    worker = max_connections * (2 if tls else 1)
    return max(front, worker) + RESERVE


@attrs.frozen
class OpenFilesLimit:
    """What the soft limit was, what it is now, its ceiling, and what was needed."""

    before: int
    now: int
    hard: int | None  # None: unlimited
    needed: int

    @property
    def short(self) -> bool:
        return self.now < self.needed

    def advice(self, max_connections: int) -> str:
        hard = "unlimited" if self.hard is None else str(self.hard)
        return (
            f"warning: --max-connections {max_connections} needs up to {self.needed} open files in "
            f"one process, and this one may open {self.now} (ulimit -n; hard limit {hard}): "
            f"connections past that are refused. Raise the hard limit (ulimit -Hn, or LimitNOFILE= "
            f"in a systemd unit) or lower --max-connections."
        )


def raise_open_files_limit(
    needed: int,
    *,
    getrlimit: Callable[[int], tuple[int, int]] | None = None,
    setrlimit: Callable[[int, tuple[int, int]], None] | None = None,
) -> OpenFilesLimit | None:
    """Raise this process's soft limit on open descriptors to ``needed``, or as near as its hard
    limit allows; never lower it. None where the platform has no such limit."""
    if resource is None:
        return None
    get = getrlimit or resource.getrlimit
    put = setrlimit or resource.setrlimit
    soft, hard = get(resource.RLIMIT_NOFILE)
    unlimited = hard == resource.RLIM_INFINITY
    ceiling = needed if unlimited else min(needed, hard)
    now = soft
    if soft != resource.RLIM_INFINITY and ceiling > soft:
        try:
            put(resource.RLIMIT_NOFILE, (ceiling, hard))
            now = ceiling
        except (ValueError, OSError):
            pass  # some kernels cap it below the hard limit (macOS: OPEN_MAX): keep what we have
    if now == resource.RLIM_INFINITY:
        now = needed
    return OpenFilesLimit(before=soft, now=now, hard=None if unlimited else hard, needed=needed)


__all__ = ["RESERVE", "OpenFilesLimit", "descriptors_needed", "raise_open_files_limit"]
