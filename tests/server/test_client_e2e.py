"""Our client against a live server over loopback: the whole turn, cancel, barge-in, extensions."""

from __future__ import annotations

import anyio
import pytest

from duplex_actors import Script
from duplex_actors.client import AuthenticationFailed, DuplexClient

from .conftest import CHUNK_100MS, running_server

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

# GA order of an audio response (the session default): its words stream once, as the transcript.
RESPONSE_ORDER = [
    "response.created",
    "response.output_item.added",
    "conversation.item.added",
    "response.content_part.added",
]
CLOSING_ORDER = [
    "response.output_audio.done",
    "response.output_audio_transcript.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
]


def assert_response_shape(events: list[dict]) -> None:
    types = [e["type"] for e in events]
    start = types.index("response.created")
    body = types[start:]
    assert body[:4] == RESPONSE_ORDER
    assert body[-len(CLOSING_ORDER) :] == CLOSING_ORDER
    middle = body[4 : -len(CLOSING_ORDER)]
    assert middle and all(t.endswith(".delta") for t in middle)
    assert "response.output_text.delta" not in middle  # no words twice
    rid = events[start]["response"]["id"]
    assert all(e.get("response_id", rid) == rid for e in events[start:-1])
    assert events[-1]["response"]["id"] == rid


async def test_full_turn_streams_a_response_in_order(server):
    async with await DuplexClient.connect(server.url) as client:
        created = await client.recv()
        assert created["type"] == "session.created"
        assert client.session_id == created["session"]["id"] and client.resume_token
        for _ in range(3):
            await client.send_audio(CHUNK_100MS)
        await client.commit()
        await client.create_response()
        done, before = await client.wait_for("response.done")
        events = before + [done]
        committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
        assert committed["audio_ms"] == 300  # all three chunks arrived
        assert_response_shape(events)
        assert done["response"]["status"] == "completed"
        assert done["response"]["metrics"]["ttft_ms"] is not None
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
        assert text == "".join(Script().tokens)
        rate_limits, _ = await client.wait_for("rate_limits.updated")  # after each response
        assert rate_limits["server_event_seq"] is None
        seqs = [created["server_event_seq"]] + [e["server_event_seq"] for e in events]
        assert seqs == list(range(1, len(seqs) + 1))
        assert all(e["epoch"] == 0 for e in events)


async def test_cancel_ends_the_response_once_with_client_cancelled():
    async with running_server(Script(token_latency_s=0.05, tokens=("a",) * 40)) as server:
        async with await DuplexClient.connect(server.url) as client:
            await client.recv()
            await client.update_session({"turn_detection": None})
            updated, _ = await client.wait_for("session.updated")
            assert updated["session"]["audio"]["input"]["turn_detection"] is None
            assert updated["session"]["duplex"]["auto_respond"] is False
            await client.send_audio(CHUNK_100MS)
            await client.commit()
            await client.wait_for("input_audio_buffer.committed")
            await client.create_response(instructions="count")
            await client.wait_for("response.output_audio_transcript.delta")
            await client.cancel()
            done, _ = await client.wait_for("response.done")
            assert done["response"]["status"] == "cancelled"
            assert done["response"]["status_details"]["reason"] == "client_cancelled"
            # Nothing of the cancelled response follows its response.done; a heartbeat
            # proves the stream is live and quiet.
            await client.heartbeat()
            ack, between = await client.wait_for("heartbeat.ack")
            assert not [e for e in between if e.get("response_id") == done["response"]["id"]]
            assert ack["epoch"] == 1  # cancel moved the epoch


async def test_barge_in_cancels_with_turn_detected_and_is_counted():
    async with running_server(Script(token_latency_s=0.05, tokens=("a",) * 40)) as server:
        async with await DuplexClient.connect(server.url) as client:
            await client.recv()
            await client.send_audio(CHUNK_100MS)
            await client.commit()
            await client.create_response()
            await client.wait_for("response.output_audio_transcript.delta")
            await client.barge_in()
            done, _ = await client.wait_for("response.done")
            assert done["response"]["status"] == "cancelled"
            assert done["response"]["status_details"]["reason"] == "turn_detected"
            assert done["response"]["metrics"]["stop_latency_ms"] is not None
            # listening again: a new turn works
            await client.send_audio(CHUNK_100MS)
            await client.commit()
            await client.create_response()
            await client.cancel()
            second, _ = await client.wait_for("response.done")
            assert second["response"]["id"] != done["response"]["id"]
        assert server.metrics.barge_ins._value.get() == 1


