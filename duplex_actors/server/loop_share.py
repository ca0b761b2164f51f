r"""The event loop's time, shared by client when it runs short.

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
  nobody to protect, and holding it back would leave the loop idle;
* nor is a tenant within ``tenant_floor_s_per_s`` (serve: one real-time session's worth): an
  equal split shrinks with the number of tenants, and among hundreds of addresses each
  opening a few connections a user talking on one session was the biggest tenant.

The wait happens before the tenant's next frame is handled, on any of its connections
(:meth:`LoopShare.hold`, checked again after each wait), and before its next connection's
handshake completes: TCP pushes back on the client, and nothing accepted is lost. Checked only
after a frame, a client asking for responses with one frame each was never held back (the
response ran during the wait; 128 sessions: a neighbour's response x21, as with no sharing),
nor was one opening a connection for each request.

What the server *sends* a client is its work too. A client asking for responses back to back
reads a few bytes a response and is sent hundreds of events; encoding and compressing them took
over half of the loop in such a flood. Billed only for its frames, one key's 128 sessions were
never held back, and a neighbour's response went x20 slower (``flood_bench --responses 128
--engine scripted``). The writer therefore :meth:`~LoopShare.charge`\ s what it encodes and
sends to the client's tenant; the tenant's readers wait for it at their next frame. A
detached session's events (its response goes on for a resume, with no writer) are charged as
if they had been sent, at what sending an event has lately cost, and each handshake at an
estimate of a connection's cost (server/app.py).

Unbilled work. Billed were 45-55 % of the loop's seconds in the flood above (reading and
sending only), so measured in billed seconds alone the loop never looked short. The sessions'
state machines are now metered too (two clock reads a dispatcher round, split by session:
``Runtime.meter_tenant_work``), and so is the websocket parser's work on each read, to its
connection's client (connection.py); the engine actor's pump and asyncio's own scheduling still
are not.
Given the loop thread's CPU clock (``loop_cpu``), the capacity is counted in loop seconds: each
billed second stands for ``unbilled`` of them (the loop's recent CPU over the billed total, at
least 1 and at most 4), as if the unbilled work were shared out in proportion to the billed.
With both, 128 sessions made the neighbour's response x1.03-1.07 slower at the median.

The factor only makes the loop short sooner: it never holds a tenant that takes no more than
an equal split of the capacity in billed seconds. Unbilled work is not always shared out in
proportion: a client opening connections and dropping them made its own, the factor went to
4, and a neighbour streaming audio on three sessions was held back (its audio 0.9-2.1 s late)
while that client, billed less, kept everything it used.

Sans-IO: times are passed in, and the loop thread's CPU clock is injected.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable

#: Rates below this (seconds a second) count as idle: the tenant is forgotten.
_IDLE = 1e-5

#: At most this many seconds of loop are counted for each billed second. Billed work is about
#: half the loop in a flood of responses; the cap keeps a loop busy with work nobody is
#: billed for (a collection, an embedder's own tasks) from magnifying small bills into waits.
_MAX_UNBILLED = 4.0


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
        "_loop_cpu",
        "_cpu_seen",
        "_loop_rate",
        "unbilled",
        "tenant_floor",
    )

    def __init__(
        self,
        capacity_s_per_s: float,
        *,
        window_s: float = 1.0,
        max_wait_s: float = 1.0,
        recompute_s: float = 0.05,
        loop_cpu: Callable[[], float] | None = None,
        tenant_floor_s_per_s: float = 0.0,
    ) -> None:
        if not capacity_s_per_s > 0 or not window_s > 0 or not max_wait_s > 0:
            raise ValueError("capacity, window and max wait must be > 0")
        if tenant_floor_s_per_s < 0:
            raise ValueError("the tenant floor must be >= 0")
        #: What any tenant may use without ever being held (seconds a second). An equal split
        #: shrinks with the number of tenants: in a storm of hundreds of addresses each opening
        #: a few connections, one user talking on one session was the biggest tenant and was
        #: held at every frame. The floor keeps one real-time session's worth for each.
        self.tenant_floor = tenant_floor_s_per_s
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
        #: The loop thread's CPU clock (``time.thread_time``, read on the loop), injected: the
        #: work billed to clients is not all of the loop's (module doc, "Unbilled work").
        self._loop_cpu = loop_cpu
        self._cpu_seen: tuple[float, float] | None = None  # (loop CPU, now) at the last recompute
        self._loop_rate = 0.0
        #: How many seconds of loop each billed second stands for (>= 1): the loop's recent
        #: CPU over the clients' billed total. 1 without a loop CPU clock.
        self.unbilled = 1.0

    def _decayed(self, rate: float, since: float, now: float) -> float:
        return rate * math.exp(-(now - since) / self.window_s) if now > since else rate

    def charge(self, tenant: Hashable, seconds: float, now: float) -> float:
        """``tenant``'s work took ``seconds`` of the loop; returns its rate (seconds a second).

        Asks no wait itself: the tenant's readers ask :meth:`hold` before their next frame."""
        added = max(0.0, seconds) / self.window_s
        rate, since = self._rates.get(tenant, (0.0, now))
        rate = self._decayed(rate, since, now) + added
        self._rates[tenant] = (rate, now)
        self._total = (0.0 if self._at is None else self._decayed(self._total, self._at, now)) + added
        self._at = now
        return rate

    def hold(self, tenant: Hashable, now: float) -> float:
        """The seconds ``tenant``'s readers should wait before handling their next frame (0:
        none): until its recent rate has decayed to its share, at most ``max_wait_s``."""
        over = self._over_share(tenant, now)
        if over <= 1.0:
            return 0.0
        wait = min(self.max_wait_s, self.window_s * math.log(over))
        self.held_s += wait
        return wait

    def holds(self, tenant: Hashable, now: float) -> bool:
        """Whether :meth:`hold` would ask ``tenant``'s readers to wait at ``now``, counting no
        wait (a frame handled where no reader can wait asks this first)."""
        return self._over_share(tenant, now) > 1.0

    def _over_share(self, tenant: Hashable, now: float) -> float:
        """``tenant``'s recent rate over the fair share (0.0 while the loop has room)."""
        if now - self._share_at >= self.recompute_s:
            self._recompute(now)
        share = self._share
        if share is None:
            return 0.0
        return self.rate(tenant, now) / share

    def bill(self, tenant: Hashable, seconds: float, now: float) -> float:
        """:meth:`charge` ``tenant`` for a frame, then :meth:`hold`."""
        self.charge(tenant, seconds, now)
        return self.hold(tenant, now)

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
        total = self._decayed(self._total, self._at or now, now)
        self._measure_unbilled(total, now)
        # In billed seconds: the loop's capacity less what the unbilled work around it takes.
        capacity = self.capacity / self.unbilled
        if len(rates) < 2 or total < capacity:
            self._share = None
            return
        # Water-filling: the smallest users keep what they use while that is under an equal
        # split of what is left; the rest share the remainder equally.
        rates.sort()
        # The unbilled work may make the loop short sooner, but it never holds a client that
        # takes no more than an equal split of the capacity in billed seconds. Unbilled work is
        # not always shared out in proportion: a client that made its own unbilled (opening
        # connections and dropping them) pushed the factor to 4, and the share held back a
        # neighbour streaming audio on three sessions while it kept everything it used.
        floor = max(self.capacity / len(rates), self.tenant_floor)
        left, count = capacity, len(rates)
        for rate in rates:
            equal = left / count
            if rate > equal:
                self._share = max(equal, floor)
                return
            left -= rate
            count -= 1
        self._share = None  # everyone is under an equal split: nobody is over its share

    def _measure_unbilled(self, total: float, now: float) -> None:
        """Bring the loop's CPU rate and the unbilled factor up to date (module doc)."""
        if self._loop_cpu is None:
            return
        cpu = self._loop_cpu()
        if self._cpu_seen is not None and now > self._cpu_seen[1]:
            seen_cpu, seen_at = self._cpu_seen
            # The same decaying average as the bills', over the interval since the last look.
            weight = 1.0 - math.exp(-(now - seen_at) / self.window_s)
            self._loop_rate += weight * ((cpu - seen_cpu) / (now - seen_at) - self._loop_rate)
        self._cpu_seen = (cpu, now)
        self.unbilled = min(_MAX_UNBILLED, max(1.0, self._loop_rate / total)) if total > _IDLE else 1.0

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
