"""Leases through the Runtime: idle TTL, disconnect grace, the reaper, detach/resume with CAS
and a rotating token, idempotent replays, the bounded replay journal, clock jumps."""

from __future__ import annotations

import anyio
import pytest

from duplex_actors import ManualClock, Runtime, Script, ScriptedEngine
from duplex_actors.core import commands as cmd
from duplex_actors.errors import ResumeConflict, ResyncRequired, UnknownSession

from .conftest import CHUNK, Reader, audit, settle, turn

pytestmark = pytest.mark.anyio


def manual_runtime(script: Script = Script(), **kw) -> tuple[Runtime, ManualClock]:
    clock = ManualClock(1000.0)
    return Runtime(ScriptedEngine(script), clock=clock, reaper_interval_s=0, **kw), clock


async def test_idle_ttl_expires_with_reason_and_frees_the_slot():
    rt, clock = manual_runtime()
    async with rt:
        s = await rt.open_session(idle_ttl_s=10.0)
        r = Reader(s)
        await r.until_type("session.created")
        clock.advance(9.99)
        assert rt.reap_now() == 0
        clock.advance(0.01)
        assert rt.reap_now() == 1
        await r.drain()
        closed = r.of_type("session.closed")
        assert [e.reason for e in closed] == ["idle_ttl_expired"]
        audit(r.events)
        assert rt.session_count == 0
        assert rt.reap_now() == 0  # an expired session is not expired twice


async def test_every_activity_touches_the_lease():
    rt, clock = manual_runtime()
    async with rt:
        s = await rt.open_session(idle_ttl_s=10.0)
        r = Reader(s)
        for activity in ("append", "heartbeat", "playback", "turn"):
            clock.advance(9.0)
            if activity == "append":
                s.append_audio(CHUNK)
                await s.clear()
            elif activity == "heartbeat":
                await s.heartbeat()
            elif activity == "playback":
                await s.acknowledge_playback("resp_x", 10)
            else:
                await turn(s, r)
            clock.advance(9.0)
            assert rt.reap_now() == 0, f"{activity} did not touch the lease"
        clock.advance(1.0)
        assert rt.reap_now() == 1
        await r.drain()
        audit(r.events)


async def test_in_flight_turn_blocks_idle_expiry_then_expires_after_it_ends():
    rt, clock = manual_runtime(Script(first_latency_s=0.2))
    async with rt:
        s = await rt.open_session(idle_ttl_s=5.0)
        r = Reader(s)
        s.append_audio(CHUNK * 5)
        await s.commit()
        clock.advance(3600.0)  # an hour "passes" while the engine works on the turn
        assert rt.reap_now() == 0
        assert s.state == "responding"
        done = await r.until_type("response.done")
        assert done.status == "completed"
        assert rt.reap_now() == 0  # model output touched the lease
        clock.advance(5.0)
        assert rt.reap_now() == 1
        await r.drain()
        assert r.of_type("session.closed")[0].reason == "idle_ttl_expired"
        audit(r.events)
        await settle(rt)


async def test_disconnect_grace_expires_even_with_a_turn_in_flight():
    rt, clock = manual_runtime(Script(hang_after=2))
    async with rt:
        s = await rt.open_session(disconnect_grace_s=30.0)
        r = Reader(s)
        s.append_audio(CHUNK * 5)
        await s.commit()
        await r.until_type("response.output_text.delta")
        await s.detach()
        clock.advance(29.0)
        assert rt.reap_now() == 0
        clock.advance(1.0)
        assert rt.reap_now() == 1
        await r.drain()
        assert r.of_type("session.closed")[0].reason == "disconnect_grace_expired"
        done = r.of_type("response.done")
        assert len(done) == 1 and done[0].status == "cancelled"
        audit(r.events)
        await settle(rt)  # the hung request was aborted, not leaked


async def test_resume_is_a_cas_with_a_rotating_token_and_replays_missed_events():
    rt, clock = manual_runtime()
    async with rt:
        s = await rt.open_session()
        r = Reader(s)
        await turn(s, r)
        seen = r.events[3].seq  # the client really received only the first three events
        gen, token = s.generation, s.resume_token
        await s.detach()
        clock.advance(10.0)
        s2 = await rt.resume(s.id, gen, token, last_seq=seen, control_id="c1")
        assert s2.generation == gen + 1 and s2.resume_token != token
        resumed = await r.until_type("session.resumed")
        # The reader already had everything; a reconnecting client gets the journal replayed.
        replayed = [e for e in r.events if e.seq > seen and e.type != "session.resumed"]
        assert resumed.replayed > 0
        # Stale generation, wrong token: typed conflicts that change nothing.
        with pytest.raises(ResumeConflict):
            await rt.resume(s.id, gen, token, last_seq=seen)
        with pytest.raises(ResumeConflict):
            await rt.resume(s.id, gen + 1, "not-the-token", last_seq=seen)
        assert (s.generation, s.resume_token) == (gen + 1, s2.resume_token)
        assert not s.core.lease.detached
        clock.advance(60.0)
        assert rt.reap_now() == 0  # resumed: the disconnect grace no longer runs
        await s.close()
        events = await r.drain()
        # The replay re-sends journaled events (seq <= the last one the reader had); the rest
        # of the stream is contiguous.
        fresh, last = [], 0
        for e in events:
            if e.seq > last:
                fresh.append(e)
                last = e.seq
        audit(fresh)
        assert replayed


