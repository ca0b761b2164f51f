"""What third-party clients rely on when they mirror the conversation (tests/interop/ runs the
clients themselves; these pin the server behaviour down without them):

* livekit keeps a copy of the server's conversation from ``conversation.item.added``, so an
  engine's function call must be announced as an item, as GA does, or the client re-creates it;
* livekit replays ``function_call`` items when it syncs its chat context;
* pipecat truncates the assistant item as soon as the user speaks, while it still streams.

Every event is validated against the openai SDK's GA models (strict), as in test_ga_schema.
"""

from __future__ import annotations

import base64
import json

import pytest
import websockets

from duplex_actors import Script
from duplex_actors.server import wire

from .conftest import recv_json, recv_until, running_server
from .test_ga_schema import GA_MODELS

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _valid(events: list[dict]) -> list[dict]:
    for event in events:
        if event["type"] in GA_MODELS:
            GA_MODELS[event["type"]].model_validate(event, strict=True)
    return events


async def _open(server):
    ws = await websockets.connect(server.url)
    assert (await recv_json(ws))["type"] == "session.created"
    await _send(
        ws, type="session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
    )
    await recv_until(ws, "session.updated")
    return ws


async def _send(ws, **event):
    await ws.send(json.dumps(event))


async def test_an_engine_function_call_is_announced_as_a_conversation_item():
    script = Script(tokens=("It",), audio_packets=1, tool_arguments='{"city": "Paris"}')
    async with running_server(script) as server:
        ws = await _open(server)
        await _send(ws, type="session.update", session={"tools": [WEATHER]})
        await recv_until(ws, "session.updated")
        await _send(ws, type="response.create")
        events = _valid(await recv_until(ws, "response.done"))
        # A call-only response carries only its call: no assistant message is opened.
        assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"] == [
            "function_call"
        ]
        call = [
            (i, e)
            for i, e in enumerate(events)
            if e.get("item", {}).get("type") == "function_call"
            or e["type"].startswith("response.function_call")
        ]
        # GA order: output item added, conversation item added (no arguments yet), arguments
        # streamed, output item done, conversation item done (with the arguments).
        assert [e["type"] for _, e in call] == [
            "response.output_item.added",
            "conversation.item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "conversation.item.done",
        ]
        added, done = call[1][1], call[5][1]
        call_item_id = call[0][1]["item"]["id"]
        assert added["item"]["id"] == done["item"]["id"] == call_item_id
        assert added["item"]["status"] == "in_progress" and added["item"]["arguments"] == ""
        assert done["item"]["status"] == "completed"
        assert json.loads(done["item"]["arguments"]) == {"city": "Paris"}
        assert added["previous_item_id"] is None and done["previous_item_id"] is None  # the first item
        # One announcement per item: the call's, nothing twice.
        announced = [e["item"]["id"] for e in events if e["type"] == "conversation.item.added"]
        assert announced == [call_item_id]
        await _send(ws, type="conversation.item.retrieve", item_id=call_item_id)
        got = _valid(await recv_until(ws, "conversation.item.retrieved"))[-1]["item"]
        assert got == done["item"]
        await ws.close()


