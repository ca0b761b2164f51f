"""Bad input never hurts: each malformed frame gets an error event, the session survives and
keeps everything it had accepted."""

from __future__ import annotations

import base64
import json

import pytest
from websockets.asyncio.client import connect

from duplex_actors import Script
from duplex_actors.core.conversation import PART_BYTES
from duplex_actors.server.wire import WireLimits
from duplex_actors.server.wire_items import MAX_CONTENT_PARTS

from .conftest import CHUNK_100MS, recv_json, recv_until, running_server

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

LIMITS = {"max_frame_bytes": 64 * 1024, "max_chunk_bytes": 16 * 1024}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


BAD_FRAMES = [
    ("not json at all", "invalid_json", None),
    ('{"type": "input_audio_buffer.append", "audio": ', "invalid_json", None),
    ('["input_audio_buffer.commit"]', "invalid_json", None),
    (json.dumps({"type": "no.such.event", "event_id": "e1"}), "unknown_event_type", "e1"),
    (json.dumps({"event_id": "e2"}), "invalid_value", "e2"),
    (json.dumps({"type": "input_audio_buffer.append", "event_id": "e3"}), "invalid_value", "e3"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": 12, "event_id": "e4"}), "invalid_value", "e4"),
    (
        json.dumps({"type": "input_audio_buffer.append", "audio": "%%%not-base64", "event_id": "e5"}),
        "invalid_audio",
        "e5",
    ),
    (
        json.dumps({"type": "input_audio_buffer.append", "audio": b64(b"\0\0\0"), "event_id": "e6"}),
        "invalid_audio",
        "e6",
    ),
    (
        json.dumps(
            {
                "type": "input_audio_buffer.append",
                "audio": b64(b"\0\0"),
                "sample_rate": 44100,
                "event_id": "e7",
            }
        ),
        "invalid_command",
        "e7",
    ),
    (
        json.dumps(
            {
                "type": "input_audio_buffer.append",
                "audio": b64(b"\0\0"),
                "sample_rate": 16000,
                "event_id": "e8",
            }
        ),
        "invalid_command",
        "e8",
    ),
    (
        json.dumps({"type": "input_audio_buffer.append", "audio": b64(b"\0" * 20_000), "event_id": "e9"}),
        "chunk_too_large",
        "e9",
    ),
    (json.dumps({"type": "heartbeat", "pad": "x" * 70_000, "event_id": "e10"}), "frame_too_large", None),
    (json.dumps({"type": "session.update", "session": "fast", "event_id": "e11"}), "invalid_value", "e11"),
    (
        json.dumps(
            {
                "type": "session.update",
                "session": {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 8000}}}},
                "event_id": "e12",
            }
        ),
        "unsupported_audio_format",
        "e12",
    ),
    (json.dumps({"type": "response.cancel", "event_id": "e13"}), "response_cancel_not_active", "e13"),
    (
        json.dumps({"type": "conversation.item.create", "item": {"type": "message"}, "event_id": "e14"}),
        "invalid_value",
        "e14",
    ),
    (
        json.dumps({"type": "conversation.item.delete", "item_id": "x", "event_id": "e15"}),
        "item_delete_invalid_item_id",
        "e15",
    ),
    (
        json.dumps({"type": "response.cancel", "response_id": "resp_x", "event_id": "e19"}),
        "response_cancel_not_active",
        "e19",
    ),
    (
        json.dumps(
            {
                "type": "conversation.item.truncate",
                "item_id": "x",
                "content_index": 0,
                "audio_end_ms": 5,
                "event_id": "e20",
            }
        ),
        "item_truncate_invalid_item_id",
        "e20",
    ),
    (
        json.dumps({"type": "input_audio_buffer.commit", "epoch": -3, "event_id": "e16"}),
        "invalid_value",
        "e16",
    ),
    (
        json.dumps({"type": "duplex.playback_ack", "response_id": "r", "event_id": "e17"}),
        "invalid_value",
        "e17",
    ),
    (
        json.dumps(
            {
                "type": "session.resume",
                "session_id": "s",
                "generation": 0,
                "resume_token": "t",
                "event_id": "e18",
            }
        ),
        "invalid_event",
        "e18",
    ),
    (json.dumps({"type": "heartbeat", "event_id": ["not", "a", "string"]}), "invalid_value", None),
    ("\u0000\u0001\u0002", "invalid_json", None),
]


