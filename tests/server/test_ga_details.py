"""GA details over a real socket: usage with input and output tokens, max_output_tokens echoing
the limit that really applies, a call-only response, semantic_vad with its eagerness.

Every event is validated against the openai SDK's GA models (strict), as test_ga_schema does.
"""

from __future__ import annotations

import base64
import json

import attrs
import pytest
from websockets.asyncio.client import connect

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.engines.scripted import AUDIO_TOKEN_MS
from duplex_actors.server import RealtimeServer, ServerConfig

from .conftest import CHUNK_100MS, recv_until, user_text
from .test_ga_schema import Recorder
from .test_server_vad import LoudnessVad

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOKENS = ("One", " two", " three")
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


class Served:
    """A scripted engine behind a real server, as an async context."""

    def __init__(self, engine: ScriptedEngine, **config) -> None:
        self.engine, self.config = engine, config

    async def __aenter__(self) -> RealtimeServer:
        self.runtime = Runtime(self.engine)
        await self.runtime.__aenter__()
        self.server = RealtimeServer(self.runtime, ServerConfig(port=0, host="127.0.0.1", **self.config))
        await self.server.__aenter__()
        return self.server

    async def __aexit__(self, *exc) -> None:
        await self.server.__aexit__(*exc)
        await self.runtime.__aexit__(*exc)


async def test_usage_reports_the_engines_input_and_output_tokens_in_ga_shape():
    engine = ScriptedEngine(Script(tokens=TOKENS, audio_packets=1, packet_ms=40))
    async with Served(engine) as server, connect(server.url) as ws:
        r = Recorder(ws)
        await r.until("session.created")
        await r.send(
            type="session.update",
            session={
                "type": "realtime",
                "instructions": "Be brief please",
                "audio": {"input": {"turn_detection": None}},
            },
        )
        await r.until("session.updated")
        for _ in range(3):  # 300 ms of audio, committed
            await r.send(type="input_audio_buffer.append", audio=base64.b64encode(CHUNK_100MS).decode())
        await r.send(type="input_audio_buffer.commit")
        await r.send(type="conversation.item.create", item=user_text("what is the time"))
        await r.send(type="response.create")
        done = (await r.until("response.done"))[-1]["response"]
        request = engine.submitted[-1]
        # The scripted engine's rule: a text token per word it reads, an audio token per
        # started 100 ms: the 3 words of the instructions, the user's words, 300 ms of audio.
        assert AUDIO_TOKEN_MS == 100 and "what is the time" in request.input_text
        text, audio = 3 + len(request.input_text.split()), 3
        assert done["usage"] == {
            "total_tokens": text + audio + len(TOKENS),
            "input_tokens": text + audio,
            "output_tokens": len(TOKENS),
            "input_token_details": {
                "text_tokens": text,
                "audio_tokens": audio,
                "image_tokens": 0,
                "cached_tokens": 0,
            },
            "output_token_details": {"text_tokens": len(TOKENS), "audio_tokens": 0},
        }


async def test_a_cancelled_response_reports_no_input_it_was_never_told():
    engine = ScriptedEngine(Script(tokens=TOKENS * 20, audio_packets=1, token_latency_s=0.05))
    async with Served(engine) as server, connect(server.url) as ws:
        r = Recorder(ws)
        await r.until("session.created")
        await r.send(type="response.create")
        await r.until("response.output_audio_transcript.delta")
        await r.send(type="response.cancel")
        done = (await r.until("response.done"))[-1]["response"]
        assert done["status"] == "cancelled"
        usage = done["usage"]
        assert usage["input_tokens"] is None and usage["total_tokens"] is None
        assert (
            usage["output_tokens"] >= 1
            and usage["output_token_details"]["text_tokens"] == usage["output_tokens"]
        )


async def test_max_output_tokens_echoes_the_engines_own_limit_and_its_ceiling():
    engine = ScriptedEngine(Script(tokens=TOKENS, audio_packets=1))
    engine.capabilities = attrs.evolve(
        engine.capabilities, max_output_tokens=200, max_output_tokens_limit=300
    )
    async with Served(engine) as server, connect(server.url) as ws:
        r = Recorder(ws)
        created = (await r.until("session.created"))[-1]["session"]
        assert created["max_output_tokens"] == 200  # not "inf": the engine stops at 200
        await r.send(type="response.create")
        events = await r.until("response.done")
        assert events[0]["response"]["max_output_tokens"] == 200
        assert events[-1]["response"]["max_output_tokens"] == 200
        await r.send(type="session.update", session={"type": "realtime", "max_output_tokens": 1000})
        updated = (await r.until("session.updated"))[-1]["session"]
        assert updated["max_output_tokens"] == 300  # asked for more than the engine gives
        await r.send(type="response.create", response={"max_output_tokens": 50})
        assert (await r.until("response.done"))[-1]["response"]["max_output_tokens"] == 50


