"""The official openai SDK's realtime websocket client, pointed at our server (base URL override)."""

from __future__ import annotations

import base64

import anyio
import pytest

openai = pytest.importorskip("openai")

from duplex_actors import Script  # noqa: E402

from .conftest import CHUNK_100MS_16K, running_server  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

SLOW = Script(token_latency_s=0.03, tokens=tuple(f"t{i} " for i in range(40)))


def field(obj, name):
    """SDK events are pydantic models (dicts for types it does not know)."""
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name)


async def next_of(connection, event_type: str, timeout: float = 5.0, seen: list | None = None):
    with anyio.fail_after(timeout):
        while True:
            event = await connection.recv()
            if seen is not None:
                seen.append(event)
            if field(event, "type") == event_type:
                return event


def sdk_client(server, api_key: str):
    return openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key=api_key, max_retries=0)


def realtime(client):
    # GA SDKs expose client.realtime; older ones only client.beta.realtime
    return client.realtime if hasattr(client, "realtime") else client.beta.realtime


async def test_sdk_session_update_audio_response_and_cancel():
    async with running_server(SLOW, api_key="sk-local") as server:
        client = sdk_client(server, "sk-local")
        async with realtime(client).connect(model="gpt-realtime") as connection:
            created = await next_of(connection, "session.created")
            session_id = field(field(created, "session"), "id")

            await connection.session.update(
                session={
                    "type": "realtime",
                    "instructions": "answer briefly",
                    "audio": {
                        "input": {"format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": None}
                    },
                }
            )
            updated = await next_of(connection, "session.updated")
            session = field(updated, "session")
            assert field(session, "instructions") == "answer briefly"
            handle = server.runtime.get(session_id)
            assert handle.core.config.auto_respond is False

            for _ in range(3):
                await connection.input_audio_buffer.append(audio=base64.b64encode(CHUNK_100MS_16K).decode())
            await connection.input_audio_buffer.commit()
            committed = await next_of(connection, "input_audio_buffer.committed")
            assert field(committed, "item_id")

            await connection.response.create()
            seen: list = []
            created_resp = await next_of(connection, "response.created", seen=seen)
            response_id = field(field(created_resp, "response"), "id")
            delta = await next_of(connection, "response.output_audio_transcript.delta", seen=seen)
            assert field(delta, "delta") == "t0 "
            await connection.response.cancel()
            done = await next_of(connection, "response.done", seen=seen)
            response = field(done, "response")
            assert field(response, "id") == response_id
            assert field(response, "status") == "cancelled"
            types = [field(e, "type") for e in seen]
            assert types.count("response.done") == 1
            assert (
                types.index("response.created")
                < types.index("response.output_item.added")
                < types.index("response.content_part.added")
                < types.index("response.output_audio_transcript.delta")
            )
            assert "response.output_text.delta" not in types  # an audio response: words once

            # a second, uninterrupted response streams to completion
            await connection.response.create(response={"instructions": "again"})
            seen = []
            done = await next_of(connection, "response.done", seen=seen, timeout=10)
            assert field(field(done, "response"), "status") == "completed"
            text = "".join(
                field(e, "delta")
                for e in seen
                if field(e, "type") == "response.output_audio_transcript.delta"
            )
            assert text == "".join(SLOW.tokens)

            # errors reach the SDK as error events carrying our event_id
            await connection.send({"type": "input_audio_buffer.commit", "event_id": "evt_empty"})
            error = await next_of(connection, "error")
            assert field(field(error, "error"), "code") == "input_audio_buffer_commit_empty"
            assert field(field(error, "error"), "event_id") == "evt_empty"
        # leaving the SDK's context closes with 1000: the session is closed, not left detached
        with anyio.fail_after(5):
            while server.runtime.session_count:
                await anyio.sleep(0.01)
        await client.close()


async def test_sdk_with_a_wrong_key_is_refused():
    async with running_server(api_key="sk-local") as server:
        client = sdk_client(server, "sk-wrong")
        with pytest.raises(Exception) as info:
            async with realtime(client).connect(model="gpt-realtime"):
                pass
        assert "401" in str(info.value)
        assert server.runtime.session_count == 0
        await client.close()


async def test_sdk_default_ga_session_text_in_audio_out_and_typed_events():
    """No session.update at all: the SDK's defaults (audio/pcm 24 kHz) work as they are."""
    async with running_server(SLOW) as server:
        client = sdk_client(server, "unused")
        async with realtime(client).connect(model="gpt-realtime") as connection:
            created = await next_of(connection, "session.created")
            assert not isinstance(created, dict), "the SDK could not parse session.created"
            session = field(created, "session")
            assert field(field(field(session, "audio"), "output"), "format").rate == 24000

            await connection.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}
            )
            added = await next_of(connection, "conversation.item.added")
            assert field(field(added, "item"), "role") == "user"
            await connection.response.create(response={"metadata": {"turn": "1"}})
            seen: list = []
            created_resp = await next_of(connection, "response.created", seen=seen)
            assert field(field(created_resp, "response"), "metadata") == {"turn": "1"}
            # a cancel naming another response is refused and cancels nothing
            await connection.response.cancel(response_id="resp_not_this_one")
            error = await next_of(connection, "error", seen=seen)
            assert field(field(error, "error"), "code") == "response_not_found"
            assert field(field(error, "error"), "param") == "response_id"
            done = await next_of(connection, "response.done", seen=seen, timeout=10)
            response = field(done, "response")
            assert field(response, "status") == "completed"
            assert field(response, "output_modalities") == ["audio"]
            unparsed = [field(e, "type") for e in seen if isinstance(e, dict)]
            assert not unparsed, f"the SDK did not recognise {unparsed}"
            audio = [e for e in seen if field(e, "type") == "response.output_audio.delta"]
            assert audio and len(base64.b64decode(field(audio[0], "delta"))) % 2 == 0
            transcript = "".join(
                field(e, "delta")
                for e in seen
                if field(e, "type") == "response.output_audio_transcript.delta"
            )
            assert transcript == "".join(SLOW.tokens)
            limits = await next_of(connection, "rate_limits.updated")
            assert not isinstance(limits, dict)
        await client.close()


async def test_sdk_transcription_session_by_intent_refuses_a_response_by_its_typed_error():
    # OpenAI's transcription guide: connect with intent=transcription and no model, then a
    # session.update of type "transcription". The SDK parses the session as a transcription one.
    async with running_server(SLOW) as server:
        client = sdk_client(server, "sk-any")
        async with realtime(client).connect(extra_query={"intent": "transcription"}) as connection:
            created = await next_of(connection, "session.created")
            assert field(field(created, "session"), "type") == "transcription"
            await connection.session.update(
                session={
                    "type": "transcription",
                    "audio": {
                        "input": {
                            "format": {"type": "audio/pcm", "rate": 16000},
                            "transcription": {"model": "gpt-4o-transcribe", "language": "en"},
                            "turn_detection": None,
                        }
                    },
                }
            )
            updated = field(await next_of(connection, "session.updated"), "session")
            assert field(updated, "type") == "transcription"
            await connection.input_audio_buffer.append(audio=base64.b64encode(CHUNK_100MS_16K).decode())
            await connection.input_audio_buffer.commit()
            await next_of(connection, "input_audio_buffer.committed")
            await connection.response.create()
            error = field(await next_of(connection, "error"), "error")
            assert field(error, "code") == "responses_not_offered"
