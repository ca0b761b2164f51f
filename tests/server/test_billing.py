"""The loop-share ledger, sans-IO: what a writer sent, a detached session's events billed as if
sent (once each), and the dispatcher's work per tenant."""

from __future__ import annotations

import pytest

from duplex_actors.server.billing import COST_PER_EVENT_WEIGHT, Account, LoopBilling


class Share:
    """Records the bills a LoopShare would get."""

    def __init__(self) -> None:
        self.bills: list[tuple[str, float, float]] = []

    def charge(self, tenant: str, seconds: float, now: float) -> float:
        self.bills.append((tenant, seconds, now))
        return 0.0


def test_an_event_is_counted_once_even_when_replayed():
    account = Account()
    assert [account.count(seq) for seq in (1, 2, 2, 1, 3)] == [True, True, False, False, True]
    assert account.counted_seq == 3 and account.billed_seq == 0


def test_what_a_writer_sent_is_billed_and_sets_the_cost_of_an_event():
    share, billing, account = Share(), LoopBilling(), Account()
    account.count(4)
    billing.sent(share, account, "key:a", 0.004, 4, now=1.0)
    assert share.bills == [("key:a", 0.004, 1.0)]
    assert account.billed_seq == 4
    assert billing.cost_per_event == pytest.approx(0.001)  # the first burst sets it
    billing.sent(share, account, "key:a", 0.003, 1, now=2.0)
    assert billing.cost_per_event == pytest.approx(0.001 + COST_PER_EVENT_WEIGHT * 0.002)
    billing.sent(share, account, "key:a", 0.0, 0, now=3.0)  # nothing sent: the average stands
    assert billing.cost_per_event == pytest.approx(0.001 + COST_PER_EVENT_WEIGHT * 0.002)


def test_a_detached_sessions_events_are_billed_once_as_if_sent():
    share, billing, account = Share(), LoopBilling(), Account()
    billing.cost_per_event = 0.001
    account.billed_seq = 10
    billing.unsent(share, {"key:a": 0.05, "key:b": 0.01}, [(account, "key:a", 15)], now=5.0)
    assert share.bills == [("key:a", 0.05, 5.0), ("key:b", 0.01, 5.0), ("key:a", pytest.approx(0.005), 5.0)]
    assert account.billed_seq == 15
    share.bills.clear()
    billing.unsent(share, {}, [(account, "key:a", 15)], now=6.0)  # nothing new: nothing billed
    assert share.bills == []


def test_before_any_event_was_sent_a_detached_sessions_events_are_counted_not_billed():
    share, billing, account = Share(), LoopBilling(), Account()
    billing.away(share, account, "key:a", 7, now=1.0)
    assert share.bills == [] and account.billed_seq == 7
