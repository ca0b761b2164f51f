"""The recogniser's queue (actors/transcription_queue.py): sessions take turns, each session's
backlog is bounded, and every turn offered is refused, taken or forgotten exactly once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from duplex_actors.actors.transcription_queue import TranscriptionJob, TranscriptionQueue
from duplex_actors.core.actions import TranscribeInput

RATE = 16000


def job(session: str, seconds: float, n: int = 0) -> TranscriptionJob:
    audio = b"\x00\x00" * int(RATE * seconds)
    return TranscriptionJob(session, TranscribeInput(f"{session}_{n}", audio, RATE), lambda result: None)


def test_sessions_take_turns_whatever_their_backlogs():
    q = TranscriptionQueue(max_backlog_s=60.0)
    for i in range(5):
        assert q.offer(job("flooder", 1.0, i))
    assert q.offer(job("neighbour", 1.0))
    order = []
    while (j := q.take()) is not None:
        order.append(j.action.item_id)
        q.done(j)
    # The neighbour came after one of the flooder's turns, not after all five.
    assert order == ["flooder_0", "neighbour_0", "flooder_1", "flooder_2", "flooder_3", "flooder_4"]


def test_a_sessions_backlog_is_bounded_in_seconds_and_frees_as_turns_are_answered():
    q = TranscriptionQueue(max_backlog_s=3.0)
    assert q.offer(job("s", 2.0, 0))
    assert q.offer(job("s", 1.0, 1))
    assert not q.offer(job("s", 0.5, 2))  # 3.5 s would be over
    assert q.offer(job("other", 2.5))  # another session's backlog is its own
    assert q.backlog_s("s") == pytest.approx(3.0)
    taken = q.take()
    assert q.backlog_s("s") == pytest.approx(3.0)  # being transcribed still counts
    q.done(taken)
    assert q.backlog_s("s") == pytest.approx(1.0)
    assert q.offer(job("s", 2.0, 3))
    # A single long turn is taken when nothing of its session waits: the bound is on piling up.
    assert q.offer(job("long", 10.0))
    assert not q.offer(job("long", 0.1, 1))


def test_a_closed_sessions_turns_are_forgotten():
    q = TranscriptionQueue(max_backlog_s=10.0)
    for i in range(3):
        q.offer(job("gone", 1.0, i))
    q.offer(job("here", 1.0))
    assert q.forget("gone") == 3
    assert q.backlog_s("gone") == 0.0
    assert q.take().session_id == "here" and q.take() is None
    with pytest.raises(ValueError):
        TranscriptionQueue(max_backlog_s=0.0)


@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("offer"), st.sampled_from("abc"), st.floats(0.05, 4.0)),
            st.tuples(st.just("take"), st.none(), st.none()),
            st.tuples(st.just("forget"), st.sampled_from("abc"), st.none()),
        ),
        max_size=80,
    ),
    bound=st.floats(1.0, 8.0),
)
def test_every_turn_is_refused_taken_or_forgotten_once_and_no_waiting_session_is_skipped(ops, bound):
    q = TranscriptionQueue(max_backlog_s=bound)
    accepted = taken = forgotten = n = 0
    # Our own count of each session's waiting turns, and an epoch that moves each time a
    # session stops waiting: (session, epoch) names one unbroken stretch of waiting.
    pending = {s: 0 for s in "abc"}
    epoch = {s: 0 for s in "abc"}
    takes: list[tuple[str, set[tuple[str, int]]]] = []  # who was served, and who was waiting

    def stop_waiting(session: str) -> None:
        pending[session] = 0
        epoch[session] += 1

    def take_one() -> bool:
        nonlocal taken
        waiting = {(s, epoch[s]) for s in "abc" if pending[s]}
        j = q.take()
        if j is None:
            assert not waiting and len(q) == 0
            return False
        taken += 1
        takes.append((j.session_id, waiting))
        pending[j.session_id] -= 1
        if not pending[j.session_id]:
            stop_waiting(j.session_id)
        q.done(j)
        return True

    for op, session, seconds in ops:
        if op == "offer":
            n += 1
            waiting_before = q.backlog_s(session)
            if q.offer(job(session, seconds, n)):
                accepted += 1
                pending[session] += 1
                # Only a session with nothing waiting may go past the bound (one long turn).
                assert waiting_before == 0.0 or q.backlog_s(session) <= bound + 1e-9
            else:
                assert waiting_before + seconds > bound
        elif op == "take":
            take_one()
        else:
            dropped = q.forget(session)
            assert dropped == pending[session]
            forgotten += dropped
            stop_waiting(session)
        assert len(q) == sum(pending.values())
    while take_one():
        pass
    assert accepted == taken + forgotten
    assert len(q) == 0 and all(q.backlog_s(s) == 0.0 for s in "abc")
    # Round robin: between two turns of one session, every other session that waited all
    # along was served.
    for i, (served, waiting_i) in enumerate(takes):
        nxt = next((k for k in range(i + 1, len(takes)) if takes[k][0] == served), None)
        if nxt is None:
            continue
        between = {takes[k][0] for k in range(i + 1, nxt)}
        for other in waiting_i & takes[nxt][1]:
            if other[0] != served:
                assert other[0] in between, (served, other, takes)