async def test_each_bad_frame_gets_its_error_and_accepted_audio_is_kept():
    async with running_server(limits=WireLimits(**LIMITS)) as server:
        async with connect(server.url) as ws:
            assert (await recv_json(ws))["type"] == "session.created"
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(CHUNK_100MS)}))
            for text, code, event_id in BAD_FRAMES:
                await ws.send(text)
                event = await recv_json(ws)
                assert event["type"] == "error", (text[:60], event)
                assert event["error"]["code"] == code, (text[:60], event)
                assert event["error"]["message"]
                assert event["error"]["event_id"] == event_id
                assert isinstance(event["server_event_seq"], int)
            await ws.send(b"\x00binary")
            event = await recv_json(ws)
            assert event["error"]["code"] == "invalid_frame"
            # still the same session, and the 100 ms accepted before the garbage is all there
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(CHUNK_100MS)}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "response.create"}))
            events = await recv_until(ws, "response.done")
            committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
            assert committed["audio_ms"] == 200  # 24 kHz on the wire, every sample in the session
            assert events[-1]["response"]["status"] == "completed"
        sent_errors = sum(
            server.metrics.client_errors.labels(code)._value.get()
            for code in {c for _, c, _ in BAD_FRAMES} | {"invalid_frame"}
        )
        assert sent_errors == len(BAD_FRAMES) + 1
        # four were well-formed and refused by the session itself (two cancels with nothing to
        # cancel, an unknown item deleted and truncated): the codec refused the rest
        session_refused = {"e13", "e15", "e19", "e20"}
        rejected = server.metrics.frames.labels("rejected")._value.get()
        assert rejected == len(BAD_FRAMES) + 1 - len(session_refused)


async def test_frames_past_the_transport_cap_drop_only_that_connection():
    async with running_server(limits=WireLimits(max_frame_bytes=1024)) as server:
        async with connect(server.url) as bystander:
            await recv_json(bystander)
            ws = await connect(server.url, max_size=None)
            sid = (await recv_json(ws))["session"]["id"]
            await ws.send(json.dumps({"type": "heartbeat", "pad": "x" * 10_000}))
            with pytest.raises(Exception):
                for _ in range(5):
                    await recv_json(ws)
            assert ws.close_code == 1009  # message too big
            handle = server.runtime.get(sid)
            assert handle.state != "closed"  # detached, resumable
            await bystander.send(json.dumps({"type": "heartbeat"}))
            assert (await recv_json(bystander))["type"] == "heartbeat.ack"


async def test_a_client_that_stops_reading_does_not_slow_the_others():
    from duplex_actors import Script

    chatty = Script(tokens=tuple("x" * 50), audio_packets=200, packet_ms=100)
    async with running_server(chatty) as server:
        stalled = await connect(server.url, max_queue=1)  # its library stops reading early
        await recv_json(stalled)
        await stalled.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(CHUNK_100MS)}))
        await stalled.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await stalled.send(json.dumps({"type": "response.create"}))
        # ~6 MB of audio deltas are now queued towards a reader that never reads
        async with connect(server.url) as healthy:
            await recv_json(healthy)
            for _ in range(3):
                await healthy.send(json.dumps({"type": "heartbeat"}))
                event = await recv_until(healthy, "heartbeat.ack", timeout=2.0)
                assert event[-1]["type"] == "heartbeat.ack"
        stalled.transport.abort()


