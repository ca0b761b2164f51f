"""Fixed inputs for behaviour that mutating the code showed no test pinned down (issue 31).

Each test names the mutation it catches: with that change applied, it fails on every run (the
stateful tests caught some of these only when hypothesis happened to draw the input)."""

from __future__ import annotations

import pytest

from duplex_actors.core import commands as cmd
from duplex_actors.core.engine_io import Aborted, Decision, TextDelta, TurnDone
from duplex_actors.core.session import SubmitTurn

from .helpers import CHUNK, core_in

UNIT = b"\x02\x00" * 1600  # exactly one model-native unit of 1600 samples


@pytest.mark.parametrize(
    "answer",
    [lambda unit: Decision(unit, False), lambda unit: TurnDone(unit, reason="listen")],
    ids=["decision", "turn_done"],
)
def test_a_unit_that_decides_to_listen_frees_its_lease_slot(answer):
    """Mutation caught: the ``listen`` branch not freeing the unit's slot (``finish_unit``
    dropped from the row, or not decrementing ``lease.in_flight``). A slot held for a unit
    that is over keeps an idle session from ever expiring on its idle TTL."""
    core = core_in("idle", model_native=True, unit_samples=1600, idle_ttl_s=5.0)
    core.handle(cmd.AppendAudio(pcm=UNIT + CHUNK))
    (submit,) = core.take_actions()
    assert isinstance(submit, SubmitTurn)
    unit = submit.request.request_id
    assert core.state == "listening" and core.lease.in_flight == 1
    core.on_engine_output(answer(unit))
    decisions = [e.decision for e in core.take_events() if e.type == "duplex.decision"]
    assert decisions == ["listen"]
    assert core.state == "listening"
    assert core.lease.in_flight == 0
    assert core.in_flight_requests == frozenset()
    # What the slot is for: with nothing in flight, the idle TTL closes the session.
    core.clock.advance(5.0)
    core.expire()
    assert core.state == "closed"


def test_output_of_a_cancelled_request_is_stale_for_the_next_request_of_the_same_turn():
    """Mutation caught: matching engine output to the current request by turn id alone. A
    barge-in moves the epoch but finishes no turn, so the next response has the same turn id
    (``e0/t0`` then ``e1/t0``): only the epoch tells the cancelled request's late output from
    the new one's."""
    core = core_in("responding_begun")
    old = core.fence.request_id()
    core.handle(cmd.BargeIn())
    core.handle(cmd.AppendAudio(pcm=CHUNK))
    core.handle(cmd.CommitInput())
    new = next(a.request.request_id for a in core.take_actions() if isinstance(a, SubmitTurn))
    assert (old, new) == ("sess_table000000/e0/t0", "sess_table000000/e1/t0")
    core.take_events()

    stale = core.counters.stale_outputs
    core.on_engine_output(TextDelta(old, "from the cancelled response"))
    core.on_engine_output(TurnDone(old))
    assert core.counters.stale_outputs == stale + 2
    assert core.counters.invalid_outputs == 0
    assert core.state == "responding" and core.in_flight_requests == {new}
    assert core.take_events() == []

    core.on_engine_output(Aborted(old))  # the cancelled request's real end: settles its abort
    core.on_engine_output(TextDelta(new, "answer"))
    core.on_engine_output(TurnDone(new))
    events = core.take_events()
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == ["answer"]
    done = [e for e in events if e.type == "response.done"]
    assert len(done) == 1 and done[0].status == "completed"
    assert core.state == "idle" and not core.aborting_requests
