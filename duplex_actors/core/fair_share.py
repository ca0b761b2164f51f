"""Who goes next at a shared resource: tenants share it evenly, and so do each tenant's flows.

Theory of operation
-------------------
A *flow* is one stream of work (a session's turns waiting for the recogniser, a response's
phrases waiting for the speech synthesiser, a request waiting for a decode slot); its *tenant*
is whoever it belongs to (an API key, a client address, or the flow's session when nobody
said). The resource serves one piece of work at a time per worker, and asks :meth:`FairShare.next`
which waiting flow to serve.

The answer is *least recently served*, twice: among tenants with a waiting flow, the one served
longest ago; among that tenant's waiting flows, the one served longest ago. Ties (never served)
go in the order they began to wait. So:

* while a tenant waits, no other tenant is served twice: once served, the other's stamp is newer
  than the waiting one's. A client opening many sessions gets one tenant's share, not one per
  session; a neighbour with one session waits for at most one piece per other tenant;
* a tenant (or flow) that was idle keeps its old stamp, so it goes ahead of everyone served
  since. It cannot starve the others by always arriving idle: its stamp is renewed each time it
  is served (a rule of "idle goes first" had exactly that hole). Nor by ending its flows and
  starting new ones: a tenant's stamp outlives its flows (below);
* it is work-conserving: a tenant alone gets the whole resource.

Memory: a flow's stamp is kept until :meth:`FairShare.forget` (the flow ended). A tenant's is
kept while it has a flow not forgotten, then among the ``remember_tenants`` tenants that were
last to lose their last flow; one pushed out of that memory comes back as never served (first
in line, as if new). Waiting is tracked in heaps with lazy deletion, compacted when stale
entries outnumber live ones, so a flow that waits and leaves over and over holds nothing.

Sans-IO: no clock, no threads; the caller serialises access.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Hashable)

#: Stamp of a flow or tenant never served: before every served one.
_NEVER = -1


class _Line(Generic[F]):
    """A heap of waiting members, least recently served first, with lazy deletion."""

    __slots__ = ("_heap", "_entry")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, F]] = []
        #: The one live entry of each waiting member: its ``joined`` tick.
        self._entry: dict[F, int] = {}

    def __contains__(self, member: F) -> bool:
        return member in self._entry

    def __len__(self) -> int:
        return len(self._entry)

    def push(self, member: F, served: int, joined: int) -> None:
        self._entry[member] = joined
        heapq.heappush(self._heap, (served, joined, member))
        self._compact()

    def pop(self) -> F | None:
        heap = self._heap
        while heap:
            _, joined, member = heapq.heappop(heap)
            if self._entry.get(member) == joined:
                del self._entry[member]
                return member
        return None

    def remove(self, member: F) -> None:
        if self._entry.pop(member, None) is not None:
            self._compact()

    def _compact(self) -> None:
        # Stale entries are dropped when they reach the top; a member that joins and leaves
        # without being served leaves one behind each time, so rebuild past a bound.
        if len(self._heap) > 2 * len(self._entry) + 16:
            self._heap = [e for e in self._heap if self._entry.get(e[2]) == e[1]]
            heapq.heapify(self._heap)


class FairShare(Generic[F]):
    """Least recently served tenant, then its least recently served flow (module docstring)."""

    __slots__ = (
        "remember_tenants",
        "_ticks",
        "_tenants",
        "_lines",
        "_flow_tenant",
        "_flow_served",
        "_tenant_served",
        "_known",
        "_idle_tenants",
    )

    def __init__(self, *, remember_tenants: int = 4096) -> None:
        if remember_tenants < 0:
            raise ValueError("remember_tenants must be >= 0")
        self.remember_tenants = remember_tenants
        self._ticks = 0
        #: Tenants with a waiting flow.
        self._tenants: _Line[Hashable] = _Line()
        #: Each waiting tenant's waiting flows.
        self._lines: dict[Hashable, _Line[F]] = {}
        #: Every flow not forgotten, and its tenant.
        self._flow_tenant: dict[F, Hashable] = {}
        self._flow_served: dict[F, int] = {}
        self._tenant_served: dict[Hashable, int] = {}
        #: Flows not forgotten, per tenant.
        self._known: dict[Hashable, int] = {}
        #: Stamps of tenants whose flows are all forgotten, oldest first (bounded).
        self._idle_tenants: dict[Hashable, int] = {}

    def _tick(self) -> int:
        self._ticks += 1
        return self._ticks

    def wait(self, flow: F, tenant: Hashable = None) -> None:
        """``flow`` (of ``tenant``) has work. Waiting already: no change. A flow belongs to
        one tenant until forgotten; naming another is a ValueError. No tenant (None): the flow
        is a tenant of its own (a session or request no client was named for)."""
        if tenant is None:
            tenant = flow
        known = self._flow_tenant.get(flow)
        if known is None:
            self._flow_tenant[flow] = tenant
            self._known[tenant] = self._known.get(tenant, 0) + 1
            stamp = self._idle_tenants.pop(tenant, None)
            if stamp is not None:
                self._tenant_served[tenant] = stamp
        elif known != tenant:
            raise ValueError(f"flow {flow!r} belongs to tenant {known!r}, not {tenant!r}")
        line = self._lines.get(tenant)
        if line is None:
            line = self._lines[tenant] = _Line()
            self._tenants.push(tenant, self._tenant_served.get(tenant, _NEVER), self._tick())
        elif flow in line:
            return
        line.push(flow, self._flow_served.get(flow, _NEVER), self._tick())

    def next(self) -> F | None:
        """The flow to serve now, which stops waiting (call :meth:`wait` again if it has more
        work); None if no flow waits."""
        tenant = self._tenants.pop()
        if tenant is None:
            return None
        line = self._lines[tenant]
        flow = line.pop()
        assert flow is not None, "a waiting tenant has a waiting flow"
        now = self._tick()
        self._flow_served[flow] = now
        self._tenant_served[tenant] = now
        if line:
            self._tenants.push(tenant, now, self._tick())
        else:
            del self._lines[tenant]
        return flow

    def leave(self, flow: F) -> None:
        """``flow`` no longer has work (withdrawn, not served); its place in line is kept for
        when it waits again."""
        tenant = self._flow_tenant.get(flow)
        line = None if tenant is None else self._lines.get(tenant)
        if line is None or flow not in line:
            return
        line.remove(flow)
        if not line:
            del self._lines[tenant]
            self._tenants.remove(tenant)

    def forget(self, flow: F) -> None:
        """``flow`` is over: it stops waiting and its stamp goes (its tenant's is remembered
        a while after its last flow; module docstring). Unknown flows: no-op."""
        self.leave(flow)
        tenant = self._flow_tenant.pop(flow, None)
        if tenant is None:
            return
        self._flow_served.pop(flow, None)
        left = self._known[tenant] - 1
        if left:
            self._known[tenant] = left
        else:
            del self._known[tenant]
            stamp = self._tenant_served.pop(tenant, None)
            if stamp is not None and self.remember_tenants:
                idle = self._idle_tenants
                idle[tenant] = stamp
                if len(idle) > self.remember_tenants:
                    del idle[next(iter(idle))]

    def waiting(self, flow: F) -> bool:
        tenant = self._flow_tenant.get(flow)
        line = None if tenant is None else self._lines.get(tenant)
        return line is not None and flow in line

    def __len__(self) -> int:
        """Flows waiting."""
        return sum(len(line) for line in self._lines.values())

    def held(self) -> int:
        """Entries held in all (flows and tenants known, heap entries): for memory tests."""
        return (
            len(self._flow_tenant)
            + len(self._flow_served)
            + len(self._tenant_served)
            + len(self._known)
            + len(self._idle_tenants)
            + len(self._tenants._heap)
            + sum(len(line._heap) for line in self._lines.values())
        )
