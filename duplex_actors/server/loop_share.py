"""The event loop's time, shared by client when it runs short.

Every pacer of guard.py is per session: a session's audio (4x real time), bytes (1 MiB a
second) and handling time (0.1 s a second). A client that opens many sessions multiplies
them. Measured with one API key's sessions each sending valid audio as fast as their pacers
allow (``flood_bench --audio --sessions N --policy off``; scripted engine, server VAD on): 16
sessions made a neighbour's turn x1.28 slower at the median; 32 sessions took the loop
(126-134x real time of audio through Silero) and the neighbour's turn went from ~70 ms to
4.0-4.4 s; 64 sessions, to 11 s. Shared by client at 0.5 s a second: x1.20-1.26 with 32.

So the server also bills each frame's handling time (frame_cost: the loop thread's CPU) to
the frame's *tenant* (API key, else client address), and :class:`LoopShare` answers how long
that tenant's readers should wait before their next frame:

* each tenant's recent rate of handling time (seconds a second) is an exponentially decaying
  average over ``window_s``; so is the total. Their sum is the total by construction;
* while the total is under ``capacity_s_per_s``, nobody waits: the loop has room;
* over it, with two tenants or more active, each gets a max-min fair share of the capacity
  (water-filling: a tenant using less than an equal share keeps what it uses, the rest is
  split among the others). A tenant above its share waits until its average has decayed to
  it: ``window_s * ln(rate / share)``, at most ``max_wait_s``;
* one tenant alone is never held back here (its sessions' own pacers still apply): there is
  nobody to protect, and holding it back would leave the loop idle.

The wait happens where the per-session pacers' waits do: the connection's reader reads its
next frame later, TCP pushes back on the client, and nothing accepted is lost.

Sans-IO: times are passed in.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

#: Rates below this (seconds a second) count as idle: the tenant is forgotten.
_IDLE = 1e-5


class LoopShare:
    """Handling time billed per tenant; how long a tenant's next read waits (module doc)."""

    __slots__ = (
        "capacity",
        "window_s",
        "max_wait_s",
        "recompute_s",
        "_rates",
        "_total",
        "_at",
        "_share",
        "_share_at",
        "held_s",
    )

    def __init__(
        self,
        capacity_s_per_s: float,
        *,
        window_s: float = 1.0,
        max_wait_s: float = 1.0,
        recompute_s: float = 0.05,
    ) -> None:
        if not capacity_s_per_s > 0 or not window_s > 0 or not max_wait_s > 0:
            raise ValueError("capacity, window and max wait must be > 0")
        self.capacity = capacity_s_per_s
        self.window_s = window_s
        self.max_wait_s = max_wait_s
        self.recompute_s = recompute_s
        #: tenant -> (rate in seconds a second, when it was last brought up to date)
        self._rates: dict[Hashable, tuple[float, float]] = {}
        self._total = 0.0
        self._at: float | None = None
        #: The fair share (seconds a second), or None while the loop has room.
        self._share: float | None = None
        self._share_at = -math.inf
        #: Seconds of waiting asked of readers, all tenants (for the metric and tests).
        self.held_s = 0.0

    def _decayed(self, rate: float, since: float, now: float) -> float:
        return rate * math.exp(-(now - since) / self.window_s) if now > since else rate

    def bill(self, tenant: Hashable, seconds: float, now: float) -> float:
        """``tenant``'s frame took ``seconds`` of the loop: the seconds its readers should wait
        before their next frame (0: none)."""
        added = max(0.0, seconds) / self.window_s
        rate, since = self._rates.get(tenant, (0.0, now))
        rate = self._decayed(rate, since, now) + added
        self._rates[tenant] = (rate, now)
        self._total = (0.0 if self._at is None else self._decayed(self._total, self._at, now)) + added
        self._at = now
        if now - self._share_at >= self.recompute_s:
            self._recompute(now)
        share = self._share
        if share is None or rate <= share:
            return 0.0
        wait = min(self.max_wait_s, self.window_s * math.log(rate / share))
        self.held_s += wait
        return wait

    def _recompute(self, now: float) -> None:
        self._share_at = now
        rates = []
        for tenant, (rate, since) in list(self._rates.items()):
            rate = self._decayed(rate, since, now)
            if rate < _IDLE:
                del self._rates[tenant]
            else:
                self._rates[tenant] = (rate, now)
                rates.append(rate)
        if len(rates) < 2 or self._decayed(self._total, self._at or now, now) < self.capacity:
            self._share = None
            return
        # Water-filling: the smallest users keep what they use while that is under an equal
        # split of what is left; the rest share the remainder equally.
        rates.sort()
        left, count = self.capacity, len(rates)
        for rate in rates:
            equal = left / count
            if rate > equal:
                self._share = equal
                return
            left -= rate
            count -= 1
        self._share = None  # everyone is under an equal split: nobody is over its share

    def rate(self, tenant: Hashable, now: float) -> float:
        """``tenant``'s recent handling time, seconds a second."""
        rate, since = self._rates.get(tenant, (0.0, now))
        return self._decayed(rate, since, now)

    @property
    def share(self) -> float | None:
        """The fair share last computed (None: the loop had room, or one tenant was active)."""
        return self._share

    def __len__(self) -> int:
        """Tenants tracked (active within a few windows)."""
        return len(self._rates)