async def test_replayed_resume_with_same_control_id_is_idempotent_and_late_one_conflicts():
    rt, clock = manual_runtime()
    async with rt:
        s = await rt.open_session()
        r = Reader(s)
        await r.until_type("session.created")
        gen, token = s.generation, s.resume_token
        await s.detach()
        await rt.resume(s.id, gen, token, last_seq=1, control_id="ctl-1")
        answer = (s.generation, s.resume_token)
        # The client lost the reply and sends the very same resume again: same answer.
        await rt.resume(s.id, gen, token, last_seq=1, control_id="ctl-1")
        assert (s.generation, s.resume_token) == answer == (gen + 1, answer[1])
        # A second, different resume moves the lease on ...
        await s.detach()
        await rt.resume(s.id, *answer, last_seq=1, control_id="ctl-2")
        assert s.generation == gen + 2
        # ... after which a late duplicate of the first is a typed conflict, not a takeover.
        with pytest.raises(ResumeConflict):
            await rt.resume(s.id, gen, token, last_seq=1, control_id="ctl-1")
        assert s.generation == gen + 2
        await s.close()
        await r.drain()
        assert len(r.of_type("session.resumed")) == 3


async def test_a_replayed_control_id_with_other_credentials_is_a_conflict_not_a_takeover():
    rt, clock = manual_runtime()
    async with rt:
        s = await rt.open_session()
        r = Reader(s)
        await r.until_type("session.created")
        gen, token = s.generation, s.resume_token
        await s.detach()
        await rt.resume(s.id, gen, token, last_seq=1, control_id="ctl-1")
        answer = (s.generation, s.resume_token)
        await s.detach()
        # Idempotency never skips authentication: the control_id alone answers nothing.
        for forged_gen, forged_token in ((gen, "forged"), (answer[0], "forged"), (gen + 7, token)):
            with pytest.raises(ResumeConflict):
                await rt.resume(s.id, forged_gen, forged_token, last_seq=1, control_id="ctl-1")
        assert (s.generation, s.resume_token) == answer and s.core.lease.detached
        # The genuine retry (same credentials as the original) still gets the same answer.
        await rt.resume(s.id, gen, token, last_seq=1, control_id="ctl-1")
        assert (s.generation, s.resume_token) == answer and not s.core.lease.detached
        await s.close()
        await r.drain()
        assert len(r.of_type("session.resumed")) == 2


async def test_an_expiry_decided_before_a_queued_resume_does_not_close_the_resumed_session():
    # Found by the 500-client wire soak: the reaper saw the grace run out while the client's
    # resume was already queued; the resume went through, then the stale expiry closed the
    # session under the client (session.resumed followed by session.closed).
    rt, clock = manual_runtime()
    async with rt:
        s = await rt.open_session(disconnect_grace_s=5.0)
        r = Reader(s)
        await r.until_type("session.created")
        gen, token = s.generation, s.resume_token
        await s.detach()
        clock.advance(6.0)
        s.tell(cmd.Resume(generation=gen, resume_token=token, last_seq=1))  # queued first ...
        assert rt.reap_now() == 1  # ... then the reaper, which still sees it detached
        await r.until_type("session.resumed")
        await anyio.sleep(0.05)
        assert s.state != "closed" and not s.core.lease.detached
        await s.heartbeat()  # and it still takes commands
        # A session that really stays away is still expired later.
        await s.detach()
        clock.advance(6.0)
        assert rt.reap_now() == 1
        await r.until_type("session.closed")
        assert s.core.close_reason == "disconnect_grace_expired"


async def test_journal_overflow_answers_resync_required_and_changes_nothing():
    rt, clock = manual_runtime()
    async with rt:
        s = await rt.open_session(journal_max_events=8)
        r = Reader(s)
        await turn(s, r)  # well over 8 events
        await s.detach()
        gen, token = s.generation, s.resume_token
        with pytest.raises(ResyncRequired):
            await rt.resume(s.id, gen, token, last_seq=1)
        assert (s.generation, s.resume_token) == (gen, token)
        assert s.core.lease.detached
        # Still inside what the journal holds: fine.
        await rt.resume(s.id, gen, token, last_seq=r.events[-1].seq - 3)
        await s.close()
        await r.drain()


async def test_journal_age_limit_answers_resync_required():
    rt, clock = manual_runtime()
    async with rt:
        s = await rt.open_session(journal_max_age_s=60.0)
        r = Reader(s)
        await turn(s, r)
        await s.detach()
        clock.advance(61.0)
        with pytest.raises(ResyncRequired):
            await rt.resume(s.id, s.generation, s.resume_token, last_seq=1)
        # Nothing missed at all: no replay needed, so no resync either.
        await rt.resume(s.id, s.generation, s.resume_token, last_seq=r.events[-1].seq)
        await s.close()
        await r.drain()


