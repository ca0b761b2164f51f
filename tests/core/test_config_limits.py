"""A limit no session or runtime could run with, or a value of the wrong kind handed to a
session's calls, is refused where it is given, naming itself.

Before, each of these was taken and failed far away: a session ``sample_rate`` of 0 made every
commit "buffer too small", an ``outbox_reserve`` of 0 failed the session's opening inside the
runtime's task group, a runtime ``dispatch_budget`` of 0 dispatched nothing (every ask timed
out), a negative ``stall_timeout_s`` restarted the engine under every response that took longer
than the watchdog's tick, and a negative ``reaper_interval_s`` ended the runtime."""

from __future__ import annotations

import math

import anyio
import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.core import commands as cmd
from duplex_actors.core.clock import ManualClock
from duplex_actors.core.conversation import ContentPart, Item
from duplex_actors.core.engine_io import SamplingOverrides
from duplex_actors.core.session import SessionCore
from duplex_actors.core.session_config import SessionConfig
from duplex_actors.errors import DuplexError, InvalidCommand, InvalidSampling

# Each number a session config holds, and the least it may be (None: no value is refused).
SESSION_FLOORS = {
    "speech_prefix_ms": 0,
    "sample_rate": 1,
    "output_sample_rate": 1,
    "unit_samples": 1,
    "min_interruption_ms": 0,
    "max_items": 1,
    "max_conversation_chars": 0,
    "max_input_bytes": 0,
    "max_committed_bytes": 0,
    "unsent_audio_bytes": 1,
    "idle_ttl_s": 0,
    "disconnect_grace_s": 0,
    "journal_max_events": 0,
    "journal_max_bytes": 0,
    "journal_max_age_s": 0,
}
RUNTIME_FLOORS = {
    "max_sessions": 1,
    "mailbox_capacity": 1,
    "dispatch_budget": 1,
    "reaper_interval_s": 0,
    "stall_timeout_s": 0,
}


@given(st.sampled_from(sorted(SESSION_FLOORS)), st.integers(min_value=-(10**6), max_value=10**6))
def test_a_session_number_below_its_floor_is_refused_naming_it_and_any_other_is_taken(name, value):
    if value < SESSION_FLOORS[name]:
        with pytest.raises(ValueError, match=name):
            SessionConfig(**{name: value})
    else:
        assert getattr(SessionConfig(**{name: value}), name) == value


@pytest.mark.parametrize("name", ["idle_ttl_s", "disconnect_grace_s", "journal_max_age_s"])
def test_seconds_that_are_not_a_number_are_refused(name):
    with pytest.raises(ValueError, match=name):
        SessionConfig(**{name: math.nan})


@given(st.integers(min_value=-4, max_value=40), st.integers(min_value=-4, max_value=40))
def test_the_outbox_reserve_is_at_least_two_and_less_than_the_capacity(capacity, reserve):
    if capacity > reserve >= 2:
        assert SessionConfig(outbox_capacity=capacity, outbox_reserve=reserve).outbox_reserve == reserve
    else:
        with pytest.raises(ValueError, match="outbox_reserve"):
            SessionConfig(outbox_capacity=capacity, outbox_reserve=reserve)


@given(st.sampled_from(sorted(RUNTIME_FLOORS)), st.one_of(st.integers(-100, 100), st.just(math.nan)))
def test_a_runtime_limit_below_its_floor_is_refused_naming_it(name, value):
    if isinstance(value, float) or value < RUNTIME_FLOORS[name]:
        with pytest.raises(ValueError, match=name):
            Runtime(ScriptedEngine(), **{name: value})
    else:
        Runtime(ScriptedEngine(), **{name: value})


async def _completes(session) -> None:
    """The session's response in progress ends completed."""
    with anyio.fail_after(10):
        async for event in session.events():
            if event.type == "response.done":
                assert event.status == "completed"
                return


@pytest.mark.anyio
async def test_a_runtime_at_every_floor_still_serves_a_turn():
    # The least of each value is one a runtime runs with (0 turns the intervals off); the
    # session's rate and input stay as a microphone's, so that a turn has audio to commit.
    floors = {
        name: floor
        for name, floor in SESSION_FLOORS.items()
        if name not in ("sample_rate", "max_input_bytes")
    }
    engine = ScriptedEngine(Script(first_latency_s=0.6))  # longer than the engine's watchdog tick
    async with Runtime(engine, config=SessionConfig(**floors), **RUNTIME_FLOORS) as rt:
        session = await rt.open_session()
        session.append_audio(b"\x10\x00" * 3200)
        await session.commit()
        await _completes(session)
        assert rt.statistics().engine.restarts == 0
        await session.close()


