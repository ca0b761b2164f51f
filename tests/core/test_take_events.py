"""take_events hands the outbox over in order, numbered once, journaled once, at most ``limit``
at a time; held audio stays held (core/session.py, Outbox.take)."""

from __future__ import annotations

from duplex_actors.core import commands as cmd
from duplex_actors.core import events as ev
from duplex_actors.core.clock import ManualClock
from duplex_actors.core.outbox import Outbox
from duplex_actors.core.session import SessionCore


def _heartbeats(core: SessionCore, n: int) -> None:
    for _ in range(n):
        core.handle(cmd.Heartbeat())


def test_events_are_taken_in_order_numbered_once_and_journaled_once():
    core = SessionCore("sess_take", clock=ManualClock())
    _heartbeats(core, 4)
    taken = core.take_events()
    assert [e.seq for e in taken] == [1, 2, 3, 4, 5]  # session.created and four acks
    assert isinstance(taken[0], ev.SessionCreated) and core.journaled_events == 5
    assert core.take_events() == [] and core.journaled_events == 5 and core.last_seq == 5


def test_a_limit_takes_the_oldest_and_leaves_the_rest_for_the_next_take():
    core = SessionCore("sess_take", clock=ManualClock())
    _heartbeats(core, 4)
    first = core.take_events(limit=2)
    assert [e.seq for e in first] == [1, 2] and core.pending_events == 3
    assert core.journaled_events == 2
    assert [e.seq for e in core.take_events(limit=0)] == [] and core.pending_events == 3
    rest = core.take_events(limit=10)
    assert [e.seq for e in rest] == [3, 4, 5] and core.pending_events == 0
    assert core.journaled_events == 5


def test_outbox_take_leaves_held_audio_held():
    box = Outbox(capacity=8, reserve=2)
    box.hold("resp_1")
    delta = ev.AudioDeltaEvent(seq=0, epoch=0, session_id="s", response_id="resp_1", pcm=b"\0\0")
    ack = ev.HeartbeatAck(seq=0, epoch=0, session_id="s")
    assert box.push(delta) and box.push(ack)
    assert box.take() == [ack] and box.held == 1 and len(box) == 0
    assert box.release() == 1 and box.take(limit=5) == [delta]
