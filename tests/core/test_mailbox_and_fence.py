import pytest
from hypothesis import given
from hypothesis import strategies as st

from duplex_actors.actors.mailbox import Mailbox
from duplex_actors.core.commands import Lane
from duplex_actors.core.fence import Fence, parse_request_id
from duplex_actors.errors import EngineProtocolError, MailboxFull


@given(st.lists(st.tuples(st.sampled_from(list(Lane)), st.integers()), max_size=200), st.integers(1, 20))
def test_mailbox_is_bounded_ordered_per_lane_and_prioritised(puts, capacity):
    box = Mailbox(capacity)
    accepted = {lane: [] for lane in Lane}
    for lane, value in puts:
        before = box.statistics()
        try:
            box.put(lane, value)
            accepted[lane].append(value)
        except MailboxFull:
            assert lane != Lane.ENGINE
            assert box.lane_depth(lane) == capacity
            after = box.statistics()
            assert (after.control, after.engine, after.data) == (before.control, before.engine, before.data)
        assert box.lane_depth(Lane.CONTROL) <= capacity and box.lane_depth(Lane.DATA) <= capacity
    out = box.drain()
    # priority: all control, then engine, then data; order kept within each lane
    lanes = [lane for lane, _ in out]
    assert lanes == sorted(lanes)
    for lane in Lane:
        assert [v for got, v in out if got == lane] == accepted[lane]
    assert len(box) == 0


def test_statistics_count_refusals():
    box = Mailbox(1)
    box.put(Lane.DATA, 1)
    with pytest.raises(MailboxFull):
        box.put(Lane.DATA, 2)
    s = box.statistics()
    assert (s.data, s.accepted, s.refused, s.high_water) == (1, 1, 1, 1)


ids = st.from_regex(r"sess_[0-9a-f]{4,24}", fullmatch=True)


@given(ids, st.integers(0, 10**6), st.integers(0, 10**6), st.none() | st.integers(0, 10**6))
def test_request_ids_round_trip_through_the_fence(sid, epoch, turn, unit):
    fence = Fence(sid, epoch, turn)
    assert parse_request_id(fence.request_id(unit)) == (fence, unit)


@pytest.mark.parametrize("bad", ["", "x", "s/e1", "s/x1/t2", "s/e1/tq", "s/e1/t2/z3", "s/e1/t2/u"])
def test_foreign_request_ids_are_refused(bad):
    with pytest.raises(EngineProtocolError):
        parse_request_id(bad)


def test_fence_ordering():
    assert Fence("s", 0, 5).is_older_than(Fence("s", 1, 0))
    assert not Fence("s", 1, 0).is_older_than(Fence("s", 1, 0))