# --- what an application hands a session's calls ------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("call", "refused"),
    [
        (lambda s: s.update(instructions=5), "instructions must be a string"),
        (lambda s: s.update(modalities=("video",)), "modalities must be a tuple"),
        (lambda s: s.update(modalities="text"), "modalities must be a tuple"),
        (lambda s: s.update(modalities=("text", "text")), "modalities must be a tuple"),
        (lambda s: s.update(sampling={"heat": 1}), "unknown knob"),
        (lambda s: s.update(sampling=0.7), "sampling must be"),
        (lambda s: s.update(tool_choice=3), "tool_choice must be a string"),
        (lambda s: s.update(transcription_language=["en"]), "transcription_language must be a string"),
        (lambda s: s.create_response(instructions=b"be brief"), "instructions must be a string"),
        (lambda s: s.create_response(modalities=()), "modalities must be a tuple"),
    ],
)
async def test_a_call_with_a_value_of_the_wrong_kind_is_refused_at_the_call_and_the_session_goes_on(
    call, refused
):
    # Before: an update taking a dict for sampling failed the session (session_failed), and
    # one taking instructions that were not text was applied, failing every later response
    # inside the engine ("'int' object has no attribute 'split'").
    async with Runtime(ScriptedEngine()) as rt:
        session = await rt.open_session(modalities=("text",))
        with pytest.raises(InvalidCommand, match=refused):
            await call(session)
        await session.create_response()
        await _completes(session)
        assert session.state != "closed"


@pytest.mark.anyio
async def test_sampling_given_as_a_dict_of_knobs_is_applied_as_open_session_takes_it():
    async with Runtime(ScriptedEngine()) as rt:
        session = await rt.open_session()
        await session.update(sampling={"temperature": 0.3, "max_tokens": 7})
        assert session.config.sampling == SamplingOverrides(temperature=0.3, max_tokens=7)
        with pytest.raises(InvalidSampling):
            await session.update(sampling={"temperature": 99})
        assert session.config.sampling.temperature == 0.3 and session.state != "closed"


# --- the server's own settings, for an application that runs RealtimeServer itself ---------

SERVER_FLOORS = {
    "resume_wait_s": (0, False),  # (floor, whether the floor itself is allowed)
    "max_connections": (1, True),
    "ping_interval_s": (0, False),
    "ping_timeout_s": (0, False),
    "write_timeout_s": (0, False),
    "invalid_frames_per_s": (0, False),
    "invalid_frames_burst": (1, True),
    "max_sessions_per_key": (1, True),
    "max_sessions_per_address": (1, True),
    "max_detached_sessions": (1, True),
    "metrics_max_age_s": (0, True),
    "port": (0, True),
}


@given(st.sampled_from(sorted(SERVER_FLOORS)), st.integers(min_value=-50, max_value=70_000))
def test_a_server_setting_below_its_floor_is_refused_naming_it(name, value):
    from duplex_actors.server.config import ServerConfig

    floor, floor_allowed = SERVER_FLOORS[name]
    allowed = value > floor or (floor_allowed and value == floor)
    if name == "port":
        allowed = allowed and value <= 65535
    if allowed:
        assert getattr(ServerConfig(**{name: value}), name) == value
    else:
        # Before: an invalid_frames_burst of 0 failed every connection with 1011 and a
        # traceback; a max_detached_sessions of 0 refused every session as quota_exceeded.
        with pytest.raises(ValueError, match=name):
            ServerConfig(**{name: value})


_ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**6), max_value=10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.tuples(st.sampled_from(["text", "audio", "video"])),
    st.dictionaries(st.sampled_from(["temperature", "top_p", "heat"]), st.floats(-1, 3), max_size=2),
)


