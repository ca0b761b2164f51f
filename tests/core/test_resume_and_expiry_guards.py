"""Resume checks, stale expiry and the append checks are guards of the chart, each refused
with its own typed error, in one place (core/statechart.py), and every refusal changes nothing.

These used to be decided beside the chart: the lease and the resume effect raised (the
journal check ran before the credentials), the actor shell dropped a stale expiry, and the
server re-checked the API key, the credentials of a takeover and the sample rate itself."""

from __future__ import annotations

import attrs
import pytest

from duplex_actors.core import commands as cmd
from duplex_actors.core.clock import ManualClock
from duplex_actors.core.session import SessionConfig, SessionCore
from duplex_actors.core.statechart import CHART, CHECKS, FENCE_CHECKS
from duplex_actors.errors import (
    Backpressure,
    InvalidCommand,
    ResumeConflict,
    ResyncRequired,
    SessionClosed,
    UnknownSession,
)

from .helpers import OWNER, RecordingChart, resume, snapshot


def lease_of(core: SessionCore) -> tuple:
    lease = core.lease
    return (lease.generation, lease.token, lease.detached_at, lease.last_activity, core.journaled_events)


def detached_core(**config) -> tuple[SessionCore, ManualClock]:
    clock = ManualClock(100.0)
    core = SessionCore("sess_guards", SessionConfig(**config), clock, owner=OWNER)
    for _ in range(5):
        core.handle(cmd.Heartbeat())
    core.take_events()  # the client read session.created and five acks: seqs 1..6, journaled
    core.handle(cmd.Detach())
    return core, clock


# --- the chart declares them ------------------------------------------------------------------


def test_the_resume_rows_carry_the_checks_in_authentication_first_order():
    replay, cas = CHART.table[("idle", "resume")]
    # The fence comes first, as for every command (statechart.PRECONDITIONS).
    assert [name for name, _ in replay.guards] == [
        *FENCE_CHECKS,
        "resume_key_matches",
        "replays_last_resume",
        "journal_holds_last_seq",
    ]
    assert [name for name, _ in cas.guards] == [
        *FENCE_CHECKS,
        "resume_key_matches",
        "resume_generation_current",
        "resume_token_matches",
        "journal_holds_last_seq",
    ]
    assert CHECKS["resume_key_matches"].error is UnknownSession  # as an id nobody opened
    assert CHECKS["resume_generation_current"].error is ResumeConflict
    assert CHECKS["journal_holds_last_seq"].error is ResyncRequired
    assert CHECKS["audio_at_session_rate"].error is InvalidCommand


def test_expire_is_guarded_by_the_lease_and_otherwise_changes_nothing():
    expire, stale = CHART.table[("listening", "expire")]
    assert expire.guards == (("lease_expired", True),) and expire.dest == "closed"
    assert stale.guards == () and stale.dest == "listening" and stale.effects == ()


# --- resume ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"generation": 1}, ResumeConflict, "lease generation"),
        ({"resume_token": "forged"}, ResumeConflict, "token"),
        # Past ASCII: compare_digest raised TypeError inside the chart's guard (hypothesis met it).
        ({"resume_token": "\x80"}, ResumeConflict, "token"),
        ({"resume_token": "jeton-\u00e9t\u00e9"}, ResumeConflict, "token"),
        ({"key_digest": b"digest of key-b"}, UnknownSession, "no open session"),
        ({"key_digest": None}, UnknownSession, "no open session"),
    ],
)
def test_each_resume_check_is_refused_with_its_own_error_and_changes_nothing(change, error, message):
    core, _ = detached_core()
    before, lease = snapshot(core), lease_of(core)
    with pytest.raises(error, match=message):
        core.handle(resume(core, **change))
    assert snapshot(core) == before and lease_of(core) == lease


def test_a_journal_gap_is_resync_required_only_for_a_client_that_authenticated():
    core, clock = detached_core(journal_max_age_s=5.0)
    clock.advance(6.0)  # the journaled events aged out
    lease = lease_of(core)
    with pytest.raises(ResyncRequired):
        core.handle(resume(core, last_seq=1))
    # Wrong credentials learn nothing about the journal: the credentials are checked first.
    with pytest.raises(ResumeConflict):
        core.handle(resume(core, last_seq=1, resume_token="forged"))
    with pytest.raises(UnknownSession):
        core.handle(resume(core, last_seq=1, key_digest=b"other"))
    assert lease_of(core) == lease  # the refused resumes did not even age the journal out
    core.handle(resume(core))  # nothing missed: accepted
    assert core.lease.generation == 1 and not core.lease.detached


