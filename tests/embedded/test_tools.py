"""The embedded engine's documented tool trigger: a forced tool_choice makes it call the tool
(random weights cannot choose one), with arguments the model writes under the tool's JSON
schema (valid for it); "auto" and follow-up turns decode as usual."""

from __future__ import annotations

import attrs
import pytest

pytest.importorskip("torch")

import json

import jsonschema

from duplex_actors.core.engine_io import (
    Decision,
    EngineFailure,
    FunctionCall,
    FunctionResult,
    FunctionTool,
    TextDelta,
    TurnDone,
)

from .helpers import request, run, small_engine

pytestmark = pytest.mark.embedded

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 3, "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "detailed": {"type": "boolean"},
        "spots": {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0}, "minItems": 2},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}},
            "required": ["lat"],
        },
        "note": {"type": "string"},
    },
    "required": ["city", "unit", "days", "detailed", "spots", "where"],
    "additionalProperties": False,
}
TOOLS = (FunctionTool("get_weather", parameters=json.dumps(WEATHER)), FunctionTool("get_time"))


async def _outputs(engine, req):
    return [o async for o in engine.generate(req)]


def test_forced_tool_choice_calls_that_tool_and_auto_decodes():
    async def main():
        engine = small_engine()
        await engine.start()
        try:
            named = await _outputs(
                engine, attrs.evolve(request("sess_t"), tools=TOOLS, tool_choice="get_time")
            )
            required = await _outputs(
                engine, attrs.evolve(request("sess_r"), tools=TOOLS, tool_choice="required")
            )
            auto = await _outputs(engine, attrs.evolve(request("sess_a"), tools=TOOLS))
            follow = await _outputs(
                engine,
                attrs.evolve(
                    request("sess_f"),
                    tools=TOOLS,
                    tool_choice="required",
                    function_results=(FunctionResult("call_1", "21 C", "get_weather"),),
                ),
            )
        finally:
            await engine.aclose()
        return named, required, auto, follow

    named, required, auto, follow = run(main())
    assert [type(o) for o in named] == [Decision, FunctionCall, TurnDone]
    assert named[1].name == "get_time" and named[1].arguments == "{}" and named[1].call_id
    assert required[1].name == "get_weather"
    # The arguments are valid for the schema (every required parameter, in its type and
    # range), written from the model's own tokens, which count as output tokens.
    arguments = json.loads(required[1].arguments)
    jsonschema.validate(arguments, WEATHER)
    assert set(arguments) == set(WEATHER["required"]) and required[1].token_count >= 1
    # The prompt the model read is reported (a turn's kind token at least, its audio tokens).
    usage = required[-1].input
    assert usage is not None and usage.text_tokens >= 2 and usage.audio_tokens >= 1
    for decoded in (auto, follow):
        assert not any(isinstance(o, FunctionCall) for o in decoded)
        assert any(isinstance(o, TextDelta) for o in decoded) and isinstance(decoded[-1], TurnDone)


def test_a_schema_no_arguments_can_satisfy_fails_the_response_rather_than_calling():
    # A pattern is not generated towards: the call would be one the client's function refuses,
    # so the response fails (non-retryable) instead.
    schema = {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"],
    }
    tool = FunctionTool("lookup", parameters=json.dumps(schema))

    async def main():
        engine = small_engine()
        await engine.start()
        try:
            return await _outputs(
                engine, attrs.evolve(request("sess_p"), tools=(tool,), tool_choice="lookup")
            )
        finally:
            await engine.aclose()

    outputs = run(main())
    assert [type(o) for o in outputs] == [EngineFailure]
    assert "lookup" in outputs[0].message and not outputs[0].retryable


def test_every_response_reports_the_prompt_it_read():
    async def main():
        engine = small_engine()
        await engine.start()
        try:
            return await _outputs(engine, attrs.evolve(request("sess_u"), instructions="be very brief"))
        finally:
            await engine.aclose()

    outputs = run(main())
    done = outputs[-1]
    assert isinstance(done, TurnDone) and done.input is not None
    # <bos>, the instruction words the vocabulary knows, <respond>; the audio's 80 ms tokens
    assert 2 <= done.input.text_tokens <= 2 + 3 and done.input.audio_tokens >= 1


