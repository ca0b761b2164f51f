"""FairShare (core/fair_share.py): least recently served tenant, then its least recently served
flow; nobody waits through two services of another tenant; nothing is held once flows end."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from duplex_actors.core.fair_share import FairShare

TENANTS = ("a", "b", "c")
#: Flow names: tenant + number, so a flow's tenant is fixed by its name.
FLOWS = tuple(f"{t}{i}" for t in TENANTS for i in range(3))


def serve_again_and_again(share: FairShare, rounds: int, tenant_of) -> list:
    """Serve ``rounds`` times; each flow served waits again at once (it always has more)."""
    served = []
    for _ in range(rounds):
        flow = share.next()
        served.append(flow)
        share.wait(flow, tenant_of(flow))
    return served


def drain(share: FairShare) -> list:
    served = []
    while (flow := share.next()) is not None:
        served.append(flow)
    return served


def test_a_tenant_with_many_flows_gets_one_share_not_one_per_flow():
    share: FairShare[str] = FairShare()
    for i in range(4):
        share.wait(f"flood{i}", "flooder")
    share.wait("mine", "neighbour")
    first = share.next()
    # The neighbour is served after one of the flooder's flows, not after all four.
    assert first == "flood0"
    assert share.next() == "mine"
    # From then on, alone, the flooder gets everything (work-conserving).
    assert drain(share) == ["flood1", "flood2", "flood3"]


def test_a_flow_named_with_no_tenant_is_a_tenant_of_its_own():
    # A session no client was named for shares as a client of its own: beside a tenant of
    # four flows it goes after one of them, and it is no other flow's tenant.
    share: FairShare[str] = FairShare()
    for i in range(4):
        share.wait(f"flood{i}", "flooder")
    share.wait("alone")
    assert [share.next(), share.next()] == ["flood0", "alone"]
    share.wait("alone", "alone")  # the same tenant, named
    with pytest.raises(ValueError):
        share.wait("alone", "flooder")


def test_a_tenant_that_waits_again_goes_before_those_served_since():
    share: FairShare[str] = FairShare()
    share.wait("mine", "neighbour")
    assert share.next() == "mine"  # served once, then idle
    for i in range(3):
        share.wait(f"flood{i}", "flooder")
    assert share.next() == "flood0"
    share.wait("mine", "neighbour")  # back: the flooder was served after it was
    assert share.next() == "mine"


def test_always_arriving_idle_does_not_starve_the_others():
    # A tenant that waits again only right after being served would always be idle when it
    # waits; its stamp is renewed each time, so it alternates with the others.
    share: FairShare[str] = FairShare()
    share.wait("flood", "flooder")
    share.wait("eager", "eager")
    served = serve_again_and_again(share, 6, lambda flow: "flooder" if flow == "flood" else "eager")
    assert served.count("flood") == 3 and served.count("eager") == 3


def test_within_a_tenant_flows_take_turns():
    share: FairShare[str] = FairShare()
    share.wait("x", "t")
    share.wait("y", "t")
    assert serve_again_and_again(share, 4, lambda flow: "t") == ["x", "y", "x", "y"]


def test_a_flow_keeps_its_tenant_until_forgotten():
    share: FairShare[str] = FairShare()
    share.wait("f", "t")
    with pytest.raises(ValueError, match="belongs to tenant"):
        share.wait("f", "u")
    share.forget("f")
    share.wait("f", "u")  # a new flow of that name
    assert share.next() == "f"


def test_ending_flows_and_starting_new_ones_does_not_jump_the_line():
    share: FairShare[str] = FairShare()
    share.wait("theirs", "neighbour")
    share.wait("r0", "flooder")
    assert share.next() == "theirs"  # never served: in the order they came
    share.forget("theirs")
    share.wait("next", "neighbour")
    assert share.next() == "r0"
    for i in range(1, 4):
        share.forget(f"r{i - 1}")  # the flooder's flow ends, and it starts another at once
        share.wait(f"r{i}", "flooder")
        share.wait("next", "neighbour")
        # The flooder was served last: the neighbour goes first, every time.
        assert share.next() == "next"
        assert share.next() == f"r{i}"


def test_idle_tenants_are_remembered_up_to_a_bound():
    share: FairShare[str] = FairShare(remember_tenants=2)
    for t in ("a", "b", "c"):
        share.wait(t, t)
        assert share.next() == t
        share.forget(t)
    assert share.held() == 2  # a was pushed out; b and c remembered
    share.wait("c2", "c")
    share.wait("b2", "b")
    share.wait("a2", "a")
    # a comes back as never served, then b (served before c).
    assert [share.next() for _ in range(3)] == ["a2", "b2", "c2"]


def test_waiting_and_leaving_over_and_over_holds_nothing():
    share: FairShare[str] = FairShare(remember_tenants=8)
    share.wait("stay", "t")
    for i in range(10_000):
        share.wait(f"f{i}", f"t{i % 7}")
        share.leave(f"f{i}")
        share.forget(f"f{i}")
    # One waiting flow; the heaps' stale entries are compacted away past a small bound.
    assert share.held() < 60
    assert share.next() == "stay"
    share.forget("stay")
    assert share.held() < 40


class FairShareMachine(RuleBasedStateMachine):
    """Random waits, services, leaves and forgets against a plain model of the rule."""

    def __init__(self) -> None:
        super().__init__()
        self.share: FairShare[str] = FairShare()
        self.clock = 0
        self.waiting: set[str] = set()
        self.known: set[str] = set()  # flows not forgotten
        self.flow_served: dict[str, int] = {}
        self.tenant_served: dict[str, int] = {}
        # For the no-two-services rule: per waiting tenant, services of others since it began.
        self.others_served: dict[str, dict[str, int]] = {}

    @staticmethod
    def tenant(flow: str) -> str:
        return flow[0]

    def waiting_tenants(self) -> set[str]:
        return {self.tenant(f) for f in self.waiting}

    @rule(flow=st.sampled_from(FLOWS))
    def wait(self, flow):
        t = self.tenant(flow)
        if t not in self.waiting_tenants():
            self.others_served[t] = {}
        self.share.wait(flow, t)
        self.waiting.add(flow)
        self.known.add(flow)

    @rule()
    def serve(self):
        flow = self.share.next()
        if not self.waiting:
            assert flow is None
            return
        assert flow in self.waiting
        t = self.tenant(flow)
        never = float("-inf")
        stamp = self.tenant_served.get(t, never)
        # The least recently served tenant (never served: before all), then its flow.
        for other in self.waiting_tenants() - {t}:
            assert self.tenant_served.get(other, never) >= stamp
        for other in self.waiting:
            if self.tenant(other) == t:
                assert self.flow_served.get(other, never) >= self.flow_served.get(flow, never)
        for waiter, counts in self.others_served.items():
            if waiter != t:
                counts[t] = counts.get(t, 0) + 1
                assert counts[t] <= 1, f"{t} served twice while {waiter} waited"
        self.clock += 1
        self.flow_served[flow] = self.tenant_served[t] = self.clock
        self.waiting.discard(flow)
        if t not in self.waiting_tenants():
            del self.others_served[t]
        else:
            self.others_served[t] = {}  # it waits again from now, behind the rest

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def leave(self, data):
        flow = data.draw(st.sampled_from(sorted(self.waiting)))
        self.share.leave(flow)
        self.waiting.discard(flow)
        if self.tenant(flow) not in self.waiting_tenants():
            self.others_served.pop(self.tenant(flow), None)

    @precondition(lambda self: self.known)
    @rule(data=st.data())
    def forget(self, data):
        flow = data.draw(st.sampled_from(sorted(self.known)))
        self.share.forget(flow)
        self.known.discard(flow)
        self.waiting.discard(flow)
        self.flow_served.pop(flow, None)
        t = self.tenant(flow)  # its stamp is remembered (three tenants: well within the bound)
        if t not in self.waiting_tenants():
            self.others_served.pop(t, None)

    @invariant()
    def agrees_on_who_waits(self):
        assert len(self.share) == len(self.waiting)
        for flow in FLOWS:
            assert self.share.waiting(flow) == (flow in self.waiting)

    @invariant()
    def holds_only_what_live_flows_need(self):
        # Flows known (tenant and stamp) and tenants known, plus heap entries compacted past
        # twice the live ones and a small slack.
        assert self.share.held() <= 4 * len(FLOWS) + 3 * 16 + 2 * len(TENANTS)


TestFairShareMachine = FairShareMachine.TestCase
TestFairShareMachine.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestFairShareMachine.pytestmark = [pytest.mark.slow]
