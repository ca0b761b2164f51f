"""The append fast path (SessionCore._append_buffered) against the full chart resolution.

The fast path is only allowed where the compiled chart says an append is a pure buffer step
(``CompiledChart.append_buffers_in``). Here two cores receive the same steps: one with the
shipped chart, one with the same table but no fast-path states, so every append is resolved
row by row. After every step they must agree exactly: the outcome (or the typed refusal),
state, fence, counters, buffered audio, overlap, lease, timing, the server events and the
engine actions. The recording chart also proves the fast path was really taken.
"""

from __future__ import annotations

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.core import commands as cmd
from duplex_actors.core.clock import ManualClock
from duplex_actors.core.engine_io import Aborted, AudioPacket, Decision, EngineFailure, TextDelta, TurnDone
from duplex_actors.core.session import SessionConfig, SessionCore
from duplex_actors.core.statechart import (
    APPEND_CHECKS,
    BARGE_IN,
    CHART,
    CHECKS,
    FENCE_CHECKS,
    LISTENING,
    RESPONDING,
    SAME,
    TRANSITIONS,
    build_machine,
    compile_chart,
    row,
)
from duplex_actors.errors import DuplexError
from duplex_actors.testing.strategies import commands

from .helpers import CHUNK

SID = "sess_fastpath00000000"
#: Where a program starts (see _drive_to): every state, a begun response and an open overlap.
STARTS = ["idle", "listening", "responding", "responding_begun", "barge_in", "overlapping", "closed"]


class CountingChart:
    """The shipped chart (fast-path table included), counting the appends it resolves."""

    def __init__(self, chart=CHART, *, fast: bool = True) -> None:
        self.chart = chart
        self.append_buffers_in = chart.append_buffers_in if fast else {}
        self.resolved_appends: list[str] = []

    def __getattr__(self, name):
        return getattr(self.chart, name)

    def resolve_on(self, subject, guards, state, trigger, step):
        if trigger == "append":
            self.resolved_appends.append(state)
        return self.chart.resolve_on(subject, guards, state, trigger, step)


class Pair:
    """Two cores fed the same steps: ``fast`` may take the fast path, ``full`` never does."""

    def __init__(self, config: SessionConfig) -> None:
        self.clock = ManualClock(50.0)
        self.fast_chart = CountingChart(fast=True)
        self.full_chart = CountingChart(fast=False)
        self.fast = SessionCore(SID, config, self.clock, chart=self.fast_chart)  # type: ignore[arg-type]
        self.full = SessionCore(SID, config, self.clock, chart=self.full_chart)  # type: ignore[arg-type]
        # The lease token is random per core; make it the same so events compare equal.
        self.full.lease.token = self.fast.lease.token
        self.fast.take_events()
        self.full.take_events()
        self.fast_appends = 0  # appends the fast core received in a fast-path state

    def both(self, step) -> None:
        fast_state = self.fast.state in CHART.append_buffers_in
        if isinstance(step, cmd.Command):
            # check() asks the chart without applying (server VAD asks it of every chunk): the
            # same answer on both paths, and nothing changed (the ledgers compare below).
            answers = [_check(core, step) for core in (self.fast, self.full)]
            assert answers[0] == answers[1], step
        outcomes = [_apply(core, step) for core in (self.fast, self.full)]
        assert outcomes[0] == outcomes[1], step
        # (A stale or future fence is one of the row's checks: the full core resolves it too.)
        if isinstance(step, cmd.AppendAudio) and fast_state:
            self.fast_appends += 2  # its check and its handling
        self.check()

    def check(self) -> None:
        assert _ledgers(self.fast) == _ledgers(self.full)
        assert self.fast.take_events() == self.full.take_events()
        assert self.fast.take_actions() == self.full.take_actions()
        # The fast core resolved no append in a fast-path state; the full core resolved all.
        assert not set(self.fast_chart.resolved_appends) & set(CHART.append_buffers_in)
        full_fast_states = [s for s in self.full_chart.resolved_appends if s in CHART.append_buffers_in]
        assert len(full_fast_states) == self.fast_appends


def _apply(core: SessionCore, step):
    try:
        if isinstance(step, cmd.Command):
            core.handle(step, received_at=core.clock.now())
        else:
            core.on_engine_output(_engine_output(core, *step))
    except DuplexError as err:
        return (type(err).__name__, str(err), err.event_id)
    return ("ok",)


def _check(core: SessionCore, command: cmd.Command):
    try:
        core.check(command)
    except DuplexError as err:
        return (type(err).__name__, str(err), err.event_id)
    return ("ok",)