def _handled_without_failing(kind: type, changes: dict, refusals: tuple[type[Exception], ...]) -> None:
    """Build ``kind`` from ``changes`` and hand it to a session: refused where it is built (one
    of ``refusals``), or handled, a typed refusal at most; never an exception inside the
    session, which fails it."""
    try:
        command = kind(**changes)
    except refusals:
        return
    core = SessionCore("sess_cfglimits00", SessionConfig(), ManualClock(0.0))
    core.handle(cmd.AppendAudio(pcm=b"\x01\x00" * 3200))
    try:
        core.handle(command)
    except DuplexError:
        pass
    assert core.state != "closed" or kind is cmd.Close  # a Close closes: the one that may
    core.take_events()


def _fields(kind: type, values: st.SearchStrategy, size: int) -> st.SearchStrategy[dict]:
    names = [f.name for f in attrs.fields(kind) if f.name not in ("epoch", "event_id")]
    return st.dictionaries(st.sampled_from(names), values, max_size=size) if names else st.just({})


@settings(max_examples=400, deadline=None)
@given(_fields(cmd.UpdateSession, _ANY, 4))
def test_no_update_an_application_builds_fails_its_session(changes):
    # A SessionConfig floor the command did not check (min_interruption_ms) failed the session.
    _handled_without_failing(cmd.UpdateSession, changes, (InvalidCommand, InvalidSampling))


@settings(max_examples=400, deadline=None)
@given(_fields(cmd.CreateResponse, _ANY, 4))
def test_no_response_an_application_asks_for_fails_its_session(changes):
    # CreateResponse(metadata=True) raised inside the session.
    _handled_without_failing(cmd.CreateResponse, changes, (InvalidCommand, InvalidSampling))


# By name: a command class drawn as itself has hypothesis call its _repr_pretty_ unbound.
_COMMANDS = {
    c.__name__: c
    for c in vars(cmd).values()
    if isinstance(c, type) and issubclass(c, cmd.Command) and attrs.has(c)
}
_ANY_FIELD = st.one_of(
    _ANY,
    st.binary(max_size=6),
    st.just(Item(id="it_x", role="user", content=(ContentPart(type="input_text", text="hi"),))),
    st.builds(dict, a=st.just(1)),
)


@settings(max_examples=2000, deadline=None)
@given(
    st.sampled_from(sorted(_COMMANDS)).flatmap(
        lambda name: st.tuples(st.just(name), _fields(_COMMANDS[name], _ANY_FIELD, 3))
    )
)
def test_no_command_an_application_builds_fails_its_session(kind_and_fields):
    # Values of any kind in any of the command's fields: refused where built with the runtime's
    # own error (Python's TypeError only for a required field left out), or handled. Before,
    # CreateItem(item=None), DeleteItem(item_id={...}), PlaybackAck(response_id={...}) and
    # Resume(resume_token=0.0) raised inside the session, which fails it; PlaybackAck(played_ms=-1)
    # raised attrs' ValueError, AppendAudio(pcm=-2) bytes' own, and AppendAudio(pcm=4) was taken
    # as four bytes of silence.
    name, changes = kind_and_fields
    try:
        _handled_without_failing(_COMMANDS[name], changes, (InvalidCommand, InvalidSampling))
    except TypeError as exc:
        assert "required" in str(exc), exc


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        (cmd.AppendAudio, {"pcm": 4}),
        (cmd.AppendAudio, {"pcm": -2}),
        (cmd.CreateItem, {"item": Item(id="", role="user", content=()), "audio": 6}),
        (cmd.PlaybackAck, {"response_id": "resp_1", "played_ms": -1}),
        (cmd.TruncateItem, {"item_id": "it_1", "content_index": 0, "audio_end_ms": -5}),
        (cmd.TruncateItem, {"item_id": "it_1", "content_index": True, "audio_end_ms": 5}),
        (cmd.SpeechStoppedSignal, {"audio_ms": -1}),
        (cmd.Close, {"reason": 5}),
        (cmd.BargeIn, {"reason": None}),
        (cmd.CancelResponse, {"response_id": 7}),
        (cmd.AddFunctionOutput, {"call_id": "", "output": "{}"}),
        (cmd.AddFunctionOutput, {"call_id": "call_1", "output": {"ok": True}}),
        (cmd.Resume, {"generation": 1, "resume_token": "t", "control_id": 3}),
    ],
)
def test_a_command_field_of_the_wrong_kind_or_range_is_an_invalid_command(kind, fields):
    with pytest.raises(InvalidCommand):
        kind(**fields)
