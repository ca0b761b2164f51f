"""Conversation items over a real socket: create, retrieve, delete, truncate, and text in."""

from __future__ import annotations

import base64
import json

import pytest
from websockets.asyncio.client import connect

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.server import RealtimeServer, ServerConfig

from .conftest import CHUNK_100MS, recv_json, recv_until, user_text

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

SCRIPT = Script(token_latency_s=0.002, tokens=("Sure", " thing."), audio_packets=3, packet_ms=40)


def send(ws, **event):
    return ws.send(json.dumps(event))


async def test_text_in_audio_out_and_the_engine_reads_the_text():
    engine = ScriptedEngine(SCRIPT)
    async with Runtime(engine) as rt, RealtimeServer(rt, ServerConfig(port=0)) as server:
        async with connect(server.url) as ws:
            await recv_json(ws)
            await send(ws, type="conversation.item.create", item=user_text("what time is it"))
            added = (await recv_until(ws, "conversation.item.added"))[-1]
            assert added["item"]["content"] == [{"type": "input_text", "text": "what time is it"}]
            assert added["previous_item_id"] is None
            await send(ws, type="response.create")
            events = await recv_until(ws, "response.done")
            types = [e["type"] for e in events]
            assert "response.output_audio.delta" in types and "response.output_text.delta" not in types
            transcript = "".join(
                e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"
            )
            assert transcript == "Sure thing."
            assistant_added = next(e for e in events if e["type"] == "conversation.item.added")
            assert assistant_added["previous_item_id"] == added["item"]["id"]
            (request,) = engine.submitted
            assert request.input_text == "what time is it" and request.audio == b""
            # the text was answered: the next response does not read it again
            await send(ws, type="response.create")
            await recv_until(ws, "response.done")
            assert engine.submitted[1].input_text == ""


async def test_item_ids_are_unique_and_linked_and_edits_check_their_ranges():
    async with Runtime(ScriptedEngine(SCRIPT)) as rt, RealtimeServer(rt, ServerConfig(port=0)) as server:
        async with connect(server.url) as ws:
            await recv_json(ws)
            ids = []
            for _ in range(2):  # two commits: two user items, chained
                await send(ws, type="input_audio_buffer.append", audio=base64.b64encode(CHUNK_100MS).decode())
                await send(ws, type="input_audio_buffer.commit")
                events = await recv_until(ws, "conversation.item.done")
                committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
                assert events[-1]["item"]["id"] == committed["item_id"]
                ids.append((committed["item_id"], committed["previous_item_id"]))
            (first, before_first), (second, before_second) = ids
            assert first != second and before_first is None and before_second == first

            # a developer note goes first ("root"); GA knows no developer role: it is a system item
            await send(
                ws,
                type="conversation.item.create",
                previous_item_id="root",
                item={
                    "type": "message",
                    "role": "developer",
                    "content": [{"type": "input_text", "text": "be brief"}],
                },
            )
            note = (await recv_until(ws, "conversation.item.done"))[-1]
            assert note["item"]["role"] == "system" and note["previous_item_id"] is None

            await send(ws, type="conversation.item.create", item=user_text("x", id=first), event_id="dup")
            await send(
                ws,
                type="conversation.item.create",
                item=user_text("x"),
                previous_item_id="nope",
                event_id="where",
            )
            await send(
                ws,
                type="conversation.item.truncate",
                item_id=first,
                content_index=0,
                audio_end_ms=10,
                event_id="user",
            )
            await send(ws, type="conversation.item.retrieve", item_id="item_missing", event_id="missing")
            errors = {}
            while len(errors) < 4:
                event = await recv_json(ws)
                assert event["type"] == "error", event
                errors[event["error"]["event_id"]] = (event["error"]["code"], event["error"]["param"])
            assert errors == {
                "dup": ("invalid_value", "item.id"),
                "where": ("invalid_value", "previous_item_id"),
                "user": ("invalid_value", "item_id"),
                "missing": ("item_retrieve_invalid_item_id", None),  # OpenAI's code
            }

            await send(ws, type="response.create")
            events = await recv_until(ws, "response.done")
            assistant = events[-1]["response"]["output"][0]["id"]
            await send(
                ws,
                type="conversation.item.truncate",
                item_id=assistant,
                content_index=1,
                audio_end_ms=0,
                event_id="part",
            )
            error = await recv_json(ws)
            if error["type"] == "rate_limits.updated":
                error = await recv_json(ws)
            assert (error["error"]["event_id"], error["error"]["param"]) == ("part", "content_index")
            await send(
                ws, type="conversation.item.truncate", item_id=assistant, content_index=0, audio_end_ms=120
            )  # exactly all of its 3 x 40 ms
            truncated = await recv_json(ws)
            assert truncated["type"] == "conversation.item.truncated"
            await send(ws, type="conversation.item.delete", item_id=assistant)
            assert (await recv_json(ws))["item_id"] == assistant
            await send(ws, type="conversation.item.retrieve", item_id=assistant, event_id="gone")
            gone = await recv_json(ws)
            assert (gone["error"]["code"], gone["error"]["event_id"]) == (
                "item_retrieve_invalid_item_id",
                "gone",
            )
            assert (
                gone["error"]["message"]
                == f"Error retrieving item: the item with id {assistant!r} does not exist."
            )


async def test_replayed_assistant_history_is_kept_but_never_read_as_input():
    engine = ScriptedEngine(SCRIPT)
    async with Runtime(engine) as rt, RealtimeServer(rt, ServerConfig(port=0)) as server:
        async with connect(server.url) as ws:
            await recv_json(ws)
            await send(ws, type="conversation.item.create", item=user_text("my name is Ada"))
            await send(
                ws,
                type="conversation.item.create",
                item={
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Hi Ada"}],
                },
            )
            events = await recv_until(ws, "conversation.item.done")
            events += await recv_until(ws, "conversation.item.done")
            assistant = events[-1]["item"]
            assert assistant["role"] == "assistant"
            assert assistant["content"] == [{"type": "output_text", "text": "Hi Ada"}]
            await send(ws, type="conversation.item.create", item=user_text("what is my name?"))
            await send(ws, type="response.create")
            await recv_until(ws, "response.done")
            # Not the assistant's words, nor the user's that they already answered.
            assert engine.submitted[0].input_text == "what is my name?"