def _engine_output(core: SessionCore, kind: str, pick: int):
    live = sorted(core.in_flight_requests | core.aborting_requests)
    rid = live[pick % len(live)] if live and kind != "stale" else f"{core.session_id}/e99/t99"
    return {
        "speak": Decision(rid, True),
        "listen": Decision(rid, False),
        "text": TextDelta(rid, "hi"),
        "audio": AudioPacket(rid, CHUNK, 16000, " hi"),
        "done": TurnDone(rid),
        "failure": EngineFailure(rid, "boom"),
        "aborted": Aborted(rid),
        "stale": TextDelta(rid, "old"),
    }[kind]


def _ledgers(core: SessionCore) -> tuple:
    return (
        core.state,
        core.epoch,
        core.turn_id,
        core.closed,
        core.close_reason,
        attrs_tuple(core.counters),
        bytes(core._input),
        core._input_ms,
        core._overlap_ms,
        core.in_flight_requests,
        core.aborting_requests,
        core.response_id,
        core.pending_events,
        core.outbox_overflowed,
        core.lease.last_activity,
        core.lease.in_flight,
        core.lease.detached_at,
        core.timing.snapshot(),
        core.timing.is_empty,
        core.journaled_events,
        core.last_seq,
    )


def attrs_tuple(value) -> tuple:
    import attrs

    return attrs.astuple(value)


# --- the derived table ---------------------------------------------------------------------


def test_the_shipped_chart_buffers_appends_without_resolution_where_the_row_is_pure():
    checks = (*FENCE_CHECKS, *APPEND_CHECKS)  # the fence first, as for every command
    assert dict(CHART.append_buffers_in) == {LISTENING: checks, RESPONDING: checks, BARGE_IN: checks}
    for state in CHART.append_buffers_in:
        assert CHART.fixed_steps[(state, "append")] == (checks, ("buffer_audio",))
        (branch,) = CHART.table[(state, "append")]
        assert branch.dest == state and branch.effects == ("buffer_audio",)
        assert branch.guards == tuple((name, True) for name in checks)
        assert all(name in CHECKS for name in checks)
    # idle -> listening is a state change: it always goes through the chart.
    assert "idle" not in CHART.append_buffers_in
    assert "closed" not in CHART.append_buffers_in


def _chart_with(append_rows):
    rows = [r for r in TRANSITIONS if r["trigger"] != "append"] + append_rows
    return compile_chart(build_machine(rows))


def test_a_chart_that_changes_the_append_row_changes_the_fast_path():
    # An extra effect, a guard, or a move: each takes the state out of the fast path, and the
    # session then does what the chart says (here: a heartbeat ack per append in listening).
    extra = _chart_with(
        [
            row("append", "idle", LISTENING, ["buffer_audio"], conditions=APPEND_CHECKS),
            row("append", LISTENING, SAME, ["buffer_audio", "touch_lease"], conditions=APPEND_CHECKS),
            # a guard that selects a branch (not a check) ...
            row("append", [RESPONDING, BARGE_IN], SAME, ["buffer_audio"], conditions=["has_buffered_audio"]),
            # ... or a check with another branch behind it: either way the table decides less
            row("append", [RESPONDING, BARGE_IN], LISTENING, ["buffer_audio"]),
        ]
    )
    assert dict(extra.append_buffers_in) == {}
    core = SessionCore(SID, SessionConfig(), ManualClock(1.0), chart=extra)
    core.take_events()
    core.handle(cmd.AppendAudio(pcm=CHUNK))
    core.handle(cmd.AppendAudio(pcm=CHUNK))
    assert [e.type for e in core.take_events()] == ["heartbeat.ack"]
    assert core.buffered_input_bytes == 2 * len(CHUNK)


# --- both paths agree ----------------------------------------------------------------------


@pytest.mark.parametrize("start", STARTS)
@pytest.mark.parametrize(
    "append",
    [
        cmd.AppendAudio(pcm=CHUNK),
        cmd.AppendAudio(pcm=CHUNK, speech=True),
        cmd.AppendAudio(pcm=CHUNK, speech=False),
        cmd.AppendAudio(pcm=b""),
        cmd.AppendAudio(pcm=CHUNK, sample_rate=24000),  # refused: wrong rate
        cmd.AppendAudio(pcm=CHUNK * 20),  # refused past max_input_bytes below
        cmd.AppendAudio(pcm=CHUNK, epoch=0, event_id="ev1"),
        cmd.AppendAudio(pcm=CHUNK, epoch=1, event_id="ev2"),  # stale or ahead, by state
    ],
    ids=repr,
)
@pytest.mark.parametrize("model_native", [False, True])
def test_every_state_agrees_on_an_append(start, append, model_native):
    config = SessionConfig(
        model_native=model_native, unit_samples=640, min_interruption_ms=40, max_input_bytes=len(CHUNK) * 12
    )
    pair = Pair(config)
    for step in _drive_to(start):
        pair.both(step)
    for _ in range(4):  # a few, so an overlap grows past its minimum and units fill
        pair.both(append)
        pair.clock.advance(0.02)


