"""The testing kit's smaller pieces: fixtures, profiles, strategies and the stream checker."""

from __future__ import annotations

import struct

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors import ManualClock, ScriptedEngine, SessionCore
from duplex_actors.core import events as ev
from duplex_actors.errors import StaleFence
from duplex_actors.testing import (
    EventStreamChecker,
    FenceChoice,
    FencedCommand,
    command_programs,
    engine_scripts,
    pcm16_chunks,
)


def test_duplex_runtime_fixture_runs_a_turn(duplex_runtime, scripted_engine):
    session = duplex_runtime.open_session()
    session.append_audio(b"\0\0" * 3200)
    duplex_runtime.call(session.commit)

    async def until_done():
        seen = []
        with anyio.fail_after(5):
            async for event in session.events():
                seen.append(event.type)
                if event.type == "response.done":
                    return seen

    seen = duplex_runtime.call(until_done)
    assert seen[0] == "session.created" and "response.created" in seen
    assert [r.request_id for r in scripted_engine.submitted] == [f"{session.id}/e0/t0"]


def test_manual_clock_fixture(manual_clock):
    assert isinstance(manual_clock, ManualClock) and manual_clock.now() == 0.0
    assert manual_clock.advance(0.5) == 0.5


def test_scripted_engine_fixture(scripted_engine):
    assert isinstance(scripted_engine, ScriptedEngine) and scripted_engine.submitted == []


def test_profiles_are_registered():
    for name, examples in (("ci", 200), ("dev", 1000)):
        profile = settings.get_profile(name)
        assert profile.max_examples == examples and profile.deadline is None


@given(pcm16_chunks())
def test_chunks_are_20_to_200_ms_of_pcm16(chunk):
    samples = len(chunk) // 2
    assert len(chunk) % 2 == 0 and 320 <= samples <= 3200
    struct.unpack(f"<{samples}h", chunk)  # well-formed little-endian int16


@given(command_programs(min_size=1, max_size=10), st.integers(0, 5))
def test_program_steps_bind_to_the_live_epoch(program, epoch):
    for step in program:
        command = step.bind(epoch)
        if step.fence is FenceChoice.NONE:
            assert command.epoch is None
        elif step.fence is FenceChoice.CURRENT:
            assert command.epoch == epoch
        elif step.fence is FenceChoice.STALE:
            assert command.epoch == max(epoch - step.stale_by, 0)


@given(st.integers(1, 4))
def test_a_stale_fenced_step_is_refused(cancels):
    core = SessionCore("sess_kit", clock=ManualClock())
    core.epoch = cancels  # as if that many responses had been cancelled
    stale = FencedCommand("heartbeat", FenceChoice.STALE)
    with pytest.raises(StaleFence):
        core.handle(stale.bind(core.epoch))


@given(engine_scripts())
def test_engine_scripts_are_valid_scripts(script):
    assert script.fail_mode in ("output", "raise")
    assert all(x >= 0 for x in (script.first_latency_s, script.token_latency_s, script.packet_latency_s))


def _event(cls, seq, epoch=0, **kw):
    return cls(seq=seq, epoch=epoch, session_id="sess_x", **kw)


def test_stream_checker_catches_a_delta_after_done():
    checker = EventStreamChecker()
    checker.feed(
        [
            _event(ev.ResponseCreated, 1, response_id="r1", turn_id=0),
            _event(ev.ResponseDone, 2, response_id="r1", status="completed", turn_id=0),
        ]
    )
    with pytest.raises(AssertionError, match="after its response.done"):
        checker.check(_event(ev.TextDeltaEvent, 3, response_id="r1", delta="late"))


def test_stream_checker_catches_an_old_epoch_after_cancel():
    checker = EventStreamChecker()
    checker.feed(
        [
            _event(ev.ResponseCreated, 1, response_id="r1", turn_id=0),
            _event(ev.ResponseDone, 2, response_id="r1", status="cancelled", turn_id=0),
        ]
    )
    with pytest.raises(AssertionError, match="after that epoch's response was cancelled"):
        checker.check(_event(ev.HeartbeatAck, 3, epoch=0))


def test_stream_checker_catches_two_active_responses_and_unfinished_close():
    checker = EventStreamChecker()
    checker.check(_event(ev.ResponseCreated, 1, response_id="r1", turn_id=0))
    with pytest.raises(AssertionError, match="while r1 is active"):
        checker.check(_event(ev.ResponseCreated, 2, response_id="r2", turn_id=1))
    checker = EventStreamChecker()
    checker.check(_event(ev.ResponseCreated, 1, response_id="r1", turn_id=0))
    with pytest.raises(AssertionError, match="never got response.done"):
        checker.check(_event(ev.SessionClosedEvent, 2, reason="client_closed"))


# --- fixtures under @given: each example gets its own ----------------------------------------------


@settings(max_examples=5, deadline=None)
@given(st.floats(0.001, 5.0))
def test_clock_factory_gives_each_example_a_fresh_clock(make_manual_clock, dt):
    clock = make_manual_clock()
    assert clock.now() == 0.0  # nothing left over from an earlier example
    clock.advance(dt)
    assert clock.now() == dt


@settings(max_examples=3, deadline=None)
@given(st.integers(1, 3))
def test_runtime_factory_runs_a_turn_per_example(make_scripted_engine, start_duplex_runtime, chunks):
    engine = make_scripted_engine()
    with start_duplex_runtime(engine) as driver:
        session = driver.open_session()
        for _ in range(chunks):
            session.append_audio(b"\0\0" * 1600)
        driver.call(session.commit)

        async def until_done():
            with anyio.fail_after(5):
                async for event in session.events():
                    if event.type == "response.done":
                        return event.status

        assert driver.call(until_done) == "completed"
    assert len(engine.submitted) == 1  # a fresh engine: only this example's turn
