"""The loop-share ledger: what each client is billed for the loop's work done on its behalf.

Sans-IO: every method takes ``now`` and the costs the server measured; nothing here reads a
clock, a socket or a session. The server (:mod:`.app`, :mod:`.session_reader` and :mod:`.session_connection`) bills
three kinds of work through it, all to the client's tenant in the :class:`~.loop_share.LoopShare`:

* what a connection's writer encoded and sent (:meth:`LoopBilling.sent`), which also keeps
  :attr:`LoopBilling.cost_per_event`, what an event has lately cost to send;
* the dispatcher's time on the client's sessions (:meth:`LoopBilling.unsent`, from
  ``Runtime.take_tenant_work``);
* the events of its detached sessions, which nobody sends while the client is away: billed as
  if sent, at :attr:`LoopBilling.cost_per_event` (:meth:`LoopBilling.unsent`), so that a client
  asking for a response and dropping the connection, over and over, waits like any other.

A session's account (:class:`Account`) says up to which event it has been billed, so that no
event is billed twice: neither when it is sent after a resume nor when it is replayed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .loop_share import LoopShare

#: Weight of the latest burst in :attr:`LoopBilling.cost_per_event` (an exponential average).
COST_PER_EVENT_WEIGHT = 0.01


class Account:
    """One session's standing in the ledger: the events counted (observed once, never again
    when replayed) and the events billed (sent, or produced while its client was away)."""

    __slots__ = ("counted_seq", "billed_seq")

    def __init__(self) -> None:
        self.counted_seq = 0
        self.billed_seq = 0

    def count(self, seq: int) -> bool:
        """Whether the event numbered ``seq`` is seen for the first time (and count it)."""
        if seq > self.counted_seq:
            self.counted_seq = seq
            return True
        return False


class LoopBilling:
    """Bills clients' work to their tenants in a :class:`~.loop_share.LoopShare` (module
    docstring); the share is passed in, since the server may swap it."""

    __slots__ = ("cost_per_event",)

    def __init__(self) -> None:
        #: What sending one event has lately cost the loop (seconds; 0 until a writer sent one).
        self.cost_per_event = 0.0

    def sent(
        self, share: LoopShare, account: Account, tenant: str, cost: float, events: int, now: float
    ) -> None:
        """A writer sent ``events`` events for ``tenant`` at a cost of ``cost`` loop seconds:
        billed, and every event counted so far is billed with them."""
        share.charge(tenant, cost, now)
        account.billed_seq = max(account.billed_seq, account.counted_seq)
        if events:
            per_event = cost / events
            known = self.cost_per_event
            self.cost_per_event = known + COST_PER_EVENT_WEIGHT * (per_event - known) if known else per_event

    def away(self, share: LoopShare, account: Account, tenant: str, produced: int, now: float) -> None:
        """A detached session has produced ``produced`` events in all: those not billed yet are
        billed as if sent, at what sending an event has lately cost."""
        if produced > account.billed_seq:
            if self.cost_per_event:
                share.charge(tenant, (produced - account.billed_seq) * self.cost_per_event, now)
            account.billed_seq = produced

    def unsent(
        self,
        share: LoopShare,
        tenant_work: Mapping[str, float],
        detached: Iterable[tuple[Account, str, int]],
        now: float,
    ) -> None:
        """Bill what no frame measured: the dispatcher's seconds per tenant, then the new
        events of each detached session, given as (account, tenant, events produced)."""
        for tenant, seconds in tenant_work.items():
            share.charge(tenant, seconds, now)
        for account, tenant, produced in detached:
            self.away(share, account, tenant, produced, now)
