"""livekit-plugins-openai's realtime RealtimeModel against `duplex-actors serve`, unmodified.

Configured the way a user points it at another server: ``base_url``, ``api_key``, ``model``.
The session is driven through its public API (what ``AgentSession`` calls): chat context,
``push_audio``/``commit_audio``, ``generate_reply``, ``update_tools``. The plugin's raw
``openai_server_event_received`` and ``error`` events are recorded for assertions and the
failure message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import traceback

import pytest

from .conftest import API_KEY, GA_RATE, chunks, get_weather_impl

pytest.importorskip("livekit.plugins.openai.realtime")
pytestmark = [pytest.mark.interop, pytest.mark.anyio, pytest.mark.timeout(120)]

import aiohttp  # noqa: E402
from livekit import rtc  # noqa: E402
from livekit.agents import llm  # noqa: E402
from livekit.plugins.openai.realtime import RealtimeModel  # noqa: E402
from openai.types.realtime.realtime_audio_input_turn_detection import ServerVad  # noqa: E402


@llm.function_tool
async def get_weather(city: str) -> str:
    """Get the weather in a city."""
    return get_weather_impl(city)


class _ErrorLog(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.ERROR)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        cause = ""
        if record.exc_info:  # which handler failed names the event: _handle_<event type>
            where = traceback.extract_tb(record.exc_info[2])[-1].name
            cause = f" in {where}: {record.exc_info[1]!r}"
        self.sink.append(f"logged: {record.getMessage()[:200]}{cause[:300]}")


class Harness:
    def __init__(self, serve_url: str, turn_detection) -> None:
        self.serve_url = serve_url
        self.turn_detection = turn_detection
        self.raw: list[dict] = []
        self.errors: list[str] = []

    async def __aenter__(self):
        self.http = aiohttp.ClientSession()
        self.model = RealtimeModel(
            base_url=self.serve_url,
            api_key=API_KEY,
            model="gpt-realtime",
            http_session=self.http,
            turn_detection=self.turn_detection,
        )
        self.session = self.model.session()
        self.session.on("openai_server_event_received", self.raw.append)
        self.session.on("error", lambda ev: self.errors.append(repr(getattr(ev, "error", ev))[:400]))
        # The plugin logs (and drops) an event it fails to handle instead of raising: count it.
        self._log = _ErrorLog(self.errors)
        logging.getLogger("livekit.agents").addHandler(self._log)
        return self

    async def __aexit__(self, *exc):
        logging.getLogger("livekit.agents").removeHandler(self._log)
        await self.session.aclose()
        await self.model.aclose()
        await self.http.close()

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.raw if e.get("type") == kind]

    async def until(self, predicate, timeout: float = 20.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate(self):
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out; {self.summary()}")
            await asyncio.sleep(0.05)

    def summary(self) -> str:
        server_errors = [e.get("error") for e in self.of("error")]
        return (
            f"plugin errors: {self.errors[:8]}; server errors: {server_errors[:8]}; "
            f"server events: {[e.get('type') for e in self.raw][:30]}"
        )

    async def reply(self, timeout: float = 15.0, **options) -> tuple[str, int, list]:
        """generate_reply(**options) and read the generation to its end: (text, audio frames,
        calls)."""
        try:
            generation = await asyncio.wait_for(self.session.generate_reply(**options), timeout)
        except Exception as exc:
            raise AssertionError(f"generate_reply failed: {exc!r}; {self.summary()}") from None
        return await read_generation(generation)


async def read_generation(generation) -> tuple[str, int, list]:
    text, frames = [], 0
    async for message in generation.message_stream:
        async for piece in message.text_stream:
            text.append(str(piece))
        async for _frame in message.audio_stream:
            frames += 1
    calls = [call async for call in generation.function_stream]
    return "".join(text), frames, calls


def _frames(pcm: bytes):
    for chunk in chunks(pcm, ms=20):
        yield rtc.AudioFrame(chunk, sample_rate=GA_RATE, num_channels=1, samples_per_channel=len(chunk) // 2)


async def test_text_turn(serve_url):
    async with Harness(serve_url, turn_detection=None) as h:
        ctx = llm.ChatContext()
        ctx.add_message(role="user", content="Hello there")
        await h.session.update_chat_ctx(ctx)
        text, frames, _ = await h.reply()
        assert frames > 0 and text, h.summary()
        assert h.of("response.done")[-1]["response"]["status"] == "completed"
        assert not h.errors and not h.of("error"), h.summary()


async def test_push_to_talk_audio_turn(serve_url, speech_24k):
    async with Harness(serve_url, turn_detection=None) as h:
        for frame in _frames(speech_24k):
            h.session.push_audio(frame)
        h.session.commit_audio()
        await h.until(lambda x: x.of("input_audio_buffer.committed") or x.of("error"))
        text, frames, _ = await h.reply()
        assert frames > 0, h.summary()
        assert not h.errors and not h.of("error"), h.summary()


async def test_server_vad_turn_with_barge_in(serve_url, speech_24k):
    vad = ServerVad(
        type="server_vad",
        threshold=0.5,
        prefix_padding_ms=300,
        silence_duration_ms=500,
        create_response=True,
        interrupt_response=True,
    )
    async with Harness(serve_url, turn_detection=vad) as h:
        for frame in _frames(speech_24k):
            h.session.push_audio(frame)
        await h.until(lambda x: x.of("response.created"))
        for frame in _frames(speech_24k):  # talk over the answer
            h.session.push_audio(frame)
        await h.until(lambda x: len(x.of("response.done")) >= 2)
        first, second = (e["response"] for e in h.of("response.done")[:2])
        assert first["status"] == "cancelled", h.summary()
        assert first["status_details"]["reason"] == "turn_detected"
        assert second["status"] == "completed"
        assert not h.errors and not h.of("error"), h.summary()


async def ask_about_the_weather(h: Harness) -> None:
    """Offer get_weather and put a question that calls for it in the chat context."""
    await h.session.update_tools([get_weather])
    ctx = llm.ChatContext()
    ctx.add_message(role="user", content="What is the weather in Paris?")
    await h.session.update_chat_ctx(ctx)


async def test_tool_call(serve_url):
    async with Harness(serve_url, turn_detection=None) as h:
        await ask_about_the_weather(h)
        _, _, calls = await h.reply()
        assert [c.name for c in calls] == ["get_weather"], h.summary()
        call = calls[0]
        output = await get_weather(**json.loads(call.arguments or "{}") or {"city": "Paris"})
        ctx = h.session.chat_ctx.copy()
        ctx.insert(
            [
                call,
                llm.FunctionCallOutput(call_id=call.call_id, name=call.name, output=output, is_error=False),
            ]
        )
        await h.session.update_chat_ctx(ctx)
        text, frames, _ = await h.reply()
        assert "sunny in" in text, h.summary()
        assert not h.errors and not h.of("error"), h.summary()


async def test_generate_reply_with_its_own_tool_choice(serve_url):
    # generate_reply(tool_choice=...) puts it on that one response.create: "none" rules a call
    # out although the session offers a tool (the scripted engine would call it), "required"
    # asks for one. The server ignored it before, and "none" still got a call.
    async with Harness(serve_url, turn_detection=None) as h:
        await ask_about_the_weather(h)
        text, frames, calls = await h.reply(tool_choice="none")
        assert calls == [] and text and frames > 0, h.summary()
        _, _, calls = await h.reply(tool_choice="required")
        assert [c.name for c in calls] == ["get_weather"], h.summary()
        assert not h.errors and not h.of("error"), h.summary()


async def test_idle_timeout_prompts_a_silent_user(serve_url):
    """GA ``idle_timeout_ms`` through the plugin's own ServerVad settings: after the answer,
    quiet makes the server answer on its own, and the plugin takes that response as a
    server-initiated generation without an error."""
    vad = ServerVad(type="server_vad", idle_timeout_ms=1000, create_response=True, interrupt_response=True)
    async with Harness(serve_url, turn_detection=vad) as h:
        ctx = llm.ChatContext()
        ctx.add_message(role="user", content="Hello there")
        await h.session.update_chat_ctx(ctx)
        await h.reply()
        await h.until(lambda x: len(x.of("response.done")) >= 2)
        assert len(h.of("input_audio_buffer.timeout_triggered")) == 1, h.summary()
        assert h.of("response.done")[1]["response"]["status"] == "completed"
        assert not h.errors and not h.of("error"), h.summary()