def test_over_the_wire_a_forced_call_is_the_whole_response_and_its_arguments_fit_the_schema():
    # What an openai-agents user met: the SDK validates a call's arguments against the
    # function's parameters, and never ran a tool whose required parameters were missing.
    pytest.importorskip("websockets")
    from websockets.asyncio.client import connect

    from duplex_actors import Runtime
    from duplex_actors.server import RealtimeServer, ServerConfig

    async def main():
        async with Runtime(small_engine()) as runtime:
            async with RealtimeServer(runtime, ServerConfig(host="127.0.0.1", port=0)) as server:
                async with connect(server.url) as ws:
                    created = json.loads(await ws.recv())
                    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
                    session = {"output_modalities": ["text"], "tools": [tool], "tool_choice": "required"}
                    await ws.send(json.dumps({"type": "session.update", "session": session}))
                    await ws.send(json.dumps({"type": "response.create"}))
                    events = []
                    while not events or events[-1]["type"] != "response.done":
                        events.append(json.loads(await ws.recv()))
                    return created, events

    created, events = run(main())
    assert created["session"]["max_output_tokens"] == 256  # the thinker's own limit
    response = events[-1]["response"]
    assert response["status"] == "completed"
    (call,) = response["output"]  # the call alone: no empty assistant message before it
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    usage = response["usage"]
    assert usage["output_tokens"] >= 1 and usage["input_tokens"] >= 3
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


@pytest.mark.parametrize(
    "parameter, said",
    [
        # Python's re backtracks over this pattern for about 0.2 s at 29 characters and sixteen
        # times longer for every six more: with a 60-character minimum the engine's event loop,
        # and every session on it, was held for days. Now searched with regex, time-bounded.
        ({"type": "string", "minLength": 60, "pattern": r"^(\w+\s?)*[!?]$"}, "does not match"),
        # Built in full before: a billion items on the engine's loop.
        ({"type": "array", "minItems": 10**9, "items": {"type": "integer"}}, "may hold"),
    ],
    ids=["backtracking-pattern", "billion-items"],
)
def test_over_the_wire_a_hostile_schema_fails_its_own_response_and_holds_no_one_else(parameter, said):
    pytest.importorskip("websockets")
    from websockets.asyncio.client import connect

    from duplex_actors import Runtime
    from duplex_actors.server import RealtimeServer, ServerConfig

    schema = {"type": "object", "properties": {"x": parameter}, "required": ["x"]}

    async def main():
        async with Runtime(small_engine()) as runtime:
            async with RealtimeServer(runtime, ServerConfig(host="127.0.0.1", port=0)) as server:
                async with connect(server.url) as ws, connect(server.url) as neighbour:
                    json.loads(await ws.recv())
                    json.loads(await neighbour.recv())
                    tool = {"type": "function", "name": "f", "parameters": schema}
                    session = {"output_modalities": ["text"], "tools": [tool], "tool_choice": "f"}
                    await ws.send(json.dumps({"type": "session.update", "session": session}))
                    await ws.send(json.dumps({"type": "response.create"}))
                    events = []
                    while not events or events[-1]["type"] != "response.done":
                        events.append(json.loads(await ws.recv()))
                    error = {"type": None}
                    while error["type"] != "error":  # the failure's error follows its done
                        error = json.loads(await ws.recv())
                    await neighbour.send(json.dumps({"type": "heartbeat"}))
                    acked = json.loads(await neighbour.recv())
                    return events, error, acked

    events, error, acked = run(main())
    response = events[-1]["response"]
    assert response["status"] == "failed", response
    assert not any(item["type"] == "function_call" for item in response["output"])
    # The response's error event says why (the engine's message names the tool).
    assert error["type"] == "error" and error["error"]["code"] == "engine_error"
    assert said in error["error"]["message"] and "'f'" in error["error"]["message"], error
    assert acked["type"] == "heartbeat.ack"