def _drive_to(state: str) -> list:
    steps: list = []
    if state == "idle":
        return steps
    steps.append(cmd.AppendAudio(pcm=CHUNK))
    if state == "listening":
        return steps
    if state == "closed":
        return steps + [cmd.Close()]
    steps.append(cmd.CommitInput())
    if state == "responding":
        return steps
    steps.append(("speak", 0))
    if state == "barge_in":
        steps.append(cmd.BargeIn())
    if state == "overlapping":
        steps.append(cmd.SpeechStartedSignal(audio_ms=10))
    return steps


engine_steps = st.tuples(
    st.sampled_from(["speak", "listen", "text", "audio", "done", "failure", "aborted", "stale"]),
    st.integers(0, 3),
)
append_steps = st.builds(
    lambda n, speech, epoch, rate: cmd.AppendAudio(
        pcm=CHUNK[: 2 * n], speech=speech, epoch=epoch, sample_rate=rate
    ),
    st.integers(0, 320),
    st.sampled_from([None, True, False]),
    st.sampled_from([None, None, None, 0, 1, 2]),
    st.sampled_from([16000, 16000, 16000, 24000]),
)
# Turn-taking commands drawn often, so programs spend their appends in responding and barge_in
# (with and without an overlap) as well as in listening.
turn_steps = st.sampled_from(
    [
        cmd.CommitInput(),
        cmd.CreateResponse(),
        cmd.SpeechStartedSignal(audio_ms=100),
        cmd.SpeechStoppedSignal(audio_ms=900),
        cmd.BargeIn(),
        cmd.CancelResponse(),
        cmd.ClearInput(),
    ]
)
steps = st.lists(
    st.one_of(
        append_steps,
        append_steps,
        append_steps,
        turn_steps,
        engine_steps,
        engine_steps,
        commands(),
        st.floats(0.0, 0.5).map(lambda dt: ("tick", dt)),
    ),
    min_size=5,
    max_size=80,
)
configs = st.builds(
    SessionConfig,
    server_vad=st.booleans(),
    auto_respond=st.booleans(),
    respond_on_commit=st.booleans(),
    model_native=st.booleans(),
    unit_samples=st.sampled_from([320, 1600, 16000]),
    min_interruption_ms=st.sampled_from([0, 30, 500]),
    max_input_bytes=st.sampled_from([len(CHUNK) * 8, 16000 * 2 * 120]),
    outbox_capacity=st.sampled_from([24, 2048]),
    outbox_reserve=st.just(16),
)


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(configs, st.sampled_from(STARTS), steps)
def test_random_sequences_agree(config, start, program):
    pair = Pair(config)
    for step in _drive_to(start) + program:
        if isinstance(step, tuple) and step[0] == "tick":
            pair.clock.advance(step[1])
            continue
        pair.both(step)


def test_debug_logging_sees_the_same_transition_lines():
    from duplex_actors.logconfig import configure

    configure("debug")
    try:
        lines = []
        for fast in (True, False):
            chart = CountingChart(fast=fast)
            core = SessionCore(SID, SessionConfig(), ManualClock(1.0), chart=chart)  # type: ignore[arg-type]
            with structlog.testing.capture_logs() as logs:
                for _ in range(3):
                    core.handle(cmd.AppendAudio(pcm=CHUNK))
            lines.append([entry for entry in logs if entry["event"] == "transition"])
        assert lines[0] == lines[1]
        assert [(e["src"], e["dest"]) for e in lines[0]] == [
            ("idle", "listening"),
            ("listening", "listening"),
            ("listening", "listening"),
        ]
    finally:
        configure("warning")


# --- the caller's fast constructor -----------------------------------------------------------


pcm_values = st.one_of(
    st.binary(max_size=64),
    st.binary(max_size=64).map(bytearray),
    st.binary(max_size=64).map(memoryview),
    st.just("not audio"),
    st.just(None),
)
rates = st.sampled_from([8000, 16000, 24000, 48000, 16000.0, 44100, 0, True, "16000", None])


@given(
    pcm_values,
    rates,
    st.none() | st.text(max_size=4),
    st.sampled_from([None, None, 0, 3, -1, True, "1"]),
    st.sampled_from([None, True, False]),
)
def test_append_audio_of_builds_what_the_validated_constructor_builds(pcm, rate, event_id, epoch, speech):
    def build(factory):
        try:
            return factory()
        except Exception as err:  # the same error either way (a str pcm: bytes()'s TypeError)
            return (type(err).__name__, str(err))

    slow = build(
        lambda: cmd.AppendAudio(pcm=pcm, sample_rate=rate, event_id=event_id, epoch=epoch, speech=speech)
    )
    fast = build(lambda: cmd.AppendAudio.of(pcm, rate, event_id=event_id, epoch=epoch, speech=speech))
    assert fast == slow
    if isinstance(slow, cmd.AppendAudio):
        assert type(fast.pcm) is bytes
        assert repr(fast) == repr(slow) and hash(fast) == hash(slow)