async def test_refused_cancels_and_creates_use_openai_words_which_clients_match_on():
    # livekit's realtime plugin lets an error through quietly only if its message starts with
    # "Cancellation failed" (a cancel meeting a response that just ended is routine for it);
    # ours read "'cancel' is not allowed in state 'idle'", so it logged an error every time.
    script = Script(token_latency_s=0.05, tokens=("a",) * 20)
    async with running_server(script) as server:
        async with connect(server.url) as ws:
            assert (await recv_json(ws))["type"] == "session.created"
            await ws.send(json.dumps({"type": "response.cancel", "event_id": "c1"}))
            error = (await recv_until(ws, "error"))[-1]["error"]
            assert error["code"] == "response_cancel_not_active"
            assert error["message"] == "Cancellation failed: no active response found"
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "event_id": "c0"}))
            error = (await recv_until(ws, "error"))[-1]["error"]
            assert error["code"] == "input_audio_buffer_commit_empty"
            assert error["message"].startswith("Error committing input audio buffer: buffer too small.")
            await ws.send(json.dumps({"type": "response.create"}))
            await recv_until(ws, "response.created")
            await ws.send(json.dumps({"type": "response.create", "event_id": "c2"}))
            error = (await recv_until(ws, "error"))[-1]["error"]
            assert error["code"] == "conversation_already_has_active_response"
            assert error["message"].startswith("Conversation already has an active response")
            assert error["event_id"] == "c2"


async def test_an_image_in_a_user_message_is_kept_as_a_marker_not_refused():
    # pipecat ends its session on any error event but two: a single camera frame (a user
    # message with an input_image part, which we refused as not_supported) killed the call.
    image = "data:image/jpeg;base64," + b64(b"\xff\xd8" + b"\x00" * 30_000)
    async with running_server() as server:
        async with connect(server.url) as ws:
            assert (await recv_json(ws))["type"] == "session.created"
            content = [
                {"type": "input_text", "text": "what is this?"},
                {"type": "input_image", "image_url": image},
            ]
            await ws.send(
                json.dumps(
                    {
                        "type": "conversation.item.create",
                        "item": {"type": "message", "role": "user", "content": content},
                    }
                )
            )
            added = (await recv_until(ws, "conversation.item.added"))[-1]["item"]
            assert added["content"] == [
                {"type": "input_text", "text": "what is this?"},
                {"type": "input_image"},
            ]
            (handle,) = server.runtime.sessions()
            core = handle.core
            assert core._conversation.chars == len("what is this?")  # the image is not kept
            assert core._pending_words() == "what is this?"  # nor read
            # Only a user may show one (GA): on a system message it is still refused.
            content = [{"type": "input_image", "image_url": image}]
            await ws.send(
                json.dumps(
                    {
                        "type": "conversation.item.create",
                        "item": {"type": "message", "role": "system", "content": content},
                    }
                )
            )
            error = (await recv_until(ws, "error"))[-1]["error"]
            assert (error["code"], error["param"]) == ("invalid_value", "item.content[0].type")


async def test_an_item_of_more_parts_than_a_message_has_is_refused_and_what_its_parts_hold_is_counted():
    # Parts that hold no text (an image's marker, an empty text) counted nowhere: an item of
    # 9,990 image markers (230 KB, a kilobyte deflated) took ~0.7 MiB of the session's memory,
    # and a conversation keeps 256 items.
    async with running_server() as server:
        async with connect(server.url) as ws:
            assert (await recv_json(ws))["type"] == "session.created"
            (handle,) = server.runtime.sessions()
            for kind, part in (
                ("image", {"type": "input_image"}),
                ("empty", {"type": "input_text", "text": ""}),
            ):
                for where in ("conversation.item.create", "response.create"):
                    item = {"type": "message", "role": "user", "content": [part] * (MAX_CONTENT_PARTS + 1)}
                    if where == "conversation.item.create":
                        frame, param = {"type": where, "item": item}, "item.content"
                    else:
                        frame = {"type": where, "response": {"conversation": "none", "input": [item]}}
                        param = "response.input[0].content"
                    await ws.send(json.dumps(frame))
                    error = (await recv_until(ws, "error"))[-1]["error"]
                    assert (error["code"], error["param"]) == ("invalid_value", param), (kind, error)
                    assert f"more than {MAX_CONTENT_PARTS} parts" in error["message"]
                assert len(handle.core._conversation) == 0
            # As many as a message may have are taken, and the text budget counts each part.
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_image"}] * MAX_CONTENT_PARTS,
            }
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            added = (await recv_until(ws, "conversation.item.added"))[-1]["item"]
            assert len(added["content"]) == MAX_CONTENT_PARTS
            assert handle.core._conversation.held_bytes == MAX_CONTENT_PARTS * PART_BYTES
            assert handle.core._text_account.held >= MAX_CONTENT_PARTS * PART_BYTES
