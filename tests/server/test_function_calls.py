"""Function tools over a real socket: session.update tools -> a function call from the scripted
engine -> function_call_arguments events -> function_call_output -> the follow-up answer."""

from __future__ import annotations

import base64
import json

import pytest
import websockets

from duplex_actors import Script

from .conftest import CHUNK_100MS, recv_json, recv_until, running_server

pytestmark = pytest.mark.anyio

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


async def _open(server):
    ws = await websockets.connect(server.url)
    created = await recv_json(ws)
    assert created["type"] == "session.created"
    return ws


async def _send(ws, **event):
    await ws.send(json.dumps(event))


async def test_tool_call_round_trip_over_the_socket():
    script = Script(tokens=("It", " is"), audio_packets=1, tool_arguments='{"city": "Paris"}')
    async with running_server(script) as server:
        ws = await _open(server)
        await _send(
            ws,
            type="session.update",
            session={
                "type": "realtime",
                "tools": [WEATHER],
                "tool_choice": "auto",
                "audio": {"input": {"turn_detection": None}},
            },
        )
        updated = await recv_until(ws, "session.updated")
        session = updated[-1]["session"]
        assert session["tools"][0]["name"] == "get_weather"
        assert session["tools"][0]["parameters"]["required"] == ["city"]  # an object, as GA has it

        await _send(ws, type="input_audio_buffer.append", audio=base64.b64encode(CHUNK_100MS).decode())
        await _send(ws, type="input_audio_buffer.commit")
        await _send(ws, type="response.create")
        events = await recv_until(ws, "response.done")
        types = [e["type"] for e in events]
        call_added = next(
            e
            for e in events
            if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"
        )
        call_id = call_added["item"]["call_id"]
        assert call_added["item"]["name"] == "get_weather"
        assert call_added["item"]["status"] == "in_progress"
        delta = next(e for e in events if e["type"] == "response.function_call_arguments.delta")
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        assert delta["call_id"] == done["call_id"] == call_id
        assert json.loads(done["arguments"]) == {"city": "Paris"}
        assert done["name"] == "get_weather"
        assert done["item_id"] == call_added["item"]["id"] == delta["item_id"]
        order = [
            types.index(t)
            for t in (
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.done",
            )
        ]
        assert order == sorted(order)
        item_done = [
            e
            for e in events
            if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"
        ]
        assert len(item_done) == 1 and item_done[0]["item"]["arguments"] == done["arguments"]
        response = events[-1]["response"]
        assert response["status"] == "completed"
        calls = [i for i in response["output"] if i["type"] == "function_call"]
        assert [(c["call_id"], c["name"]) for c in calls] == [(call_id, "get_weather")]
        assert types.count("response.done") == 1
        assert "response.output_text.delta" not in types  # a call-only response

        # The client runs the function and sends its output; the follow-up answer uses it.
        await _send(
            ws,
            type="conversation.item.create",
            event_id="fco",
            item={"type": "function_call_output", "call_id": call_id, "output": '{"temp_c": 21}'},
        )
        acked = await recv_until(ws, "conversation.item.done")
        added = next(e for e in acked if e["type"] == "conversation.item.added")
        assert added["item"]["type"] == "function_call_output"
        assert added["item"]["call_id"] == call_id
        await _send(ws, type="response.create")
        follow = await recv_until(ws, "response.done")
        # GA audio responses carry their words as the audio's transcript only
        text = next(e for e in follow if e["type"] == "response.output_audio_transcript.done")["transcript"]
        assert text == '{"temp_c": 21} It is'
        assert not [e for e in follow if e["type"].startswith("response.function_call")]
        assert follow[-1]["response"]["status"] == "completed"
        await ws.close()


async def test_unknown_call_id_and_bad_tools_get_typed_errors_and_change_nothing():
    async with running_server() as server:
        ws = await _open(server)
        await _send(
            ws,
            type="conversation.item.create",
            event_id="x1",
            item={"type": "function_call_output", "call_id": "call_nope", "output": "1"},
        )
        err = await recv_until(ws, "error")
        assert err[-1]["error"]["code"] == "unknown_function_call"
        assert err[-1]["error"]["event_id"] == "x1"
        await _send(ws, type="session.update", event_id="x2", session={"tools": [{"type": "function"}]})
        err = await recv_until(ws, "error")
        assert err[-1]["error"]["code"] == "invalid_value"
        assert "tools[0].name" in err[-1]["error"]["message"]
        await _send(
            ws,
            type="session.update",
            event_id="x3",
            session={"tools": [{"type": "mcp", "server_label": "x"}]},
        )
        err = await recv_until(ws, "error")
        assert err[-1]["error"]["code"] == "not_supported"
        # Nothing was applied: the session still has no tools, and a turn answers normally.
        await _send(ws, type="session.update", session={"instructions": "hi"})
        updated = await recv_until(ws, "session.updated")
        assert updated[-1]["session"]["tools"] == []
        await ws.close()


