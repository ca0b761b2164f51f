"""The writer sends the events ready at one wake-up in one socket write, within its caps,
and the client still reads every event, in order, over a real socket."""

from __future__ import annotations

import base64
import json

import pytest
from websockets.asyncio.client import connect

from duplex_actors import Script
from duplex_actors.server import session_connection, ws_internals

from .conftest import CHUNK_100MS, recv_json, recv_until, running_server

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

# Unpaced: the whole response (about 45 events) is ready at once.
BURSTY = Script(tokens=tuple(f" w{i}" for i in range(20)), audio_packets=20, packet_ms=20)


class _CountingTransport:
    """The connection's transport, its writes counted. A stand-in rather than a patched
    ``write``: uvloop's transports are C objects whose methods cannot be replaced."""

    def __init__(self, transport, calls: list[int]) -> None:
        self._transport = transport
        self._calls = calls

    def write(self, data) -> None:
        self._calls.append(len(data))
        self._transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


@pytest.fixture
def writes(monkeypatch):
    """Every burst the writer sent: (frames in it, socket writes it took, event types)."""
    send_burst = ws_internals.send_burst
    seen: list[tuple[int, int, list[str]]] = []

    async def counting_send_burst(ws, frames):
        transport = ws.transport
        calls: list[int] = []
        ws.transport = _CountingTransport(transport, calls)
        try:
            cost = await send_burst(ws, frames)
        finally:
            ws.transport = transport
        seen.append((len(frames), len(calls), [json.loads(f)["type"] for f in frames]))
        return cost

    monkeypatch.setattr(ws_internals, "send_burst", counting_send_burst)
    return seen


async def _turn(url: str) -> list[dict]:
    async with connect(url) as ws:
        events = [await recv_json(ws)]
        await ws.send(
            json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(CHUNK_100MS).decode()})
        )
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))
        events += await recv_until(ws, "response.done", timeout=20)
        events.append(await recv_json(ws))  # rate_limits.updated follows response.done
        return events


def _in_order(events: list[dict]) -> bool:
    seqs = [e["server_event_seq"] for e in events if e.get("server_event_seq") is not None]
    return seqs == list(range(seqs[0], seqs[0] + len(seqs)))


async def test_a_burst_of_ready_events_goes_out_in_one_socket_write(writes):
    async with running_server(BURSTY) as server:
        events = await _turn(server.url)
    assert events[-2]["type"] == "response.done" and events[-2]["response"]["status"] == "completed"
    assert events[-1]["type"] == "rate_limits.updated"
    assert _in_order(events)
    assert sum(frames for frames, _, _ in writes) >= len(events)
    assert any(frames > 1 for frames, _, _ in writes), writes
    assert all(socket_writes == 1 for _, socket_writes, _ in writes), writes
    # Audio is not held back behind the events queued after it.
    for _, _, types in writes:
        assert "response.output_audio.delta" not in types[:-1], types


# The caps are checked between events, and one event is at most two frames (response.done and
# its rate_limits.updated): a burst ends after the event that reaches a cap.
@pytest.mark.parametrize(("cap", "value", "most"), [("BURST_MAX_FRAMES", 3, 4), ("BURST_MAX_BYTES", 1, 2)])
async def test_a_long_burst_is_cut_at_the_caps_and_nothing_is_lost(monkeypatch, writes, cap, value, most):
    monkeypatch.setattr(session_connection, cap, value)
    async with running_server(BURSTY) as server:
        events = await _turn(server.url)
    assert events[-2]["response"]["status"] == "completed"
    assert _in_order(events)
    assert max(frames for frames, _, _ in writes) <= most
    assert len(writes) >= len(events) // most
