"""Decisions that used to be taken beside the chart are rows of it: the overlap policy's
barge-in, expiry and failure of a closed session. And every trigger declares who raises it."""

import pytest

from duplex_actors.core import commands as cmd
from duplex_actors.core.statechart import (
    CANCEL_RESPONSE,
    CHART,
    CLIENT_TRIGGERS,
    ENGINE_TRIGGERS,
    SELF_TRIGGERS,
    TRIGGER_ORIGINS,
    TRIGGERS,
    Origin,
)

from .helpers import RecordingChart, core_in, snapshot

SPEECH = b"\x03\x00" * 1600  # 100 ms


def test_every_trigger_has_exactly_one_declared_origin():
    assert set(TRIGGER_ORIGINS) == set(TRIGGERS)
    assert set(TRIGGERS) == CLIENT_TRIGGERS | ENGINE_TRIGGERS | SELF_TRIGGERS
    assert not (
        CLIENT_TRIGGERS & ENGINE_TRIGGERS
        or CLIENT_TRIGGERS & SELF_TRIGGERS
        or ENGINE_TRIGGERS & SELF_TRIGGERS
    )
    assert all(isinstance(origin, Origin) for origin in TRIGGER_ORIGINS.values())


def test_client_triggers_are_exactly_the_commands_triggers():
    commands = {
        c.TRIGGER for c in vars(cmd).values() if isinstance(c, type) and getattr(c, "TRIGGER", "")
    }  # the base Command has ""
    assert commands == CLIENT_TRIGGERS


def test_the_overlap_policy_barges_in_through_the_chart():
    core = core_in("responding_begun", min_interruption_ms=250)
    recorder = RecordingChart()
    core.chart = recorder
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.handle(cmd.AppendAudio(pcm=SPEECH))  # 100 ms: could still be a backchannel
    core.handle(cmd.AppendAudio(pcm=SPEECH))  # 200 ms
    assert core.state == "responding"
    core.handle(cmd.AppendAudio(pcm=SPEECH))  # 300 ms: the policy calls it a barge-in
    assert core.state == "barge_in"
    overlap_steps = [step for step in recorder.steps if step[1] == "overlap"]
    assert overlap_steps == [("responding", "overlap", "responding")] * 2 + [
        ("responding", "overlap", "barge_in")
    ]
    assert ("responding", "barge_in", "barge_in") not in recorder.steps
    done = [e for e in core.take_events() if e.type == "response.done"]
    assert [(e.status, e.reason) for e in done] == [("cancelled", "turn_detected")]


def test_the_overlap_row_cancels_exactly_as_a_barge_in_does():
    (barge,) = [b for b in CHART.table[("responding", "overlap")] if b.dest == "barge_in"]
    assert barge.effects == tuple(CANCEL_RESPONSE)
    assert barge.guards == (("interrupt_response", True), ("overlap_is_interruption", True))


@pytest.mark.parametrize("trigger", ["expire", "fail"])
def test_expiring_or_failing_a_closed_session_is_a_chart_row_that_changes_nothing(trigger):
    assert [b.dest for b in CHART.table[("closed", trigger)]] == ["closed"]
    core = core_in("closed")
    before = snapshot(core)
    core.expire() if trigger == "expire" else core.fail("session_failed")
    assert snapshot(core) == before and core.take_events() == [] and core.take_actions() == []


def test_a_client_that_stops_reading_is_closed_by_the_chart_not_by_the_shell():
    core = core_in("idle", outbox_capacity=20, outbox_reserve=4)
    recorder = RecordingChart()
    core.chart = recorder
    for _ in range(40):  # each heartbeat is acknowledged with one event nobody reads
        if core.closed:
            break
        core.handle(cmd.Heartbeat())
    assert core.closed and core.close_reason == "slow_consumer"
    assert recorder.steps[-1] == ("idle", "outbox_overflow", "closed")
    events = core.take_events()
    assert events[-1].type == "session.closed" and events[-1].reason == "slow_consumer"


def test_every_aborted_requests_end_is_settled_by_the_chart():
    from duplex_actors.core.engine_io import Decision

    core = core_in("idle", model_native=True, unit_samples=1600)
    core.handle(cmd.AppendAudio(pcm=SPEECH))
    core.handle(cmd.AppendAudio(pcm=SPEECH))
    u1, u2 = (a.request.request_id for a in core.take_actions())
    core.on_engine_output(Decision(u2, True))  # u2 speaks; u1 is superseded and aborted
    core.handle(cmd.BargeIn())  # u2 is aborted too
    recorder = RecordingChart()
    core.chart = recorder
    core.on_engine_output(Decision(u1, False))  # u1 ends: one abort still outstanding
    assert ("barge_in", "abort_confirmed", "barge_in") in recorder.steps
    assert core.aborting_requests == {u2}
    core.on_engine_output(Decision(u2, False))  # the last one: barge_in is left
    assert recorder.steps[-1][1:] == ("abort_confirmed", "idle")
    assert not core.aborting_requests
    for branches in (CHART.table[(s, "abort_confirmed")] for s in ("idle", "barge_in", "closed")):
        assert all(b.effects == ("settle_abort",) for b in branches)
