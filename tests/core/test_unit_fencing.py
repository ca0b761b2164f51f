"""Model-native unit requests are fenced off when the user's turn is committed or cleared, when
the client asks for a response itself, and when it turns model-native turns off.

A unit asks the model "listen or speak?" about audio the user has since committed (so a
response turn now answers it), thrown away (clear), or that a response the client asked for
now follows. Its later output must not interleave into the response, its end must not be
refused, and it must not keep holding the lease."""

import pytest

from duplex_actors.core import commands as cmd
from duplex_actors.core.engine_io import Decision, TextDelta, TurnDone
from duplex_actors.core.session import AbortRequests, SubmitTurn

from .helpers import CHUNK, core_in

UNIT = b"\x02\x00" * 1600  # exactly one unit of 1600 samples


def _native_core_with_unit_in_flight():
    core = core_in("idle", model_native=True, unit_samples=1600)
    core.handle(cmd.AppendAudio(pcm=UNIT + CHUNK))  # one unit goes out, a little stays buffered
    (submit,) = core.take_actions()
    assert isinstance(submit, SubmitTurn)
    core.take_events()
    return core, submit.request.request_id


def _fenced_off_then_the_turn_answers(core, unit: str) -> None:
    """``core`` just fenced ``unit`` off for a turn it submitted: the unit's abort went out, its
    later output is stale (not refused, not delivered), and the turn's answer alone is the
    response; nothing stays in flight."""
    actions = core.take_actions()
    aborts = [a for a in actions if isinstance(a, AbortRequests)]
    assert aborts and unit in aborts[0].request_ids
    turn = next(a.request.request_id for a in actions if isinstance(a, SubmitTurn))
    assert core.in_flight_requests == {turn}
    assert core.lease.in_flight == 1

    stale_before = core.counters.stale_outputs
    core.on_engine_output(Decision(unit, True))
    core.on_engine_output(TextDelta(unit, "unit words"))
    core.on_engine_output(TurnDone(unit))
    assert core.counters.stale_outputs == stale_before + 3
    assert core.counters.invalid_outputs == 0

    core.on_engine_output(TextDelta(turn, "answer"))
    core.on_engine_output(TurnDone(turn))
    events = core.take_events()
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas == ["answer"]
    assert core.state in ("idle", "listening") and core.lease.in_flight == 0
    assert not core.in_flight_requests and not core.aborting_requests


def test_commit_aborts_units_still_deciding_and_their_output_is_stale():
    core, unit = _native_core_with_unit_in_flight()
    core.handle(cmd.CommitInput())
    _fenced_off_then_the_turn_answers(core, unit)


def test_clear_aborts_units_and_a_unit_that_speaks_later_is_not_reported_as_listen():
    core, unit = _native_core_with_unit_in_flight()
    core.handle(cmd.ClearInput())
    (abort,) = core.take_actions()
    assert isinstance(abort, AbortRequests) and abort.request_ids == (unit,)
    assert core.state == "idle" and not core.in_flight_requests and core.lease.in_flight == 0

    core.on_engine_output(Decision(unit, True))
    core.on_engine_output(TurnDone(unit))
    events = core.take_events()
    assert [e for e in events if e.type == "duplex.decision"] == []
    assert core.counters.invalid_outputs == 0
    assert not core.aborting_requests  # the unit's end settled its abort


@pytest.mark.parametrize("out_of_band", [False, True])
def test_a_response_the_client_asks_for_aborts_units_still_deciding_and_their_output_is_stale(out_of_band):
    # response.create while units decide: a unit's answer would be for a turn that has begun.
    # Before, they stayed in flight: a unit that spoke had its words streamed into the asked
    # response, its end was refused as an illegal output (and logged as the engine's fault), and
    # it held the lease (idle expiry never came) and its audio in the budget until the close.
    core, unit = _native_core_with_unit_in_flight()
    core.handle(cmd.CreateResponse(out_of_band=out_of_band))
    _fenced_off_then_the_turn_answers(core, unit)


def test_turning_model_native_off_aborts_units_still_deciding():
    # Before, a unit that then spoke was refused as an illegal output (logged as the engine's
    # fault) and its end reported to the client as a "listen" decision.
    core, unit = _native_core_with_unit_in_flight()
    core.handle(cmd.UpdateSession(model_native=False))
    aborts = [a for a in core.take_actions() if isinstance(a, AbortRequests)]
    assert aborts and aborts[0].request_ids == (unit,)
    assert core.lease.in_flight == 0 and not core.in_flight_requests
    core.take_events()
    core.on_engine_output(Decision(unit, True))
    core.on_engine_output(TextDelta(unit, "unit words"))
    core.on_engine_output(TurnDone(unit))
    assert core.counters.invalid_outputs == 0 and core.take_events() == []
    assert core.state == "listening" and not core.aborting_requests
