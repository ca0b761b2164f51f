"""The server on uvloop's event loop, which an application embedding RealtimeServer may run:
over TCP and over TLS, a session streams audio, gets its answer and closes, and the server
shuts down clean. uvloop's transports are C objects: the close used to fail on a TCP one (no
``__dict__``, read by ws_internals) and on a TLS one (no weak references, taken by
lingering.py), in every connection's teardown."""

from __future__ import annotations

import base64
import json
import ssl

import pytest
from websockets.asyncio.client import connect

from duplex_actors.server.lingering import LINGERING

from .conftest import CHUNK_100MS, recv_json, recv_until, running_server
from .test_console import self_signed

pytest.importorskip("uvloop")
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return ("asyncio", {"use_uvloop": True})


async def _a_turn(url: str, **connect_kw) -> None:
    async with connect(url, **connect_kw) as ws:
        assert (await recv_json(ws))["type"] == "session.created"
        await ws.send(
            json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        )
        await recv_until(ws, "session.updated")
        audio = base64.b64encode(CHUNK_100MS).decode()
        for _ in range(5):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))
        done = (await recv_until(ws, "response.done"))[-1]
        assert done["response"]["status"] == "completed"


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
async def test_a_session_on_uvloop_answers_and_closes_clean(tmp_path, tls):
    import asyncio

    import uvloop

    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
    connect_kw = {}
    files = {}
    if tls:
        cert, key = self_signed(tmp_path)
        files = {"tls_cert": str(cert), "tls_key": str(key)}
        connect_kw = {"ssl": ssl.create_default_context(cafile=str(cert))}
    closed = LINGERING.connections
    async with running_server(**files) as server:
        for _ in range(3):
            await _a_turn(server.url, **connect_kw)
        assert server.metrics.disconnects.labels("flood")._value.get() == 0
    # every close was seen (counted while its connection is still alive, as on asyncio's loop)
    assert LINGERING.connections >= closed