def test_a_closed_session_refuses_resume_with_session_closed():
    core, _ = detached_core()
    core.handle(cmd.Close())
    with pytest.raises(SessionClosed):
        core.handle(resume(core))


def test_a_replay_answers_again_until_the_client_acts_then_only_the_current_credentials_do():
    core, _ = detached_core()
    first = resume(core, control_id="ctl-1")
    core.handle(first)
    answer = (core.lease.generation, core.lease.token)
    # Its answer was lost (whether or not the server has noticed that the connection it went
    # out on broke): the same answer again, as often as asked.
    core.handle(first)
    core.handle(first)
    assert (core.lease.generation, core.lease.token) == answer
    # The client acts on its connection: it has the answer, and the replay no longer holds ...
    core.handle(cmd.Heartbeat())
    with pytest.raises(ResumeConflict):
        core.handle(first)
    assert (core.lease.generation, core.lease.token) == answer
    # ... the current credentials do (and rotate the token).
    core.handle(resume(core))
    assert core.lease.generation == answer[0] + 1 and core.lease.token != answer[1]


def test_a_replayed_control_id_with_other_credentials_is_refused():
    core, _ = detached_core()
    first = resume(core, control_id="ctl-1")
    core.handle(first)
    core.handle(cmd.Detach())
    lease = lease_of(core)
    for forged in ({"resume_token": "forged"}, {"generation": 7}, {"key_digest": b"other"}):
        with pytest.raises(UnknownSession if "key_digest" in forged else ResumeConflict):
            core.handle(attrs.evolve(first, **forged))
    assert lease_of(core) == lease


def test_check_answers_as_handle_would_and_changes_nothing():
    core, _ = detached_core()
    before, lease = snapshot(core), lease_of(core)
    with pytest.raises(ResumeConflict):
        core.check(resume(core, resume_token="forged", event_id="e1"))
    core.check(resume(core))  # accepted: no error, and still nothing changed
    assert snapshot(core) == before and lease_of(core) == lease
    core.handle(resume(core))
    assert core.lease.generation == 1


# --- expiry ---------------------------------------------------------------------------------


def test_a_stale_expiry_is_decided_by_the_chart_and_changes_nothing():
    core, clock = detached_core(disconnect_grace_s=5.0)
    clock.advance(6.0)
    reaper_saw = core.lease.expiry(clock.now())
    assert reaper_saw == "disconnect_grace_expired"
    core.handle(resume(core))  # queued ahead of the expiry: the lease is renewed
    recorder = RecordingChart()
    core.chart = recorder
    before = snapshot(core)
    core.expire()
    assert recorder.steps == [("idle", "expire", "idle")]
    assert snapshot(core) == before and not core.closed


def test_an_expiry_the_lease_supports_closes_with_the_lease_s_reason():
    core, clock = detached_core(disconnect_grace_s=5.0, idle_ttl_s=3.0)
    clock.advance(5.0)
    core.expire()
    assert core.closed and core.close_reason == "disconnect_grace_expired"
    events = core.take_events()
    assert events[-1].type == "session.closed" and events[-1].reason == "disconnect_grace_expired"


# --- append ---------------------------------------------------------------------------------


def test_audio_at_another_rate_and_audio_that_does_not_fit_are_chart_refusals():
    core = SessionCore("sess_append", SessionConfig(max_input_bytes=640), ManualClock(0.0))
    recorder = RecordingChart()
    core.chart = recorder
    before = snapshot(core)
    with pytest.raises(InvalidCommand):
        core.handle(cmd.AppendAudio(pcm=b"\x01\x00" * 1000, sample_rate=8000))  # both wrong: rate first
    with pytest.raises(Backpressure):
        core.handle(cmd.AppendAudio(pcm=b"\x01\x00" * 1000))
    assert snapshot(core) == before and recorder.steps == []
    core.handle(cmd.AppendAudio(pcm=b"\x01\x00" * 320))
    assert recorder.steps == [("idle", "append", "listening")]