async def test_an_engine_without_a_limit_still_echoes_inf():
    async with (
        Served(ScriptedEngine(Script(tokens=TOKENS, audio_packets=1))) as server,
        connect(server.url) as ws,
    ):
        r = Recorder(ws)
        assert (await r.until("session.created"))[-1]["session"]["max_output_tokens"] == "inf"


async def test_a_call_only_response_carries_only_its_function_call():
    engine = ScriptedEngine(Script(tokens=TOKENS, audio_packets=1))
    async with Served(engine) as server, connect(server.url) as ws:
        r = Recorder(ws)
        await r.until("session.created")
        await r.send(
            type="session.update", session={"type": "realtime", "tools": [WEATHER], "tool_choice": "required"}
        )
        await r.until("session.updated")
        await r.send(type="response.create")
        events = await r.until("response.done")
        added = [e for e in events if e["type"] == "response.output_item.added"]
        assert [(e["output_index"], e["item"]["type"]) for e in added] == [(0, "function_call")]
        assert not [e for e in events if e["type"].startswith("response.content_part")]
        done = events[-1]["response"]
        assert [i["type"] for i in done["output"]] == ["function_call"]
        assert json.loads(done["output"][0]["arguments"]) == {"city": "example"}


async def test_semantic_vad_is_accepted_with_its_eagerness_and_sets_the_silence_that_ends_a_turn():
    async with Served(ScriptedEngine(), vad_factory=LoudnessVad) as server, connect(server.url) as ws:
        r = Recorder(ws)
        sid = (await r.until("session.created"))[-1]["session"]["id"]
        for eagerness, silence in (("high", 300), ("low", 1000), ("auto", 500)):
            td = {"type": "semantic_vad", "eagerness": eagerness, "create_response": False}
            await r.send(
                type="session.update",
                session={"type": "realtime", "audio": {"input": {"turn_detection": td}}},
            )
            echoed = (await r.until("session.updated"))[-1]["session"]["audio"]["input"]["turn_detection"]
            assert echoed == {**td, "interrupt_response": True}
            assert server._records[sid].vad_settings.silence_duration_ms == silence
        await r.send(
            type="session.update",
            event_id="bad",
            session={
                "type": "realtime",
                "audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}},
            },
        )
        error = (await recv_until(ws, "error"))[-1]["error"]
        assert (error["param"], error["event_id"]) == ("session.audio.input.turn_detection.eagerness", "bad")
        assert server._records[sid].vad_settings.silence_duration_ms == 500  # unchanged


async def test_a_user_item_with_input_audio_is_heard_by_the_next_response():
    engine = ScriptedEngine(Script(tokens=TOKENS, audio_packets=1))
    async with Served(engine) as server, connect(server.url) as ws:
        r = Recorder(ws)
        await r.until("session.created")
        await r.send(
            type="session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
        )
        await r.until("session.updated")
        audio = base64.b64encode(CHUNK_100MS * 3).decode()  # 300 ms at GA's 24 kHz
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_audio", "audio": audio, "transcript": "what time is it"}],
        }
        await r.send(type="conversation.item.create", item=item)
        added = (await r.until("conversation.item.done"))[-1]["item"]
        assert added["content"] == [{"type": "input_audio", "transcript": "what time is it"}]
        await r.send(type="response.create")
        done = (await r.until("response.done"))[-1]["response"]
        request = engine.submitted[-1]
        # 300 ms at the session's own 16 kHz, and the transcript the client gave, as words
        assert abs(len(request.audio) / 2 / request.sample_rate - 0.3) < 0.005
        assert "what time is it" in request.input_text
        assert done["usage"]["input_token_details"]["audio_tokens"] == 3
        # A bad part is refused whole, naming it
        await r.send(
            type="conversation.item.create",
            event_id="bad",
            item={"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": "%%%"}]},
        )
        error = (await recv_until(ws, "error"))[-1]["error"]
        assert (error["code"], error["param"]) == ("invalid_audio", "item.content[0].audio")


async def test_input_audio_in_g711_is_decoded_at_the_declared_format():
    engine = ScriptedEngine(Script(tokens=TOKENS, audio_packets=1))
    async with Served(engine) as server, connect(server.url) as ws:
        r = Recorder(ws)
        await r.until("session.created")
        update = {
            "type": "realtime",
            "audio": {"input": {"format": {"type": "audio/pcmu"}, "turn_detection": None}},
        }
        await r.send(type="session.update", session=update)
        await r.until("session.updated")
        ulaw = base64.b64encode(b"\xff" * 1600).decode()  # 200 ms of mu-law silence at 8 kHz
        item = {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": ulaw}]}
        await r.send(type="conversation.item.create", item=item)
        await r.until("conversation.item.done")
        await r.send(type="response.create")
        await r.until("response.done")
        request = engine.submitted[-1]
        assert abs(len(request.audio) / 2 / request.sample_rate - 0.2) < 0.005
