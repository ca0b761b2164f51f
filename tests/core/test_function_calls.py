"""Function calls through the sans-IO core: tools reach the engine request, a FunctionCall output
becomes its own output item with argument events, and a function output reaches the next turn."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.core import commands as cmd
from duplex_actors.core import events as ev
from duplex_actors.core.engine_io import (
    Decision,
    FunctionCall,
    FunctionTool,
    SamplingOverrides,
    TextDelta,
    TurnDone,
)
from duplex_actors.core.session import SubmitTurn
from duplex_actors.errors import InvalidCommand, UnknownFunctionCall
from duplex_actors.server.codec import WireSession, encode

from .helpers import CHUNK, core_in

TOOL = FunctionTool("get_weather", "Weather in a city", '{"type":"object"}')


def test_scripted_example_arguments_fill_required_parameters_from_the_schema():
    from duplex_actors.engines.scripted import example_arguments

    schema = {
        "type": "object",
        "required": ["city", "days", "unit", "alerts"],
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["c", "f"]},
            "alerts": {"type": "boolean"},
            "note": {"type": "string"},
        },
    }
    assert json.loads(example_arguments(json.dumps(schema))) == {
        "city": "example",
        "days": 1,
        "unit": "c",
        "alerts": True,
    }
    assert example_arguments("{}") == "{}" and example_arguments("not json") == "{}"


_ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(
    required=_ANY_JSON,
    prop=_ANY_JSON,
    kind=_ANY_JSON,
    enum=_ANY_JSON,
)
def test_scripted_example_arguments_take_any_schema_a_client_sends(required, prop, kind, enum):
    # The schema is the client's: whatever it holds, the scripted engine answers with an object
    # (before, an enum that was an object, a type list that was empty or a number as `required`
    # raised inside the engine, and the response failed as the engine's fault).
    from duplex_actors.engines.scripted import example_arguments

    for schema in (
        {"type": "object", "required": required, "properties": prop},
        {"type": "object", "required": ["a"], "properties": {"a": {"type": kind, "enum": enum}}},
        {"type": "object", "required": ["a"], "properties": {"a": prop}},
        required,
    ):
        assert isinstance(json.loads(example_arguments(json.dumps(schema))), dict)


def _wire(events):
    # The wire shape is the server codec's (the core's events are typed values).
    return [encode(e, WireSession())[0] for e in events]


def _submitted(core):
    return [a.request for a in core.take_actions() if isinstance(a, SubmitTurn)]


def test_tools_reach_the_request_and_a_call_becomes_its_own_item():
    core = core_in("idle")
    core.handle(cmd.UpdateSession(tools=(TOOL,), tool_choice="required"))
    core.handle(cmd.AppendAudio(pcm=CHUNK))
    core.handle(cmd.CommitInput())
    (request,) = _submitted(core)
    assert request.tools == (TOOL,) and request.tool_choice == "required"
    assert request.function_results == ()
    rid = request.request_id
    core.take_events()
    core.on_engine_output(Decision(rid, True))
    core.on_engine_output(FunctionCall(rid, "call_1", "get_weather", '{"city":"Oslo"}'))
    core.on_engine_output(TurnDone(rid))
    events = _wire(core.take_events())
    types = [e["type"] for e in events]
    calls = [
        e
        for e in events
        if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"
    ]
    # A call-only response (GA): the call is output item 0, and no assistant message opens.
    assert len(calls) == 1 and calls[0]["output_index"] == 0
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"] == [
        "function_call"
    ]
    assert "response.content_part.added" not in types
    assert calls[0]["item"]["call_id"] == "call_1"
    done = events[types.index("response.function_call_arguments.done")]
    assert json.loads(done["arguments"]) == {"city": "Oslo"} and done["name"] == "get_weather"
    assert (
        types.index("response.function_call_arguments.delta")
        < types.index("response.function_call_arguments.done")
        < types.index("response.done")
    )
    output = events[-1]["response"]["output"]
    assert [i["type"] for i in output] == ["function_call"]
    assert output[0]["arguments"] == '{"city":"Oslo"}'
    assert core.state == "idle"


def test_words_after_a_call_open_the_message_as_the_next_output_item():
    core = core_in("idle")
    core.handle(cmd.UpdateSession(tools=(TOOL,), tool_choice="required"))
    core.handle(cmd.AppendAudio(pcm=CHUNK))
    core.handle(cmd.CommitInput())
    (request,) = _submitted(core)
    rid = request.request_id
    core.take_events()
    core.on_engine_output(Decision(rid, True))
    core.on_engine_output(FunctionCall(rid, "call_1", "get_weather", "{}", token_count=3))
    core.on_engine_output(TextDelta(rid, "Checking"))
    core.on_engine_output(TurnDone(rid))
    events = _wire(core.take_events())
    added = [
        (e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"
    ]
    assert added == [(0, "function_call"), (1, "message")]
    deltas = [e for e in events if e["type"].endswith(".delta") and "function_call" not in e["type"]]
    assert deltas and {e["output_index"] for e in deltas} == {1}
    done = events[-1]["response"]
    assert [i["type"] for i in done["output"]] == ["function_call", "message"]
    # the call's tokens and the words' are both output tokens
    assert done["usage"]["output_tokens"] == 4


def test_function_output_is_kept_for_exactly_the_next_turn():
    core = core_in("idle")
    core.handle(cmd.UpdateSession(tools=(TOOL,)))
    core.handle(cmd.CreateResponse())
    (request,) = _submitted(core)
    core.on_engine_output(FunctionCall(request.request_id, "call_7", "get_weather", "{}"))
    core.on_engine_output(TurnDone(request.request_id))
    core.take_events()
    core.handle(cmd.AddFunctionOutput(call_id="call_7", output='{"t":3}', item_id="item_out"))
    events = _wire(core.take_events())
    assert [e["type"] for e in events] == ["conversation.item.added", "conversation.item.done"]
    assert events[0]["item"] == {
        "id": "item_out",
        "object": "realtime.item",
        "type": "function_call_output",
        "status": "completed",
        "call_id": "call_7",
        "output": '{"t":3}',
    }
    assert core.take_actions() == []  # an output starts no response by itself
    core.handle(cmd.CreateResponse())
    (follow,) = _submitted(core)
    assert [(r.call_id, r.output, r.name) for r in follow.function_results] == [
        ("call_7", '{"t":3}', "get_weather")
    ]
    core.on_engine_output(TextDelta(follow.request_id, "ok"))
    core.on_engine_output(TurnDone(follow.request_id))
    core.handle(cmd.CreateResponse())
    (third,) = _submitted(core)
    assert third.function_results == ()


def test_output_for_an_unknown_call_is_refused_and_changes_nothing():
    core = core_in("listening")
    with pytest.raises(UnknownFunctionCall) as info:
        core.handle(cmd.AddFunctionOutput(call_id="call_x", output="1", event_id="e1"))
    assert info.value.code == "unknown_function_call" and info.value.event_id == "e1"
    assert core.take_events() == [] and core.state == "listening"


def test_a_stale_function_call_is_counted_not_delivered():
    core = core_in("idle")
    core.handle(cmd.UpdateSession(tools=(TOOL,)))
    core.handle(cmd.CreateResponse())
    (request,) = _submitted(core)
    core.on_engine_output(Decision(request.request_id, True))
    core.handle(cmd.CancelResponse())
    core.take_events()
    core.on_engine_output(FunctionCall(request.request_id, "call_late", "get_weather", "{}"))
    assert core.counters.stale_outputs == 1
    assert not [e for e in core.take_events() if "function_call" in e.type]
    with pytest.raises(UnknownFunctionCall):  # a call never delivered cannot be answered
        core.handle(cmd.AddFunctionOutput(call_id="call_late", output="1"))


_CLOCK_TOOL = FunctionTool("get_time", "", '{"type":"object"}')


@given(
    session_limit=st.none() | st.integers(1, 32_768),
    responses=st.lists(
        st.tuples(
            st.none() | st.sampled_from(((), (TOOL,), (_CLOCK_TOOL,), (TOOL, _CLOCK_TOOL))),
            st.none() | st.sampled_from(("auto", "none", "required", "get_time")),
            st.none() | st.integers(1, 32_768),
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_a_response_create_s_own_options_apply_to_that_response_only(session_limit, responses):
    # Per-response tools, tool_choice and max_tokens (livekit's generate_reply sends them)
    # replace the session's for that one request; the next response is back to the session's.
    core = core_in("idle")
    core.handle(
        cmd.UpdateSession(
            tools=(TOOL,), tool_choice="auto", sampling=SamplingOverrides(max_tokens=session_limit)
        )
    )
    core.take_events()
    for tools, choice, limit in responses:
        core.handle(cmd.CreateResponse(tools=tools, tool_choice=choice, max_tokens=limit))
        (request,) = _submitted(core)
        assert request.tools == (tools if tools is not None else (TOOL,))
        assert request.tool_choice == (choice or "auto")
        assert request.sampling.max_tokens == (limit if limit is not None else session_limit)
        core.on_engine_output(TurnDone(request.request_id))
        events = core.take_events()
        created = next(e for e in events if isinstance(e, ev.ResponseCreated))
        done = next(e for e in events if isinstance(e, ev.ResponseDone))
        assert created.max_output_tokens == done.max_output_tokens == request.sampling.max_tokens
        assert core.state == "idle"


def test_a_session_update_changes_only_the_sampling_knobs_it_names():
    # The update's knobs replaced the session's as a whole: setting max_output_tokens later
    # dropped a temperature set earlier. GA "inf" (reset_sampling) sets the limit back.
    core = core_in("idle")
    core.handle(cmd.UpdateSession(sampling=SamplingOverrides(temperature=0.5, seed=7)))
    core.handle(cmd.UpdateSession(sampling=SamplingOverrides(max_tokens=3)))
    assert core.config.sampling == SamplingOverrides(temperature=0.5, seed=7, max_tokens=3)
    core.handle(cmd.UpdateSession(reset_sampling=("max_tokens",)))
    assert core.config.sampling == SamplingOverrides(temperature=0.5, seed=7)
    with pytest.raises(InvalidCommand):
        cmd.UpdateSession(reset_sampling=("warmth",))
