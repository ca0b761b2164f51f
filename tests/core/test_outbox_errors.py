"""The outbox bounds error events: they answer the client's own refused commands, so their
number is the client's choice, and they must not be able to grow memory or eat the reserve."""

from __future__ import annotations

from duplex_actors.core import events as ev
from duplex_actors.core.outbox import Outbox


def _error(i: int) -> ev.ErrorEvent:
    return ev.ErrorEvent(seq=0, epoch=0, session_id="s", code="invalid_json", message=f"bad {i}")


def _closed() -> ev.SessionClosedEvent:
    return ev.SessionClosedEvent(seq=0, epoch=0, session_id="s", reason="client_closed")


def test_errors_past_the_unreserved_part_are_counted_and_dropped_and_terminals_still_fit():
    box = Outbox(capacity=20, reserve=4)
    for i in range(1000):
        assert box.push(_error(i))  # never the slow-consumer signal: errors are not deltas
    assert len(box) == 16 and box.dropped_errors == 1000 - 16 and not box.overflowed
    assert box.push(_closed())
    assert len(box) == 17 and box.popleft().message == "bad 0"
