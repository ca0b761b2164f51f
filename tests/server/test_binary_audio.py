"""The binary-audio extension (docs/protocol.md): once a session turns it on with
``session.update`` ``duplex.binary_audio: true``, a binary websocket frame is an
``input_audio_buffer.append`` of its raw bytes, in the declared input format, with the same
checks; off (the default), a binary frame is refused as before."""

from __future__ import annotations

import base64
import json

import pytest
from websockets.asyncio.client import connect

from duplex_actors.core import commands as cmd
from duplex_actors.server import wire
from duplex_actors.server.audio_format import PCM, AudioFormat

from .conftest import CHUNK_100MS, recv_json, recv_until, running_server

PCM_20MS_24K = bytes(range(256)) * 3 + bytes(192)  # 960 bytes


def test_a_binary_frame_is_refused_unless_the_extension_is_on():
    with pytest.raises(wire.InvalidFrame):
        wire.decode(PCM_20MS_24K, sample_rate=24000)


def test_a_binary_frame_reads_as_the_same_append_in_text():
    text = json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(PCM_20MS_24K).decode()})
    as_text = wire.decode(text, sample_rate=24000)
    as_bytes = wire.decode(PCM_20MS_24K, sample_rate=24000, binary_audio=True)
    assert isinstance(as_bytes, cmd.AppendAudio) and as_bytes == as_text
    # declared 24 kHz into a 16 kHz session: handed on for conversion, as a text append is
    declared = AudioFormat(PCM, 24000)
    converted = wire.decode(PCM_20MS_24K, sample_rate=16000, input_format=declared, binary_audio=True)
    assert converted == wire.decode(text, sample_rate=16000, input_format=declared)
    assert isinstance(converted, wire.EncodedAudio)


@pytest.mark.parametrize(
    ("frame", "error"),
    [
        (b"", wire.InvalidAudio),
        (b"\x01\x00\x02", wire.InvalidAudio),  # odd length for pcm16
        (bytes(300), wire.ChunkTooLarge),
    ],
)
def test_a_binary_frame_gets_the_checks_of_an_append(frame, error):
    with pytest.raises(error):
        wire.decode(frame, wire.WireLimits(max_chunk_bytes=256), sample_rate=24000, binary_audio=True)


def test_session_update_turns_it_on_and_off_and_refuses_a_non_boolean():
    def update(value):
        return wire.decode(
            json.dumps({"type": "session.update", "session": {"duplex": {"binary_audio": value}}})
        )

    assert update(True).binary_audio is True
    assert update(False).binary_audio is False
    assert wire.decode(json.dumps({"type": "session.update", "session": {}})).binary_audio is None
    with pytest.raises(wire.InvalidField):
        update("yes")


@pytest.mark.anyio
async def test_binary_audio_over_the_wire():
    """On: binary frames fill the input buffer (2 x 100 ms committed, echoed in
    session.updated); off again: a binary frame is an invalid_frame error, the session goes on."""
    async with running_server() as server, connect(server.url) as ws:
        assert (await recv_json(ws))["type"] == "session.created"
        session = {
            "type": "realtime",
            "audio": {"input": {"turn_detection": None}},
            "duplex": {"binary_audio": True},
        }
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        updated = (await recv_until(ws, "session.updated"))[-1]
        assert updated["session"]["duplex"]["binary_audio"] is True
        await ws.send(CHUNK_100MS)
        await ws.send(CHUNK_100MS)
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        committed = (await recv_until(ws, "input_audio_buffer.committed"))[-1]
        assert committed["audio_ms"] == 200
        await ws.send(json.dumps({"type": "session.update", "session": {"duplex": {"binary_audio": False}}}))
        updated = (await recv_until(ws, "session.updated"))[-1]
        assert "binary_audio" not in updated["session"]["duplex"]
        await ws.send(CHUNK_100MS)
        error = (await recv_until(ws, "error"))[-1]
        assert error["error"]["code"] == "invalid_frame"
        await ws.send(
            json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(CHUNK_100MS).decode()})
        )
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        committed = (await recv_until(ws, "input_audio_buffer.committed"))[-1]
        assert committed["audio_ms"] == 100