async def test_extensions_heartbeat_playback_ack_and_truncate(server):
    async with await DuplexClient.connect(server.url) as client:
        await client.recv()
        await client.heartbeat()
        ack, _ = await client.wait_for("heartbeat.ack")
        assert ack["server_event_seq"] == 2
        await client.send_audio(CHUNK_100MS)
        await client.commit()
        await client.create_response()
        done, events = await client.wait_for("response.done")
        item = next(e for e in events if e["type"] == "response.output_item.added")["item"]["id"]
        await client.ack_playback(done["response"]["id"], 120)
        await client.send(
            {"type": "conversation.item.truncate", "item_id": item, "content_index": 0, "audio_end_ms": 15}
        )
        truncated, between = await client.wait_for("conversation.item.truncated")
        assert (truncated["item_id"], truncated["audio_end_ms"]) == (item, 15)
        assert not [e for e in between if e["type"] == "error"]  # the ack was accepted
        bad = await client.send(
            {
                "type": "conversation.item.truncate",
                "item_id": "item_nope",
                "content_index": 0,
                "audio_end_ms": 1,
            }
        )
        backwards = await client.ack_playback(done["response"]["id"], 10)
        # Two refusals, nothing else: the unknown item (a data-lane frame) and the backwards ack
        # (control lane, which is drained first, so their order is not fixed).
        first, _ = await client.wait_for("error")
        second, _ = await client.wait_for("error")
        refusals = {e["error"]["event_id"]: e["error"]["code"] for e in (first, second)}
        assert refusals[bad] == "item_truncate_invalid_item_id"
        assert backwards in refusals  # played_ms cannot go backwards
        playback = server.runtime.get(client.session_id).core._playback.snapshot()
        assert playback == {done["response"]["id"]: 120, item: 15}


async def test_illegal_in_state_is_an_error_event_and_the_session_carries_on(server):
    async with await DuplexClient.connect(server.url) as client:
        await client.recv()
        commit_id = await client.commit()
        error, _ = await client.wait_for("error")
        assert error["error"]["code"] == "input_audio_buffer_commit_empty"
        assert error["error"]["event_id"] == commit_id
        cancel_id = await client.cancel()
        error, _ = await client.wait_for("error")
        assert (error["error"]["code"], error["error"]["event_id"]) == (
            "response_cancel_not_active",
            cancel_id,
        )
        await client.send_audio(CHUNK_100MS)
        await client.commit()
        await client.create_response()
        done, _ = await client.wait_for("response.done")
        assert done["response"]["status"] == "completed"


async def test_clean_client_close_closes_the_session(server):
    client = await DuplexClient.connect(server.url)
    await client.recv()
    session_id = client.session_id
    assert server.runtime.session_count == 1
    await client.close()
    with anyio.fail_after(5):
        while server.runtime.session_count:
            await anyio.sleep(0.01)
    with pytest.raises(Exception):
        server.runtime.get(session_id)


async def test_session_close_event_ends_the_stream_with_session_closed(server):
    async with await DuplexClient.connect(server.url) as client:
        await client.recv()
        await client.send({"type": "session.close"})
        seen = [e["type"] async for e in client.events()]
        assert seen[-1] == "session.closed" and client.session_closed


async def test_many_clients_in_parallel_each_get_their_own_session(server):
    results: dict[int, str] = {}

    async def one(i: int) -> None:
        async with await DuplexClient.connect(server.url) as client:
            await client.recv()
            await client.send_audio(CHUNK_100MS)
            await client.commit()
            await client.create_response()
            done, _ = await client.wait_for("response.done", timeout=10)
            results[i] = client.session_id
            assert done["response"]["status"] == "completed"

    async with anyio.create_task_group() as tg:
        for i in range(20):
            tg.start_soon(one, i)
    assert len(set(results.values())) == 20


async def test_wrong_api_key_is_refused_by_the_client_with_the_status():
    async with running_server(api_key="sekret") as server:
        with pytest.raises(AuthenticationFailed) as info:
            await DuplexClient.connect(server.url, api_key="wrong")
        assert info.value.status == 401
        async with await DuplexClient.connect(server.url, api_key="sekret") as client:
            assert (await client.recv())["type"] == "session.created"
