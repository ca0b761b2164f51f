"""Engine audio at the client's output rate, over a real socket: the server asks the engine for
audio at the rate the client declared, so the first packet goes out without a resample; an
engine that makes a fixed rate is still converted at the edge."""

from __future__ import annotations

import base64
import json
import warnings

import pytest
from websockets.asyncio.client import connect

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.server import RealtimeServer, ServerConfig

from .conftest import CHUNK_100MS, recv_until

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

pytestmark = pytest.mark.anyio

SCRIPT = Script(tokens=("Hi", " there"), audio_packets=2, packet_ms=40)


async def _one_turn(engine: ScriptedEngine, audio: dict | None = None) -> tuple[list[bytes], set[int]]:
    """A real server on loopback; one session (push-to-talk, plus ``audio`` in its update) and
    one turn: the decoded bytes of its audio deltas and the rates they say they are at."""
    update = {"audio": {"input": {"turn_detection": None}, **(audio or {})}}
    async with Runtime(engine) as rt, RealtimeServer(rt, ServerConfig(host="127.0.0.1", port=0)) as server:
        async with connect(server.url) as ws:
            await recv_until(ws, "session.created")
            await ws.send(json.dumps({"type": "session.update", "session": update}))
            await recv_until(ws, "session.updated")
            await ws.send(
                json.dumps(
                    {"type": "input_audio_buffer.append", "audio": base64.b64encode(CHUNK_100MS).decode()}
                )
            )
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "response.create"}))
            events = await recv_until(ws, "response.done")
    deltas = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert deltas and events[-1]["response"]["status"] == "completed"
    return [base64.b64decode(e["delta"]) for e in deltas], {e["sample_rate"] for e in deltas}


async def test_the_engine_makes_ga_audio_at_24khz_and_it_goes_out_byte_for_byte():
    engine = ScriptedEngine(SCRIPT)
    deltas, rates = await _one_turn(engine)
    (request,) = engine.submitted
    assert (request.sample_rate, request.output_sample_rate) == (16000, 24000)
    assert rates == {24000}
    # The engine's own 24 kHz packet, unconverted: a resample would change its samples.
    assert deltas == [engine._packet(40, 24000)] * 2


async def test_a_new_output_format_changes_the_rate_the_engine_is_asked_for():
    engine = ScriptedEngine(SCRIPT)
    deltas, rates = await _one_turn(engine, {"output": {"format": {"type": "audio/pcma"}}})
    assert engine.submitted[-1].output_sample_rate == 8000
    assert rates == {8000}
    # 8 kHz from the engine, only A-law encoded at the edge.
    assert deltas == [audioop.lin2alaw(engine._packet(40, 8000), 2)] * 2


async def test_an_engine_with_a_fixed_rate_is_still_converted_at_the_edge():
    engine = ScriptedEngine(Script(tokens=("Hi",), audio_packets=1, packet_ms=40, sample_rate=16000))
    deltas, rates = await _one_turn(engine)
    assert engine.submitted[-1].output_sample_rate == 24000  # asked for, but not what it makes
    assert rates == {24000}
    assert [len(d) for d in deltas] == [960 * 2]  # 40 ms at 16 kHz became 40 ms at 24 kHz