async def test_tool_choice_none_answers_without_calling():
    async with running_server() as server:
        ws = await _open(server)
        await _send(
            ws,
            type="session.update",
            session={"tools": [WEATHER], "tool_choice": "none", "audio": {"input": {"turn_detection": None}}},
        )
        await recv_until(ws, "session.updated")
        await _send(ws, type="response.create")
        events = await recv_until(ws, "response.done")
        assert not [e for e in events if e["type"].startswith("response.function_call")]
        # GA audio response (the default): the words arrive as the audio's transcript
        assert any(e["type"] == "response.output_audio_transcript.delta" for e in events)
        await ws.close()


async def test_scripted_serve_engine_calls_with_arguments_that_fit_the_schema():
    async with running_server() as server:  # the default script: arguments from the schema
        ws = await _open(server)
        await _send(
            ws,
            type="session.update",
            session={"tools": [WEATHER], "audio": {"input": {"turn_detection": None}}},
        )
        await recv_until(ws, "session.updated")
        await _send(ws, type="response.create")
        events = await recv_until(ws, "response.done")
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        assert json.loads(done["arguments"]) == {"city": "example"}
        await ws.close()


def _calls(events: list[dict]) -> list[str]:
    """The names of the functions a response called."""
    return [
        e["item"]["name"]
        for e in events
        if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"
    ]


async def test_a_response_create_may_bring_its_own_tools_tool_choice_and_token_limit():
    # livekit's generate_reply(tools=..., tool_choice=...) sends them on response.create; they
    # were read as nothing, so "tool_choice: none" for one reply still got a call.
    script = Script(tokens=("It", " is"), audio_packets=1, tool_arguments='{"city": "Paris"}')
    clock = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
    async with running_server(script) as server:
        ws = await _open(server)
        await _send(ws, type="session.update", session={"type": "realtime", "tools": [WEATHER]})
        await recv_until(ws, "session.updated")
        engine = server.runtime.engine.backend

        await _send(ws, type="response.create", response={"tool_choice": "none"})
        assert _calls(await recv_until(ws, "response.done")) == []
        # Its own tools, and one of them required, for this reply only.
        await _send(ws, type="response.create", response={"tools": [clock], "tool_choice": "required"})
        assert _calls(await recv_until(ws, "response.done")) == ["get_time"]
        assert [t.name for t in engine.submitted[-1].tools] == ["get_time"]
        # The session's own tools again for the next; a named function as GA spells it.
        await _send(
            ws,
            type="response.create",
            response={"tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 7},
        )
        events = await recv_until(ws, "response.done")
        assert _calls(events) == ["get_weather"]
        request = engine.submitted[-1]
        assert request.sampling.max_tokens == 7 and [t.name for t in request.tools] == ["get_weather"]
        created = next(e for e in events if e["type"] == "response.created")
        assert created["response"]["max_output_tokens"] == 7 == events[-1]["response"]["max_output_tokens"]
        await _send(ws, type="response.create", response={"max_output_tokens": "inf"})
        events = await recv_until(ws, "response.done")
        assert engine.submitted[-1].sampling.max_tokens is None
        assert events[-1]["response"]["max_output_tokens"] == "inf"
        await ws.close()


@pytest.mark.parametrize(
    "response, param",
    [
        ({"tools": {"name": "x"}}, "response.tools"),
        ({"tools": [{"type": "function"}]}, "response.tools[0].name"),
        ({"tool_choice": "sometimes"}, "response.tool_choice"),
        ({"max_output_tokens": 0}, "response.max_output_tokens"),
        ({"max_output_tokens": 40_000}, "response.max_output_tokens"),
    ],
)
async def test_a_bad_per_response_tool_or_limit_is_refused_naming_it_and_creates_nothing(response, param):
    async with running_server() as server:
        ws = await _open(server)
        await _send(ws, type="response.create", event_id="r1", response=response)
        error = (await recv_until(ws, "error"))[-1]["error"]
        assert (error["code"], error["param"], error["event_id"]) == ("invalid_value", param, "r1")
        assert server.runtime.engine.backend.submitted == []
        await ws.close()
