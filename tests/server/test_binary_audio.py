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


# --- our client ------------------------------------------------------------------------------


@pytest.fixture
def frames_sent(monkeypatch) -> list[str]:
    """The kind of every frame our client writes, appends only: "binary" or "text"."""
    from websockets.asyncio.client import ClientConnection

    sent: list[str] = []
    send = ClientConnection.send

    async def spy(self, message, *args, **kwargs):
        if isinstance(message, bytes):
            sent.append("binary")
        elif json.loads(message).get("type") == "input_audio_buffer.append":
            sent.append("text")
        return await send(self, message, *args, **kwargs)

    monkeypatch.setattr(ClientConnection, "send", spy)
    return sent


async def _committed_ms(client) -> int:
    await client.commit()
    committed, before = await client.wait_for("input_audio_buffer.committed")
    assert not [e for e in before if e["type"] == "error"], before
    return committed["audio_ms"]


@pytest.mark.anyio
async def test_our_client_sends_binary_frames_only_while_the_server_confirms_them(frames_sent):
    """Text until the server's session.updated says the extension is on (an append sent while
    the update is unanswered is text too), binary after; back to text at once when the client
    turns it off, before the server has answered. Every append is accepted and committed."""
    from duplex_actors.client import DuplexClient

    async with running_server() as server, await DuplexClient.connect(server.url) as client:
        await client.wait_for("session.created")
        assert await client.send_audio(CHUNK_100MS) is not None  # text: an event_id
        await client.update_session({"turn_detection": None, "duplex": {"binary_audio": True}})
        await client.send_audio(CHUNK_100MS)  # the update is unanswered: text still
        await client.wait_for("session.updated")
        assert client.binary_audio
        assert await client.send_audio(CHUNK_100MS) is None  # binary: no event_id
        await client.send_audio(CHUNK_100MS)
        assert await _committed_ms(client) == 400
        assert frames_sent == ["text", "text", "binary", "binary"]

        await client.update_session({"duplex": {"binary_audio": False}})
        assert not client.binary_audio  # before the answer: the server may apply it any moment
        await client.send_audio(CHUNK_100MS)
        updated, _ = await client.wait_for("session.updated")
        assert "binary_audio" not in updated["session"]["duplex"] and not client.binary_audio
        await client.send_audio(CHUNK_100MS)
        assert await _committed_ms(client) == 200
        assert frames_sent[4:] == ["text", "text"]


@pytest.mark.anyio
async def test_our_client_stays_on_text_when_the_update_is_refused(frames_sent):
    """All or nothing: an update that turns the extension on with a field the server refuses
    changes nothing, so the client keeps sending text frames, which are accepted."""
    from duplex_actors.client import DuplexClient

    async with running_server() as server, await DuplexClient.connect(server.url) as client:
        await client.wait_for("session.created")
        bad = {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 12345}}}}
        update_id = await client.update_session({**bad, "duplex": {"binary_audio": True}})
        error, _ = await client.wait_for("error")
        assert error["error"]["event_id"] == update_id
        assert not client.binary_audio
        await client.send_audio(CHUNK_100MS)
        assert await _committed_ms(client) == 100
        assert frames_sent == ["text"]


@pytest.mark.anyio
async def test_our_client_keeps_binary_frames_across_a_resume(frames_sent):
    """The extension is the session's, not the connection's: after a dropped connection and
    a resume, the client's appends are still binary and still accepted."""
    from duplex_actors.client import DuplexClient

    async with running_server() as server, await DuplexClient.connect(server.url) as client:
        await client.wait_for("session.created")
        await client.update_session({"turn_detection": None, "duplex": {"binary_audio": True}})
        await client.wait_for("session.updated")
        await client.send_audio(CHUNK_100MS)
        await client.heartbeat()  # its ack: the server has read the audio before it
        await client.wait_for("heartbeat.ack")
        client.abort_transport()
        await client.wait_for("session.resumed")
        assert client.reconnects == 1 and client.binary_audio
        await client.send_audio(CHUNK_100MS)
        assert await _committed_ms(client) == 200
        assert frames_sent == ["binary", "binary"]


@pytest.mark.anyio
async def test_our_client_falls_back_to_text_when_a_drop_leaves_an_update_unanswered():
    """An update the old connection carried and the replay did not answer may be lost, or its
    answer may still come: after the resume the client sends text until an answer arrives."""
    from duplex_actors.client import DuplexClient

    client = DuplexClient("ws://127.0.0.1:1/v1/realtime")
    await client._on_message(json.dumps({"type": "session.created", "session": {"id": "s"}}))
    await client._on_message(
        json.dumps({"type": "session.updated", "session": {"duplex": {"binary_audio": True}}})
    )
    assert client.binary_audio
    client._updates_unanswered.append("c_update")  # as send() records an update it writes
    await client._on_message(json.dumps({"type": "session.resumed", "generation": 1}))
    assert not client.binary_audio and not client._updates_unanswered
    await client._on_message(
        json.dumps({"type": "session.updated", "session": {"duplex": {"binary_audio": True}}})
    )
    assert client.binary_audio


@pytest.mark.anyio
async def test_an_answer_to_an_older_update_does_not_switch_our_client_to_binary():
    """On, then off before the first is answered: the server may encode its answer to the first
    ("on") before it reads the second, which it then applies before anything sent after it. So
    the client stays on text until its last update is answered. (The server's timing decides
    whether a live run shows this; here the answers come in that order by hand.)"""
    from duplex_actors.client import DuplexClient

    client = DuplexClient("ws://127.0.0.1:1/v1/realtime")
    written: list[str | bytes] = []

    async def write(frame: str | bytes) -> None:
        written.append(frame)

    client._send_frame = write  # type: ignore[method-assign]
    on = {"type": "session.updated", "session": {"duplex": {"binary_audio": True}}}
    off = {"type": "session.updated", "session": {"duplex": {}}}
    await client._on_message(json.dumps({"type": "session.created", "session": {"id": "s"}}))
    await client.update_session({"duplex": {"binary_audio": True}})
    await client.update_session({"duplex": {"binary_audio": False}})
    await client._on_message(json.dumps(on))  # the first update's answer
    assert await client.send_audio(CHUNK_100MS) is not None  # text: the second is unanswered
    await client._on_message(json.dumps(off))
    await client.send_audio(CHUNK_100MS)
    await client.update_session({"duplex": {"binary_audio": True}})
    await client._on_message(json.dumps(on))
    assert await client.send_audio(CHUNK_100MS) is None
    kinds = [type(frame) for frame in written]
    assert kinds == [str, str, str, str, str, bytes]
