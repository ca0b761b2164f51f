"""turn_detection: server_vad runs a VAD in front of the session; speech_stopped commits."""

from __future__ import annotations

import base64
import json
import math

import pytest
from websockets.asyncio.client import connect

from duplex_actors import Script

from .conftest import recv_json, recv_until, running_server

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


class LoudnessVad:
    """Deterministic stand-in for Silero: a frame is speech when it is loud."""

    frame_samples = 512

    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate

    def probability(self, frame: bytes) -> float:
        samples = memoryview(frame).cast("h")
        return 0.95 if sum(abs(x) for x in samples) / len(samples) > 1000 else 0.02

    def reset(self) -> None:
        pass


def tone(ms: int, amplitude: int) -> bytes:
    n = 16 * ms
    return b"".join(int(amplitude * math.sin(i / 5)).to_bytes(2, "little", signed=True) for i in range(n))


def append(pcm: bytes) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})


PCM_16K = {"type": "audio/pcm", "rate": 16000}  # tone() writes 16 kHz samples


async def test_a_new_session_has_server_vad_on_and_speech_alone_gets_a_response():
    async with running_server(vad_factory=LoudnessVad) as server:
        async with connect(server.url) as ws:
            created = await recv_json(ws)
            detection = created["session"]["audio"]["input"]["turn_detection"]
            assert detection["type"] == "server_vad" and detection["create_response"] is True
            await ws.send(
                json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": PCM_16K}}}})
            )
            await recv_until(ws, "session.updated")
            for pcm in (tone(300, 8000), tone(700, 0)):
                await ws.send(append(pcm))
            events = await recv_until(ws, "response.done")
            types = [e["type"] for e in events]
            assert (
                types.index("input_audio_buffer.speech_stopped")
                < types.index("input_audio_buffer.committed")
                < types.index("response.created")
            )
            assert events[-1]["response"]["status"] == "completed"


