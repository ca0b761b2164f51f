"""The runtime-wide journal budget (core/journal.py, JournalBudget), as a ledger: journals open,
record events of any size, are aged by the reaper's pass and are released as their sessions
close, in any order.

What must hold: the budget counts exactly what its live journals hold; after a journal records,
it is within its fair share or the total is within the budget; after a reaper pass the total is
within the budget; between passes it stays under twice the budget; what a journal gave up
answers ResyncRequired while what it kept replays in order; journals that stay within their
share lose nothing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.core.events import AudioDeltaEvent
from duplex_actors.core.journal import JournalBudget, ReplayJournal, event_size
from duplex_actors.errors import ResyncRequired

BUDGET = 6_000

_record = st.tuples(
    st.just("record"), st.integers(0, 7), st.one_of(st.integers(0, 200), st.integers(800, 1500))
)
ops = st.lists(
    # Mostly records, so the total goes over the budget often.
    st.one_of(
        st.tuples(st.just("open")),
        _record,
        _record,
        _record,
        _record,
        st.tuples(st.just("reap")),
        st.tuples(st.just("release"), st.integers(0, 7)),
    ),
    min_size=20,
    max_size=120,
)


def _event(seq: int, pcm_bytes: int) -> AudioDeltaEvent:
    return AudioDeltaEvent(seq=seq, epoch=0, session_id="s", response_id="r", pcm=bytes(pcm_bytes))


class _Session:
    def __init__(self, budget: JournalBudget) -> None:
        # Own bounds far away: what trims here is the budget alone.
        self.journal = ReplayJournal(max_events=10**6, max_bytes=10**9, max_age_s=1e9, budget=budget)
        self.seq = 0
        self.live = True


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_budget_bounds_all_journals_together_and_trims_only_the_largest(operations):
    budget = JournalBudget(BUDGET)
    sessions = [_Session(budget), _Session(budget)]
    for op in operations:
        live = [s for s in sessions if s.live]
        if op[0] == "open":
            sessions.append(_Session(budget))
        elif op[0] == "record" and live:
            s = live[op[1] % len(live)]
            held_before = s.journal.bytes
            share = BUDGET / budget.journals
            trimmed_before = budget.trimmed
            s.seq += 1
            s.journal.record(_event(s.seq, op[2]), now=0.0)
            assert budget.total <= BUDGET or s.journal.bytes * budget.journals <= BUDGET
            if held_before + event_size(_event(0, op[2])) <= share:
                # Within its share after this event: nothing of its own is given up.
                assert s.journal.bytes == held_before + 128 + op[2]
                assert budget.trimmed == trimmed_before
        elif op[0] == "reap":
            for s in live:
                s.journal.expire(0.0)
            assert budget.total <= BUDGET
        elif op[0] == "release" and live:
            s = live[op[1] % len(live)]
            s.journal.release()
            s.live = False
        live = [s for s in sessions if s.live]
        assert budget.journals == len(live)
        assert budget.total == sum(s.journal.bytes for s in live)
        assert budget.total <= 2 * BUDGET + 1628  # plus one event over a share at most
        for s in live:
            # What is held is the latest events with no hole; anything before answers
            # ResyncRequired. (Read without since(), which evicts first as recording does.)
            held = [event.seq for _, _, event in s.journal._items or ()]
            assert held == list(range(s.seq - len(held) + 1, s.seq + 1))
            if len(held) < s.seq:
                with pytest.raises(ResyncRequired):
                    s.journal.since(s.seq - len(held) - 1, 0.0)


def test_a_released_journal_stops_counting_and_records_free_of_the_budget():
    budget = JournalBudget(1000)
    a = ReplayJournal(budget=budget)
    b = ReplayJournal(budget=budget)
    a.record(_event(1, 700), 0.0)
    b.record(_event(1, 100), 0.0)
    assert (budget.total, budget.journals) == (1056, 2)  # over, but a did not record since
    a.release()
    assert (budget.total, budget.journals) == (228, 1)
    a.record(_event(2, 5000), 0.0)  # the session's last events after it closed
    assert budget.total == 228 and len(a) == 2
    a.release()  # idempotent
    assert budget.journals == 1


def test_without_a_budget_a_journal_keeps_its_own_bound_only():
    journal = ReplayJournal(max_bytes=10_000)
    for seq in range(1, 11):
        journal.record(_event(seq, 1500), 0.0)
    assert journal.bytes <= 10_000 and len(journal) == 6


def test_a_replay_takes_what_the_chart_was_told_is_held_even_over_the_budget():
    # The chart asks holds_after() before it accepts a resume; since() must then not give up
    # more for the budget's sake, or an accepted resume would fail half-way.
    budget = JournalBudget(1000)
    big, small = ReplayJournal(budget=budget), ReplayJournal(budget=budget)
    for seq in range(1, 4):
        big.record(_event(seq, 200), 0.0)  # 984 bytes: within the budget as it records
    small.record(_event(1, 100), 0.0)  # the total is now over, and big is over its share
    assert big.holds_after(0, 0.0)
    assert [e.seq for e in big.since(0, 0.0)] == [1, 2, 3]
    assert budget.total == big.bytes + small.bytes
    big.expire(0.0)  # the reaper's pass trims it
    assert len(big) < 3 and budget.total <= 1000