async def test_resume_after_expiry_is_unknown_session():
    rt, clock = manual_runtime()
    async with rt:
        s = await rt.open_session(disconnect_grace_s=5.0)
        r = Reader(s)
        gen, token = s.generation, s.resume_token
        await s.detach()
        clock.advance(5.0)
        rt.reap_now()
        await r.drain()
        with pytest.raises(UnknownSession):
            await rt.resume(s.id, gen, token)


async def test_cancelled_resume_is_processed_once_and_its_retry_is_idempotent():
    rt, clock = manual_runtime()
    async with rt:
        s = await rt.open_session()
        r = Reader(s)
        await r.until_type("session.created")
        gen, token = s.generation, s.resume_token
        await s.detach()
        with anyio.CancelScope() as scope:
            scope.cancel()  # the caller gives up at the first await inside resume
            await rt.resume(s.id, gen, token, last_seq=1, control_id="retry-me")
        await r.until_type("session.resumed")
        assert s.generation == gen + 1  # processed exactly once, not lost
        await rt.resume(s.id, gen, token, last_seq=1, control_id="retry-me")
        assert s.generation == gen + 1  # the retry is not a second resume
        await s.close()
        await r.drain()
        # Two answers (the retry re-sends the journal after last_seq=1, so the first answer
        # arrives again with its old seq: clients drop seq <= the highest seen).
        assert len({e.seq for e in r.of_type("session.resumed")}) == 2


async def test_reaper_task_expires_sessions_on_its_own():
    async with Runtime(ScriptedEngine(), reaper_interval_s=0.02) as rt:
        s = await rt.open_session(idle_ttl_s=0.05)
        keep = await rt.open_session(idle_ttl_s=60.0)
        r = Reader(s)
        await r.drain(timeout=2.0)
        assert r.of_type("session.closed")[0].reason == "idle_ttl_expired"
        assert rt.session_count == 1 and keep.state == "idle"


async def test_clock_jump_expires_each_session_once_with_its_reason():
    rt, clock = manual_runtime(Script(first_latency_s=0.3))
    async with rt:
        idle = [await rt.open_session(idle_ttl_s=300.0) for _ in range(20)]
        detached = [await rt.open_session(disconnect_grace_s=30.0) for _ in range(20)]
        busy = [await rt.open_session(idle_ttl_s=300.0) for _ in range(5)]
        for s in detached:
            await s.detach()
        for s in busy:
            s.append_audio(CHUNK * 5)
            await s.commit()
        clock.advance(10**6)
        assert rt.reap_now() == 40
        assert rt.reap_now() == 0  # an expire already queued is not queued again
        readers = {s.id: Reader(s) for s in idle + detached}
        for rd in readers.values():
            await rd.drain()
            audit(rd.events)
        assert {rd.of_type("session.closed")[0].reason for s, rd in readers.items() if rt_id_in(s, idle)} == {
            "idle_ttl_expired"
        }
        assert {
            rd.of_type("session.closed")[0].reason for s, rd in readers.items() if rt_id_in(s, detached)
        } == {"disconnect_grace_expired"}
        for s in busy:
            rd = Reader(s)
            assert (await rd.until_type("response.done")).status == "completed"
        assert rt.session_count == 5
        await settle(rt)


def rt_id_in(session_id, handles) -> bool:
    return any(h.id == session_id for h in handles)


async def test_reaper_does_not_crash_when_a_control_lane_is_full():
    rt, clock = manual_runtime(mailbox_capacity=4)
    async with rt:
        s = await rt.open_session(idle_ttl_s=1.0)
        other = await rt.open_session(idle_ttl_s=100.0)
        for _ in range(4):  # fill the control lane; the dispatcher has not run yet
            s.tell(cmd.Heartbeat())
        clock.advance(2.0)
        rt.reap_now()  # must not raise MailboxFull into the reaper
        await anyio.sleep(0.05)
        # The queued heartbeats ran before the expiry and renewed the lease, so that expiry was
        # dropped when it came to run; the next pass after another idle TTL expires it.
        clock.advance(2.0)
        rt.reap_now()
        r = Reader(s)
        await r.drain()
        audit(r.events)
        assert s.core.close_reason == "idle_ttl_expired" and rt.session_count == 1
        assert other.state == "idle"


async def test_superseded_model_native_units_do_not_pin_the_lease_forever():
    """Model-native mode: several units in flight, the first decides to speak, the others are
    aborted as superseded. None of them may keep counting as in flight once the turn ended,
    or the session could never idle-expire (a leaked slot)."""
    rt, clock = manual_runtime(Script(first_latency_s=0.02))
    async with rt:
        s = await rt.open_session(model_native=True, unit_samples=1600, idle_ttl_s=10.0)
        r = Reader(s)
        s.append_audio(b"\x01\x00" * 1600 * 3)  # three units at once
        await r.until_type("response.done")
        await settle(rt)
        assert s.core.lease.in_flight == 0
        clock.advance(10.0)
        assert rt.reap_now() == 1
        await r.drain()
        assert r.of_type("session.closed")[0].reason == "idle_ttl_expired"