async def test_speech_then_silence_commits_and_responds_without_a_client_commit():
    async with running_server(vad_factory=LoudnessVad) as server:
        async with connect(server.url) as ws:
            await recv_json(ws)
            await ws.send(
                json.dumps(
                    {
                        "type": "session.update",
                        "session": {
                            "audio": {
                                "input": {
                                    "format": PCM_16K,
                                    "turn_detection": {
                                        "type": "server_vad",
                                        "silence_duration_ms": 200,
                                        "prefix_padding_ms": 0,
                                    },
                                }
                            }
                        },
                    }
                )
            )
            updated = await recv_until(ws, "session.updated")
            assert updated[-1]["session"]["duplex"]["auto_respond"] is True
            assert updated[-1]["session"]["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 200
            for _ in range(3):
                await ws.send(append(tone(100, 8000)))
            for _ in range(4):
                await ws.send(append(tone(100, 0)))
            events = await recv_until(ws, "response.done")
            types = [e["type"] for e in events]
            assert (
                types.index("input_audio_buffer.speech_started")
                < types.index("input_audio_buffer.speech_stopped")
                < types.index("input_audio_buffer.committed")
                < types.index("response.created")
            )
            stopped = events[types.index("input_audio_buffer.speech_stopped")]
            assert 250 <= stopped["audio_end_ms"] <= 350
            assert events[-1]["response"]["status"] == "completed"

            # turn_detection null: back to explicit commits, silence commits nothing
            await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
            await recv_until(ws, "session.updated")
            await ws.send(append(tone(300, 8000)))
            await ws.send(append(tone(400, 0)))
            await ws.send(json.dumps({"type": "heartbeat"}))
            quiet = await recv_until(ws, "heartbeat.ack")
            assert [e["type"] for e in quiet] == ["heartbeat.ack"]


async def test_server_vad_unavailable_is_a_typed_error_and_changes_nothing():
    def missing(rate: int):
        raise ImportError("no VAD model installed")

    async with running_server(vad_factory=missing) as server:
        async with connect(server.url) as ws:
            created = await recv_json(ws)
            # without a VAD model a new session starts with manual turns
            assert created["session"]["audio"]["input"]["turn_detection"] is None
            await ws.send(
                json.dumps(
                    {
                        "type": "session.update",
                        "event_id": "u1",
                        "session": {
                            "turn_detection": {"type": "server_vad"},
                            "instructions": "not applied either",
                        },
                    }
                )
            )
            error = await recv_json(ws)
            assert error["error"]["code"] == "not_supported" and error["error"]["event_id"] == "u1"
            assert error["error"]["param"] == "session.audio.input.turn_detection"
            # All or nothing: the update's instructions are not applied, no session.updated.
            await ws.send(json.dumps({"type": "heartbeat"}))
            assert (await recv_json(ws))["type"] == "heartbeat.ack"
            sid = next(iter(server._records))
            config = server.runtime.get(sid).core.config
            assert config.auto_respond is False and config.server_vad is False  # unchanged
            assert config.instructions is None
            assert server._records[sid].wire.turn_detection is None


def tone_24k(ms: int, amplitude: int) -> bytes:
    n = 24 * ms
    return b"".join(int(amplitude * math.sin(i / 7.5)).to_bytes(2, "little", signed=True) for i in range(n))


async def test_24khz_wire_audio_reaches_the_vad_resampled_to_the_session_rate():
    rates: list[int] = []

    class RecordingVad(LoudnessVad):
        def __init__(self, sample_rate: int) -> None:
            super().__init__(sample_rate)
            rates.append(sample_rate)

    async with running_server(vad_factory=RecordingVad) as server:
        async with connect(server.url) as ws:
            created = await recv_json(ws)
            assert created["session"]["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
            for pcm in (tone_24k(300, 8000), tone_24k(800, 0)):
                await ws.send(append(pcm))
            events = await recv_until(ws, "response.done")
            stopped = next(e for e in events if e["type"] == "input_audio_buffer.speech_stopped")
            # 300 ms of speech read as 300 ms (the raw 24 kHz bytes taken as 16 kHz would be 450)
            assert 250 <= stopped["audio_end_ms"] <= 400, stopped
            committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
            assert 0 < committed["audio_ms"] <= 1100
        assert rates and set(rates) == {16000}  # the VAD runs at the session's 16 kHz


async def test_a_microphone_streaming_quiet_never_fills_the_input_and_a_turn_is_its_speech():
    """A phone-call client streams its microphone whether the user talks or not. Under server
    VAD the quiet before speech is kept only as the prefix padding: 6 s of it into a 2 s input
    buffer is never refused (it was input_backpressure after 2 s), and the turn committed is
    the prefix, the speech and the silence that ended it, not the seconds of quiet before."""
    async with running_server(
        vad_factory=LoudnessVad, session_overrides={"max_input_bytes": 16000 * 2 * 2}
    ) as server:
        async with connect(server.url) as ws:
            await recv_json(ws)
            detection = {"type": "server_vad", "prefix_padding_ms": 200, "silence_duration_ms": 300}
            update = {"audio": {"input": {"format": PCM_16K, "turn_detection": detection}}}
            await ws.send(json.dumps({"type": "session.update", "session": update}))
            await recv_until(ws, "session.updated")
            for _ in range(60):
                await ws.send(append(tone(100, 0)))
            await ws.send(append(tone(400, 8000)))
            for _ in range(5):
                await ws.send(append(tone(100, 0)))
            events = await recv_until(ws, "response.done", timeout=10.0)
            types = [e["type"] for e in events]
            assert "error" not in types, [e for e in events if e["type"] == "error"]
            started = events[types.index("input_audio_buffer.speech_started")]
            assert 5_700 <= started["audio_start_ms"] <= 5_900  # 6 s of quiet, less the padding
            committed = events[types.index("input_audio_buffer.committed")]
            # 200 ms of padding + 400 ms of speech + the silence heard before it ended the turn
            # (the chunk in which the VAD hears the end follows the commit, as it always has)
            assert 700 <= committed["audio_ms"] <= 1_000, committed
            sid = next(iter(server._records))
            assert server.runtime.get(sid).core.counters.rejected == 0


async def test_interrupt_response_false_lets_the_answer_play_and_commits_the_speech_over_it():
    """GA ``interrupt_response: false`` (it was refused as not_supported): speech over the
    answer does not cancel it; when the speech stops it is committed, and no second response
    starts while the first plays."""
    script = Script(token_latency_s=0.05, tokens=tuple(f" w{i}" for i in range(30)))
    async with running_server(script, vad_factory=LoudnessVad) as server:
        async with connect(server.url) as ws:
            await recv_json(ws)
            detection = {"type": "server_vad", "silence_duration_ms": 200, "interrupt_response": False}
            update = {"audio": {"input": {"format": PCM_16K, "turn_detection": detection}}}
            await ws.send(json.dumps({"type": "session.update", "session": update}))
            updated = (await recv_until(ws, "session.updated"))[-1]
            assert updated["session"]["audio"]["input"]["turn_detection"]["interrupt_response"] is False
            for pcm in (tone(300, 8000), tone(300, 0)):
                await ws.send(append(pcm))
            await recv_until(ws, "response.created")
            for pcm in (tone(800, 8000), tone(300, 0)):  # talk over the ~1.5 s answer
                await ws.send(append(pcm))
            events = await recv_until(ws, "response.done", timeout=10.0)
            types = [e["type"] for e in events]
            assert "error" not in types, events
            assert types.index("input_audio_buffer.speech_started") < types.index(
                "input_audio_buffer.committed"
            )
            assert events[-1]["response"]["status"] == "completed"
            await ws.send(json.dumps({"type": "heartbeat"}))
            after = [e["type"] for e in await recv_until(ws, "heartbeat.ack")]
            assert "response.created" not in after