async def test_a_replayed_function_call_is_kept_and_its_output_reaches_the_next_turn():
    async with running_server(Script(tokens=("ok",), audio_packets=1)) as server:
        ws = await _open(server)
        await _send(
            ws,
            type="conversation.item.create",
            event_id="c1",
            item={
                "type": "function_call",
                "id": "fc_hist",
                "call_id": "call_hist",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
        )
        events = _valid(await recv_until(ws, "conversation.item.done"))
        added = next(e for e in events if e["type"] == "conversation.item.added")
        assert added["item"] == {
            "id": "fc_hist",
            "object": "realtime.item",
            "type": "function_call",
            "status": "completed",
            "call_id": "call_hist",
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
        }
        # Its output answers it (it names a call of this conversation) and the next turn reads it.
        await _send(
            ws,
            type="conversation.item.create",
            event_id="c2",
            item={"type": "function_call_output", "call_id": "call_hist", "output": "cold"},
            previous_item_id="fc_hist",
        )
        events = _valid(await recv_until(ws, "conversation.item.done"))
        assert not [e for e in events if e["type"] == "error"]
        assert events[-1]["previous_item_id"] == "fc_hist"
        await _send(ws, type="response.create")
        follow = _valid(await recv_until(ws, "response.done"))
        transcript = next(e for e in follow if e["type"] == "response.output_audio_transcript.done")
        assert transcript["transcript"] == "cold ok"
        # Without a call_id the server names the call, and an output can answer that name.
        await _send(
            ws,
            type="conversation.item.create",
            item={"type": "function_call", "name": "get_weather", "arguments": "{}"},
        )
        item = _valid(await recv_until(ws, "conversation.item.done"))[-1]["item"]
        assert item["call_id"].startswith("call_")
        await _send(
            ws,
            type="conversation.item.create",
            item={"type": "function_call_output", "call_id": item["call_id"], "output": "1"},
        )
        assert (await recv_until(ws, "conversation.item.done"))[-1]["item"]["call_id"] == item["call_id"]
        # A call needs its name; the refusal names the field and adds nothing.
        await _send(
            ws,
            type="conversation.item.create",
            event_id="c3",
            item={"type": "function_call", "call_id": "call_x", "arguments": "{}"},
        )
        err = _valid(await recv_until(ws, "error"))[-1]["error"]
        assert (err["code"], err["event_id"]) == ("invalid_value", "c3")
        assert err["message"].startswith("item.name:")
        await _send(
            ws,
            type="conversation.item.create",
            event_id="c4",
            item={"type": "function_call_output", "call_id": "call_x", "output": "1"},
        )
        assert (await recv_until(ws, "error"))[-1]["error"]["code"] == "unknown_function_call"
        await ws.close()


def test_the_decoder_reads_a_function_call_item_and_requires_name_and_arguments():
    event = wire.decode(
        json.dumps(
            {
                "type": "conversation.item.create",
                "item": {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            }
        )
    )
    assert (event.item.type, event.item.call_id, event.item.name, event.item.arguments) == (
        "function_call",
        "c",
        "f",
        "{}",
    )
    for missing in ("name", "arguments"):
        item = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
        del item[missing]
        with pytest.raises(wire.InvalidField) as raised:
            wire.decode(json.dumps({"type": "conversation.item.create", "item": item}))
        assert raised.value.param == f"item.{missing}"


async def test_truncating_a_response_that_still_streams_checks_the_audio_sent_so_far():
    # Slow packets: the client has heard part of the answer when the user talks over it.
    script = Script(tokens=("Hello",), audio_packets=8, packet_ms=100, packet_latency_s=0.05)
    async with running_server(script) as server:
        ws = await _open(server)
        await _send(ws, type="response.create")
        first = _valid(await recv_until(ws, "response.output_audio.delta"))[-1]
        item_id = first["item_id"]
        received_ms = len(base64.b64decode(first["delta"])) // 2 * 1000 // first["sample_rate"]
        assert received_ms == 100
        # Past what was produced so far: refused, naming the field.
        await _send(
            ws,
            type="conversation.item.truncate",
            event_id="t1",
            item_id=item_id,
            content_index=0,
            audio_end_ms=5000,
        )
        events = _valid(await recv_until(ws, "error"))
        assert [e["type"] for e in events].count("response.done") == 0  # still streaming
        assert (events[-1]["error"]["param"], events[-1]["error"]["event_id"]) == ("audio_end_ms", "t1")
        # What the client received: accepted while the response streams.
        await _send(
            ws,
            type="conversation.item.truncate",
            event_id="t2",
            item_id=item_id,
            content_index=0,
            audio_end_ms=received_ms,
        )
        events = _valid(await recv_until(ws, "conversation.item.truncated"))
        assert "response.done" not in [e["type"] for e in events]
        assert events[-1]["audio_end_ms"] == received_ms
        done = _valid(await recv_until(ws, "response.done", timeout=10))[-1]
        assert done["response"]["status"] == "completed"
        # The truncation outlives the response: the item now holds only what was heard.
        await _send(
            ws,
            type="conversation.item.truncate",
            event_id="t3",
            item_id=item_id,
            content_index=0,
            audio_end_ms=received_ms + 100,
        )
        err = _valid(await recv_until(ws, "error"))[-1]["error"]
        assert err["param"] == "audio_end_ms" and f"({received_ms} ms)" in err["message"]
        await ws.close()
