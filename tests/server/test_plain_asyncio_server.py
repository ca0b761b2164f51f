"""The server embedded under a plain ``asyncio.run`` (nothing names the async library there):
appends handled as websockets parses them, in the connection's callbacks, still start the
engine work they complete (actors/async_library.py; the runtime's side:
tests/runtime/test_plain_asyncio.py)."""

from __future__ import annotations

import asyncio
import base64
import json

import anyio
from websockets.asyncio.client import connect

from duplex_actors import Script
from duplex_actors.core.engine_io import TurnKind

from .conftest import count_offers, recv_json, recv_until, running_server


def test_model_native_units_completed_by_appends_handled_as_parsed_reach_the_engine(monkeypatch):
    offers = count_offers(monkeypatch)
    update = {
        "type": "session.update",
        "session": {
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": None}},
            "duplex": {"model_native": True},
        },
    }
    chunk = base64.b64encode(b"\x01\x00" * 320).decode()  # 20 ms at 16 kHz; a unit is 1 s

    async def main() -> None:
        async with running_server(Script(speak=False), audio_intake_rate=None) as server:
            engine = server.runtime.backend
            async with connect(server.url) as ws:
                await recv_json(ws)
                await ws.send(json.dumps(update))
                await recv_until(ws, "session.updated")
                for _ in range(150):  # 3 s: three units, each completed by an append
                    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
                    await anyio.sleep(0.003)
                with anyio.fail_after(5):
                    while sum(r.kind is TurnKind.UNIT for r in engine.submitted) < 3:
                        await anyio.sleep(0.01)
                assert server.metrics.frames.labels("rejected")._value.get() == 0
        assert offers.taken >= 100, offers.taken  # most appends were handled in the connection's callbacks

    asyncio.run(main())
