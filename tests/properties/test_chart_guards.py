"""One property per check the chart makes for resume, expiry and append: whatever the drawn
inputs, a refused trigger is refused with the check's own error and changes nothing, and an
accepted one does exactly what the chart's row says. (The kit's SessionCoreMachine drives
the same guards inside whole conversations, against the reference model.)"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from duplex_actors.core import commands as cmd
from duplex_actors.core.clock import ManualClock
from duplex_actors.core.session import SessionConfig, SessionCore
from duplex_actors.errors import DuplexError, InvalidCommand, ResumeConflict, ResyncRequired, UnknownSession

OWNER = b"owner digest"


def lease_state(core: SessionCore) -> tuple:
    lease = core.lease
    return (
        core.state,
        lease.generation,
        lease.token,
        lease.detached_at,
        lease.last_activity,
        core.journaled_events,
        core.pending_events,
        core.last_seq,
    )


def session(resumes: int = 0) -> tuple[SessionCore, ManualClock, list[tuple[str, int, str]]]:
    """A detached session that was resumed ``resumes`` times, each with a control_id; returns
    the (control_id, generation, token) each of those resumes presented."""
    clock = ManualClock(50.0)
    core = SessionCore("sess_props", SessionConfig(), clock, owner=OWNER)
    core.take_events()
    presented = []
    for n in range(resumes):
        core.handle(cmd.Detach())
        ctl, gen, token = f"ctl-{n}", core.lease.generation, core.lease.token
        core.handle(
            cmd.Resume(
                generation=gen, resume_token=token, last_seq=core.last_seq, control_id=ctl, key_digest=OWNER
            )
        )
        presented.append((ctl, gen, token))
        core.take_events()
    core.handle(cmd.Detach())
    return core, clock, presented


@given(resumes=st.integers(0, 3), offset=st.integers(-3, 3).filter(bool), key=st.sampled_from([OWNER, None]))
def test_a_resume_naming_another_generation_never_changes_the_lease(resumes, offset, key):
    core, _, _ = session(resumes)
    before = lease_state(core)
    try:
        core.handle(
            cmd.Resume(
                generation=core.lease.generation + offset,
                resume_token=core.lease.token,
                last_seq=core.last_seq,
                key_digest=key,
            )
        )
    except (ResumeConflict, UnknownSession):  # another key: as an id nobody opened
        pass
    else:
        raise AssertionError("a stale generation was accepted")
    assert lease_state(core) == before


@given(
    resumes=st.integers(1, 3),
    which=st.integers(0, 2),
    forged=st.sampled_from(["token", "generation", "key"]),
)
def test_a_replayed_control_id_with_other_credentials_is_refused(resumes, which, forged):
    core, _, presented = session(resumes)
    ctl, gen, token = presented[min(which, resumes - 1)]
    fields = {"generation": gen, "resume_token": token, "key_digest": OWNER}
    if forged == "token":
        fields["resume_token"] = token + "x"
    elif forged == "generation":
        fields["generation"] = gen + 5
    else:
        fields["key_digest"] = b"another key"
    before = lease_state(core)
    try:
        core.handle(cmd.Resume(last_seq=core.last_seq, control_id=ctl, **fields))
    except (ResumeConflict, UnknownSession):  # another key: as an id nobody opened
        pass
    else:
        raise AssertionError(f"{forged}: a replay with other credentials was answered")
    assert lease_state(core) == before


@given(age=st.floats(0.0, 200.0), wrong_token=st.booleans(), missed=st.sampled_from(["all", "some", "none"]))
def test_only_an_authenticated_resume_learns_of_a_journal_gap(age, wrong_token, missed):
    core, clock, _ = session(0)
    for _ in range(4):
        core.handle(cmd.Heartbeat())
    core.take_events()  # journaled now
    clock.advance(age)
    last_seq = {"all": 0, "some": core.last_seq - 2, "none": core.last_seq}[missed]
    gap = missed != "none" and age > core.config.journal_max_age_s
    before = lease_state(core)
    command = cmd.Resume(
        generation=core.lease.generation,
        resume_token=core.lease.token + ("x" if wrong_token else ""),
        last_seq=last_seq,
        key_digest=OWNER,
    )
    error = None
    try:
        core.handle(command)
    except DuplexError as err:
        error = type(err)
    if wrong_token:
        assert error is ResumeConflict
    elif gap:
        assert error is ResyncRequired
    else:
        assert error is None and core.lease.generation == 1
        return
    assert lease_state(core) == before


@given(
    idle=st.floats(0.0, 100.0),
    detached_for=st.none() | st.floats(0.0, 100.0),
    resumed_since=st.booleans(),
)
def test_an_expiry_closes_only_a_lease_that_has_run_out(idle, detached_for, resumed_since):
    clock = ManualClock(10.0)
    core = SessionCore("sess_expiry", SessionConfig(idle_ttl_s=60.0, disconnect_grace_s=20.0), clock)
    core.take_events()
    clock.advance(idle)
    if detached_for is not None:
        core.handle(cmd.Detach())
        clock.advance(detached_for)
        if resumed_since:
            core.handle(cmd.Resume(generation=0, resume_token=core.lease.token, last_seq=core.last_seq))
    expected = core.lease.expiry(clock.now())
    before = lease_state(core)
    core.expire()
    if expected is None:
        assert lease_state(core) == before and not core.closed
    else:
        assert core.closed and core.close_reason == expected


@given(rate=st.sampled_from([8000, 16000, 24000, 44100, 48000]), state=st.sampled_from(["idle", "listening"]))
def test_audio_at_another_rate_is_refused_in_every_open_state_and_changes_nothing(rate, state):
    core = SessionCore("sess_rate", SessionConfig(), ManualClock(0.0))
    if state == "listening":
        core.handle(cmd.AppendAudio(pcm=b"\x01\x00" * 160))
    core.take_events()
    before = (lease_state(core), core.buffered_input_bytes)
    try:
        core.handle(cmd.AppendAudio(pcm=b"\x01\x00" * 160, sample_rate=rate))
    except InvalidCommand:
        assert rate != 16000
        assert (lease_state(core), core.buffered_input_bytes) == before
    else:
        assert rate == 16000
