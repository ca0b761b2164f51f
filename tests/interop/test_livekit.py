"""livekit-plugins-openai's realtime RealtimeModel against `duplex-actors serve`, unmodified.

Configured the way a user points it at another server: ``base_url``, ``api_key``, ``model``.
The session is driven through its public API (what ``AgentSession`` calls): chat context,
``push_audio``/``commit_audio``, ``generate_reply``, ``update_tools``. The plugin's raw
``openai_server_event_received`` and ``error`` events are recorded for assertions and the
failure message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import traceback

import pytest

from .conftest import API_KEY, GA_RATE, check_pieced_transcript, chunks, get_weather_impl

pytest.importorskip("livekit.plugins.openai.realtime")
pytestmark = [pytest.mark.interop, pytest.mark.anyio, pytest.mark.timeout(120)]

_NOT_SET = object()  # the RealtimeModel's own default turn detection

import aiohttp  # noqa: E402
from livekit import rtc  # noqa: E402
from livekit.agents import Agent, AgentSession, function_tool, llm  # noqa: E402
from livekit.agents.voice import io as voice_io  # noqa: E402
from livekit.plugins.openai.realtime import RealtimeModel  # noqa: E402
from openai.types.realtime.realtime_audio_input_turn_detection import ServerVad  # noqa: E402


@llm.function_tool
async def get_weather(city: str) -> str:
    """Get the weather in a city."""
    return get_weather_impl(city)


async def poll_until(harness, predicate, timeout: float, step: float) -> None:
    """Wait until ``predicate(harness)`` holds; past ``timeout``, fail with the harness's summary."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate(harness):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out; {harness.summary()}")
        await asyncio.sleep(step)


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


class _WarningLog(logging.Handler):
    """The plugin's warnings (e.g. an item anchored after an unknown item, a rejected chat
    context update): a test that expects none asserts on them."""

    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.WARNING:
            self.sink.append(record.getMessage()[:300])


class Harness:
    def __init__(self, serve_url: str, turn_detection=_NOT_SET, *, session_options=None, **options) -> None:
        self.serve_url = serve_url
        self.turn_detection = turn_detection
        self.options = options  # more RealtimeModel options, as a user passes them
        self.session_options = session_options or {}  # RealtimeModel.session(...)
        self.raw: list[dict] = []
        self.errors: list[str] = []
        #: What the plugin sent (appends without their audio), and its warnings.
        self.sent: list[dict] = []
        self.warnings: list[str] = []

    async def __aenter__(self):
        self.http = aiohttp.ClientSession()
        options = dict(self.options)
        if self.turn_detection is not _NOT_SET:
            options["turn_detection"] = self.turn_detection
        self.model = RealtimeModel(
            base_url=self.serve_url,
            api_key=API_KEY,
            model="gpt-realtime",
            http_session=self.http,
            **options,
        )
        self.session = self.model.session(**self.session_options)
        self.session.on("openai_server_event_received", self.raw.append)
        self.session.on("openai_client_event_queued", self._record_sent)
        self.session.on("error", lambda ev: self.errors.append(repr(getattr(ev, "error", ev))[:400]))
        # The plugin logs (and drops) an event it fails to handle instead of raising: count it.
        self._log = _ErrorLog(self.errors)
        self._warn_log = _WarningLog(self.warnings)
        logging.getLogger("livekit.agents").addHandler(self._log)
        logging.getLogger("livekit.agents").addHandler(self._warn_log)
        return self

    def _record_sent(self, event: dict) -> None:
        if event.get("type") == "input_audio_buffer.append":
            event = {"type": event["type"], "bytes": len(event.get("audio", "")) * 3 // 4}
        self.sent.append(json.loads(json.dumps(event, default=str)))

    def sent_of(self, kind: str) -> list[dict]:
        return [e for e in self.sent if e.get("type") == kind]

    async def __aexit__(self, *exc):
        logging.getLogger("livekit.agents").removeHandler(self._log)
        logging.getLogger("livekit.agents").removeHandler(self._warn_log)
        await self.session.aclose()
        await self.model.aclose()
        await self.http.close()

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.raw if e.get("type") == kind]

    async def until(self, predicate, timeout: float = 20.0) -> None:
        await poll_until(self, predicate, timeout, step=0.05)

    def summary(self) -> str:
        server_errors = [e.get("error") for e in self.of("error")]
        return (
            f"plugin errors: {self.errors[:8]}; server errors: {server_errors[:8]}; "
            f"plugin warnings: {self.warnings[:8]}; "
            f"server events: {[e.get('type') for e in self.raw][-40:]}; "
            f"sent: {[e.get('type') for e in self.sent if e.get('type') != 'input_audio_buffer.append'][-20:]}"
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
    vad = _vad()
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


# --- what AgentSession does around a live session -------------------------------------------


def no_trouble(h: Harness) -> bool:
    """No server error event, no plugin error (event or log), no plugin warning."""
    return not h.errors and not h.of("error") and not h.warnings


async def say_hello(h: Harness, text: str = "Hello there") -> None:
    ctx = h.session.chat_ctx.copy()
    ctx.add_message(role="user", content=text)
    await h.session.update_chat_ctx(ctx)


async def start_reply(h: Harness, **options):
    """generate_reply and wait for its first message and first audio frame: (generation,
    message, frames so far)."""
    generation = await asyncio.wait_for(h.session.generate_reply(**options), 10)
    message = await asyncio.wait_for(generation.message_stream.__anext__(), 10)
    frames = [await asyncio.wait_for(message.audio_stream.__anext__(), 10)]
    return generation, message, frames


async def drain(message) -> list:
    return [frame async for frame in message.audio_stream]


def frames_ms(frames) -> int:
    return sum(f.samples_per_channel for f in frames) * 1000 // GA_RATE


async def updated(h: Harness, count: int) -> dict:
    """The session object of the ``count``-th session.updated (1-based)."""
    await h.until(lambda x: len(x.of("session.updated")) >= count or x.of("error"))
    assert len(h.of("session.updated")) >= count, h.summary()
    return h.of("session.updated")[count - 1]["session"]


async def test_interrupt_then_truncate_as_agent_session_does(serve_url):
    """The user talks over the answer: AgentSession calls interrupt() (response.cancel), then
    truncate() with what was played (conversation.item.truncate); the next turn answers."""
    async with Harness(serve_url, turn_detection=None) as h:
        await say_hello(h)
        generation, message, frames = await start_reply(h)
        h.session.interrupt()
        frames += await asyncio.wait_for(drain(message), 10)
        await h.until(lambda x: x.of("response.done"))
        done = h.of("response.done")[0]["response"]
        assert done["status"] == "cancelled", h.summary()
        assert done["status_details"]["reason"] == "client_cancelled"
        assert [e["type"] for e in h.sent_of("response.cancel")] == ["response.cancel"]
        played_ms = frames_ms(frames) // 2  # the listener heard half of what arrived
        assert played_ms > 0
        modalities = await message.modalities
        assert "audio" in modalities
        h.session.truncate(
            message_id=message.message_id,
            modalities=modalities,
            audio_end_ms=played_ms,
            audio_transcript="word0",
        )
        await h.until(lambda x: x.of("conversation.item.truncated") or x.of("error"))
        truncated = h.of("conversation.item.truncated")
        assert truncated, h.summary()
        assert truncated[0]["item_id"] == message.message_id
        assert truncated[0]["audio_end_ms"] == played_ms and truncated[0]["content_index"] == 0
        # the next turn
        await say_hello(h, "Go on")
        text, frames, _ = await h.reply()
        assert text and frames > 0, h.summary()
        assert h.of("response.done")[-1]["response"]["status"] == "completed"
        assert no_trouble(h), h.summary()


async def test_truncate_to_nothing_heard_deletes_the_message(serve_url):
    """Interrupted before any of it played (playback position 0): the plugin deletes the
    assistant message (conversation.item.delete) and its mirror of the context drops it."""
    async with Harness(serve_url, turn_detection=None) as h:
        await say_hello(h)
        generation, message, _ = await start_reply(h)
        h.session.interrupt()
        await asyncio.wait_for(drain(message), 10)
        await h.until(lambda x: x.of("response.done"))
        h.session.truncate(
            message_id=message.message_id,
            modalities=await message.modalities,
            audio_end_ms=0,
            audio_transcript="",
        )
        await h.until(lambda x: x.of("conversation.item.deleted") or x.of("error"))
        assert [e["item_id"] for e in h.of("conversation.item.deleted")] == [message.message_id], h.summary()
        assert h.session.chat_ctx.get_by_id(message.message_id) is None
        await say_hello(h, "Go on")
        text, frames, _ = await h.reply()
        assert text and frames > 0, h.summary()
        assert no_trouble(h), h.summary()


def _history() -> llm.ChatContext:
    """A chat context as AgentSession hands over at the start of an agent (or a handoff): a
    system note, a past exchange with a tool call and its output, and the user's question."""
    ctx = llm.ChatContext()
    ctx.add_message(role="system", content="The user lives in Paris.")
    ctx.add_message(role="user", content="Hi")
    ctx.add_message(role="assistant", content="Hello! How can I help?")
    ctx.insert(
        [
            llm.FunctionCall(call_id="call_hist_1", name="get_weather", arguments='{"city": "Paris"}'),
            llm.FunctionCallOutput(
                call_id="call_hist_1", name="get_weather", output="rainy in Paris", is_error=False
            ),
        ]
    )
    ctx.add_message(role="user", content="And what should I wear?")
    return ctx


def _ids(ctx: llm.ChatContext) -> list[str]:
    return [item.id for item in ctx.items]


async def test_update_chat_ctx_adds_removes_and_replaces_items(serve_url):
    """update_chat_ctx as AgentSession uses it: the whole history at start (every item type
    it syncs), then a context without some items (conversation.item.delete), then a different
    context (every old item deleted, the new ones created). The plugin's mirror follows the
    server's answers."""
    async with Harness(serve_url, turn_detection=None) as h:
        history = _history()
        await h.session.update_chat_ctx(history)
        added = [e["item"]["id"] for e in h.of("conversation.item.added")]
        assert added == _ids(history), h.summary()
        assert _ids(h.session.chat_ctx) == _ids(history)
        roles = [(e["item"]["type"], e["item"].get("role")) for e in h.of("conversation.item.added")]
        assert roles == [
            ("message", "system"),
            ("message", "user"),
            ("message", "assistant"),
            ("function_call", None),
            ("function_call_output", None),
            ("message", "user"),
        ]

        # remove the tool exchange (AgentSession does when it drops never-played items)
        fewer = history.copy()
        dropped = [item.id for item in fewer.items if item.type in ("function_call", "function_call_output")]
        fewer.items[:] = [item for item in fewer.items if item.id not in dropped]
        await h.session.update_chat_ctx(fewer)
        assert sorted(e["item_id"] for e in h.sent_of("conversation.item.delete")) == sorted(dropped)
        assert sorted(e["item_id"] for e in h.of("conversation.item.deleted")) == sorted(dropped), h.summary()
        assert _ids(h.session.chat_ctx) == _ids(fewer)
        text, frames, _ = await h.reply()
        assert text and frames > 0, h.summary()

        # replace the context as a whole
        other = llm.ChatContext()
        other.add_message(role="user", content="Let's talk about Rome instead.")
        before = len(h.of("conversation.item.deleted"))
        await h.session.update_chat_ctx(other)
        assert len(h.of("conversation.item.deleted")) - before == len(fewer.items) + 1  # + the reply
        assert _ids(h.session.chat_ctx) == _ids(other)
        text, frames, _ = await h.reply()
        assert text and frames > 0, h.summary()
        assert no_trouble(h), h.summary()


async def test_update_chat_ctx_with_a_tool_output_answers_with_it(serve_url):
    """After a tool call AgentSession copies the session's chat_ctx, appends the outputs and
    syncs it, then asks for the reply: only the new output goes out, the model reads it."""
    async with Harness(serve_url, turn_detection=None) as h:
        await ask_about_the_weather(h)
        _, _, calls = await h.reply()
        assert [c.name for c in calls] == ["get_weather"], h.summary()
        ctx = h.session.chat_ctx.copy()
        ctx.items.append(
            llm.FunctionCallOutput(
                call_id=calls[0].call_id, name="get_weather", output="sunny in Lyon", is_error=False
            )
        )
        await h.session.update_chat_ctx(ctx)
        created = [e["item"]["type"] for e in h.sent_of("conversation.item.create")]
        assert created == ["message", "function_call_output"], h.sent_of("conversation.item.create")
        assert not h.sent_of("conversation.item.delete"), h.sent_of("conversation.item.delete")
        text, frames, calls = await h.reply()
        assert "sunny in Lyon" in text and frames > 0 and not calls, h.summary()
        assert no_trouble(h), h.summary()


async def test_replacing_an_item_with_new_content(serve_url):
    """An item of the same id with other content (AgentSession's copy of an assistant message
    holds what was forwarded, the server's holds the whole transcript): the plugin deletes it
    and creates it again under the same id, after the same item."""
    async with Harness(serve_url, turn_detection=None) as h:
        await say_hello(h)
        text, _, _ = await h.reply()
        ctx = h.session.chat_ctx.copy()
        heard = ctx.items[-1]
        assert heard.type == "message" and heard.role == "assistant", ctx.items
        assistant = llm.ChatMessage(id=heard.id, role="assistant", content=["word0 word1"], interrupted=True)
        ctx.items[-1] = assistant  # copy() shares the items: AgentSession puts a new one in
        await h.session.update_chat_ctx(ctx)
        assert [e["item_id"] for e in h.of("conversation.item.deleted")] == [assistant.id], h.summary()
        again = [e for e in h.of("conversation.item.added") if e["item"]["id"] == assistant.id]
        assert len(again) == 2, h.summary()  # the response's, then the replacement
        assert again[-1]["item"]["content"][0]["text"] == "word0 word1"
        assert again[-1]["previous_item_id"] == ctx.items[-2].id
        mirrored = h.session.chat_ctx.get_by_id(assistant.id)
        assert mirrored is not None and mirrored.text_content == "word0 word1"
        await say_hello(h, "Go on")
        text, frames, _ = await h.reply()
        assert text and frames > 0, h.summary()
        assert no_trouble(h), h.summary()


async def test_deleted_function_output_does_not_reach_the_model(serve_url):
    """AgentSession removes items the user never heard (and a context replaced at a handoff
    deletes all of them): once conversation.item.deleted confirms it, the model must not read
    the item. The scripted engine says every function output it is given, first."""
    async with Harness(serve_url, turn_detection=None) as h:
        history = _history()
        await h.session.update_chat_ctx(history)
        kept = history.copy()
        kept.items[:] = [i for i in kept.items if i.type not in ("function_call", "function_call_output")]
        await h.session.update_chat_ctx(kept)
        assert len(h.of("conversation.item.deleted")) == 2, h.summary()
        text, frames, _ = await h.reply()
        assert text and frames > 0, h.summary()
        assert no_trouble(h), h.summary()
        assert "rainy in Paris" not in text, f"the deleted output reached the model: {text[:60]!r}"


async def test_instructions_tools_and_tool_choice_updates(serve_url):
    """update_instructions, update_tools and update_options(tool_choice=...) as AgentSession
    calls them (at start, on a handoff, for one turn's tool_choice): each is one session.update
    the server applies (session.updated echoes it) and the next response follows it."""
    async with Harness(serve_url, turn_detection=None) as h:
        await updated(h, 1)  # the plugin's opening session.update
        await h.session.update_instructions("You are a weather assistant. Be brief.")
        assert (await updated(h, 2))["instructions"] == "You are a weather assistant. Be brief."
        await h.session.update_tools([get_weather])
        session = await updated(h, 3)
        assert [t["name"] for t in session["tools"]] == ["get_weather"], session["tools"]
        assert [t.id for t in h.session.tools.flatten()] == ["get_weather"]
        await say_hello(h, "What is the weather in Paris?")

        h.session.update_options(tool_choice="none")
        assert (await updated(h, 4))["tool_choice"] == "none"
        text, frames, calls = await h.reply()
        assert not calls and text and frames > 0, h.summary()

        h.session.update_options(tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert (await updated(h, 5))["tool_choice"] == {"type": "function", "name": "get_weather"}
        _, _, calls = await h.reply()
        assert [c.name for c in calls] == ["get_weather"], h.summary()
        h.session.update_options(tool_choice="auto")
        assert (await updated(h, 6))["tool_choice"] == "auto"

        await h.session.update_tools([])  # a handoff to an agent without tools
        assert (await updated(h, 7))["tools"] == []
        # the generate_reply of a tool-less agent: no call although tool_choice is auto
        text, frames, calls = await h.reply(instructions="Say goodbye.")
        assert not calls and text and frames > 0, h.summary()
        create = h.sent_of("response.create")[-1]["response"]
        assert create["instructions"] == "You are a weather assistant. Be brief.\nSay goodbye."
        assert no_trouble(h), h.summary()


async def test_generate_reply_with_its_own_tools(serve_url):
    """AgentSession passes a turn's tools on the response.create (per_response_tool_choice):
    with none on the session, that response can call one; the next one, without, cannot."""
    async with Harness(serve_url, turn_detection=None) as h:
        await say_hello(h, "What is the weather in Paris?")
        _, _, calls = await h.reply(tools=[get_weather], tool_choice="auto")
        assert [c.name for c in calls] == ["get_weather"], h.summary()
        assert [t["name"] for t in h.sent_of("response.create")[-1]["response"]["tools"]] == ["get_weather"]
        text, frames, calls = await h.reply()
        assert not calls and text and frames > 0, h.summary()
        assert no_trouble(h), h.summary()


async def test_update_options_voice_speed_and_noise_reduction(serve_url):
    """update_options with the audio settings a user changes mid-session (voice, speed, noise
    reduction): one session.update, nothing refused, the voice echoed, and the session answers
    as before."""
    async with Harness(serve_url, turn_detection=None) as h:
        await updated(h, 1)
        h.session.update_options(voice="alloy", speed=1.2, input_audio_noise_reduction="near_field")
        session = await updated(h, 2)
        assert session["audio"]["output"]["voice"] == "alloy", session
        assert session["audio"]["output"]["speed"] == 1.2, session  # applied (engines that speak)
        sent = h.sent_of("session.update")[-1]["session"]["audio"]
        assert sent["output"] == {"voice": "alloy", "speed": 1.2}, sent
        assert sent["input"]["noise_reduction"] == {"type": "near_field"}, sent
        # the model's update_options, as users call it, reaches every session it made
        h.model.update_options(voice="echo")
        assert (await updated(h, 3))["audio"]["output"]["voice"] == "echo"
        # (it also sends the model's own noise reduction, null, over the session's near_field)
        assert h.sent_of("session.update")[-1]["session"]["audio"]["output"] == {"voice": "echo"}
        await say_hello(h)
        text, frames, _ = await h.reply()
        assert text and frames > 0, h.summary()
        assert h.of("response.done")[-1]["response"]["audio"]["output"]["voice"] == "echo"
        assert no_trouble(h), h.summary()


async def test_max_response_output_tokens_inf_lifts_the_limit(serve_url):
    """After a limit of 3, update_options(max_response_output_tokens="inf") (the plugin's own
    default) lifts it: session.updated and the next response say "inf"."""
    async with Harness(serve_url, turn_detection=None) as h:
        await updated(h, 1)
        h.session.update_options(max_response_output_tokens=3)
        await updated(h, 2)
        h.session.update_options(max_response_output_tokens="inf")
        session = await updated(h, 3)
        assert h.sent_of("session.update")[-1]["session"] == {"type": "realtime", "max_output_tokens": "inf"}
        await say_hello(h)
        await h.reply()
        done = h.of("response.done")[-1]["response"]
        assert not h.errors and not h.of("error"), h.summary()
        assert (session["max_output_tokens"], done["max_output_tokens"]) == ("inf", "inf")


async def test_max_response_output_tokens_limits_the_response(serve_url):
    """A limit of 3 tokens: the response stops there, status incomplete with reason
    max_output_tokens, as OpenAI ends it."""
    async with Harness(serve_url, turn_detection=None) as h:
        await updated(h, 1)
        h.session.update_options(max_response_output_tokens=3)
        await updated(h, 2)
        await say_hello(h)
        # The plugin fails its generation's done future on an incomplete response (as with
        # OpenAI), and only awaits it itself before a reconnect: take it here, so the failure
        # is read rather than left to the loop as "never retrieved".
        generations = []
        h.session.on("generation_created", lambda _ev: generations.append(h.session._current_generation))
        await h.reply()
        with pytest.raises(llm.RealtimeError, match="incomplete: max_output_tokens"):
            await generations[0]._done_fut
        done = h.of("response.done")[-1]["response"]
        assert not h.errors and not h.of("error"), h.summary()
        assert done["max_output_tokens"] == 3, done
        assert done["usage"]["output_tokens"] <= 3, (done["status"], done["usage"])
        assert done["status"] == "incomplete" and done["status_details"]["reason"] == "max_output_tokens", (
            done
        )


async def talk(h: Harness, pcm: bytes) -> None:
    """Push ``pcm`` at the pace a microphone makes it (20 ms frames)."""
    for frame in _frames(pcm):
        h.session.push_audio(frame)
        await asyncio.sleep(0.02)


def _vad(**overrides) -> ServerVad:
    settings = dict(
        type="server_vad",
        threshold=0.5,
        prefix_padding_ms=300,
        silence_duration_ms=500,
        create_response=True,
        interrupt_response=True,
    )
    return ServerVad(**{**settings, **overrides})


async def test_turn_detection_switched_by_update_options(serve_url, speech_24k):
    """update_options(turn_detection=...): manual turns, then server VAD (the server detects the
    turn and answers it), then manual again (speech alone starts nothing; commit_audio and
    generate_reply do)."""
    async with Harness(serve_url, turn_detection=None, input_audio_transcription=None) as h:
        await updated(h, 1)
        h.session.update_options(turn_detection=_vad())
        detection = (await updated(h, 2))["audio"]["input"]["turn_detection"]
        assert detection["type"] == "server_vad" and detection["create_response"] is True, detection
        assert h.session.capabilities.turn_detection
        for frame in _frames(speech_24k):
            h.session.push_audio(frame)
        await h.until(lambda x: x.of("response.done"))
        assert h.of("input_audio_buffer.speech_started") and h.of("input_audio_buffer.committed"), h.summary()
        assert h.of("response.done")[0]["response"]["status"] == "completed"

        h.session.update_options(turn_detection=None)
        assert (await updated(h, 3))["audio"]["input"]["turn_detection"] is None
        for frame in _frames(speech_24k):
            h.session.push_audio(frame)
        await asyncio.sleep(2.5)  # the speech and its second of silence, at 4x real time
        assert len(h.of("input_audio_buffer.speech_started")) == 1, h.summary()
        assert len(h.of("response.created")) == 1, h.summary()
        h.session.commit_audio()
        text, frames, _ = await h.reply()
        assert frames > 0 and len(h.of("input_audio_buffer.committed")) == 2, h.summary()
        assert no_trouble(h), h.summary()


async def test_input_transcription_turned_on_by_update_options(serve_url, speech_24k):
    """update_options(input_audio_transcription=...): the next committed turn is transcribed,
    the plugin emits input_audio_transcription_completed for the committed item and writes the
    transcript into its chat context."""
    from openai.types.realtime import AudioTranscription

    async with Harness(serve_url, turn_detection=None, input_audio_transcription=None) as h:
        transcripts = []
        h.session.on("input_audio_transcription_completed", transcripts.append)
        await updated(h, 1)
        h.session.update_options(
            input_audio_transcription=AudioTranscription(model="gpt-4o-transcribe", language="en")
        )
        session = await updated(h, 2)
        assert session["audio"]["input"]["transcription"] is not None, session
        for frame in _frames(speech_24k):
            h.session.push_audio(frame)
        h.session.commit_audio()
        await h.until(lambda x: x.of("input_audio_buffer.committed"))
        item_id = h.of("input_audio_buffer.committed")[0]["item_id"]
        await h.until(lambda x: any(t.is_final for t in transcripts))
        final = [t for t in transcripts if t.is_final]
        assert [t.item_id for t in final] == [item_id]
        assert "weather" in final[0].transcript.lower(), final[0].transcript
        assert "weather" in h.session.chat_ctx.get_by_id(item_id).text_content.lower()
        assert no_trouble(h), h.summary()


async def test_a_long_turn_transcribed_in_pieces_accumulates_then_a_short_turn_still_works(
    serve_url, long_speech_24k, speech_24k
):
    """A ~9 s push-to-talk turn: the server sends one input_audio_transcription.delta per
    piece, then completed. The plugin emits each delta as a non-final
    input_audio_transcription_completed holding everything heard so far, then one final with
    the server's transcript, which is also the item's text in its chat context; the turn is
    answered. A short turn after it (one delta) is transcribed and answered the same way."""
    from itertools import accumulate

    from openai.types.realtime import AudioTranscription

    transcription = AudioTranscription(model="gpt-4o-transcribe", language="en")
    async with Harness(serve_url, turn_detection=None, input_audio_transcription=transcription) as h:
        heard = []
        h.session.on("input_audio_transcription_completed", heard.append)

        async def turn(pcm: bytes, n: int) -> tuple[str, list[str], list]:
            for frame in _frames(pcm):
                h.session.push_audio(frame)
            h.session.commit_audio()
            await h.until(lambda x: len(x.of("input_audio_buffer.committed")) >= n)
            item_id = h.of("input_audio_buffer.committed")[n - 1]["item_id"]
            await h.until(lambda x: any(t.is_final and t.item_id == item_id for t in heard))
            completed = h.of("conversation.item.input_audio_transcription.completed")
            assert [e["item_id"] for e in completed][n - 1 :] == [item_id], h.summary()
            deltas = [
                e["delta"]
                for e in h.of("conversation.item.input_audio_transcription.delta")
                if e["item_id"] == item_id
            ]
            mine = [t for t in heard if t.item_id == item_id]
            # each delta surfaces as the text so far; the final is the server's transcript
            assert [(t.transcript, t.is_final) for t in mine] == [
                *((so_far, False) for so_far in accumulate(deltas)),
                (completed[-1]["transcript"], True),
            ], mine
            assert h.session.chat_ctx.get_by_id(item_id).text_content == completed[-1]["transcript"]
            text, frames, _ = await h.reply()
            assert frames > 0 and h.of("response.done")[-1]["response"]["status"] == "completed", h.summary()
            return completed[-1]["transcript"], deltas, mine

        transcript, deltas, _ = await turn(long_speech_24k, 1)
        check_pieced_transcript(deltas, transcript)

        transcript, deltas, mine = await turn(speech_24k, 2)
        assert deltas == [transcript] and len(mine) == 2, mine
        assert "weather" in transcript and "paris" in transcript, transcript
        assert len(heard) == len(h.of("conversation.item.input_audio_transcription.delta")) + 2, heard
        assert no_trouble(h), h.summary()


async def test_model_defaults_semantic_vad_and_transcription(serve_url, speech_24k):
    """RealtimeModel() as most users make it: the plugin's defaults (semantic_vad with
    eagerness, gpt-4o-mini-transcribe, voice marin, text+audio modalities). Speech is detected,
    transcribed, and answered with audio."""
    async with Harness(serve_url) as h:
        transcripts = []
        h.session.on("input_audio_transcription_completed", transcripts.append)
        opening = await updated(h, 1)
        assert opening["audio"]["input"]["turn_detection"]["type"] in ("semantic_vad", "server_vad"), opening
        sent = h.sent_of("session.update")[0]["session"]
        assert sent["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
        assert sent["audio"]["output"]["voice"] == "marin"
        for frame in _frames(speech_24k):
            h.session.push_audio(frame)
        await h.until(lambda x: x.of("response.done") and any(t.is_final for t in transcripts))
        assert h.of("response.done")[0]["response"]["status"] == "completed", h.summary()
        assert sum(len(e["delta"]) for e in h.of("response.output_audio.delta")) > 0
        assert "weather" in [t for t in transcripts if t.is_final][0].transcript.lower()
        assert no_trouble(h), h.summary()


async def test_generate_reply_while_a_response_plays_is_refused_as_openai_does(serve_url):
    """generate_reply(instructions=...) while a response streams: the server refuses the second
    response.create with OpenAI's conversation_already_has_active_response, echoing its
    event_id, so the plugin fails that future at once (not after its 10 s timeout); the playing
    response completes and the next generate_reply works."""
    async with Harness(serve_url, turn_detection=None) as h:
        await say_hello(h)
        generation, message, frames = await start_reply(h)
        second = h.session.generate_reply(instructions="Tell me a joke instead.")
        with pytest.raises(llm.RealtimeError) as refused:
            await asyncio.wait_for(second, 5)
        assert refused.value.code == "conversation_already_has_active_response"
        errors = h.of("error")
        assert [e["error"]["code"] for e in errors] == ["conversation_already_has_active_response"]
        assert errors[0]["error"]["event_id"] == h.sent_of("response.create")[-1]["event_id"]
        frames += await asyncio.wait_for(drain(message), 10)
        await h.until(lambda x: x.of("response.done"))
        assert h.of("response.done")[0]["response"]["status"] == "completed", h.summary()
        assert len(h.of("response.created")) == 1
        text, more, _ = await h.reply(instructions="Now the joke.")
        assert text and more > 0, h.summary()
        assert h.of("response.done")[-1]["response"]["status"] == "completed"


async def test_interrupt_then_generate_reply_at_once(serve_url):
    """AgentSession's interrupt() followed by generate_reply(instructions=...) (session.interrupt
    then session.generate_reply, e.g. a tool or a timer that speaks over the agent): the cancel
    and the create go back to back; the first response ends cancelled, the second completes."""
    async with Harness(serve_url, turn_detection=None) as h:
        await say_hello(h)
        generation, message, _ = await start_reply(h)
        h.session.interrupt()
        text, frames, _ = await h.reply(instructions="Say: one moment please.")
        assert text and frames > 0, h.summary()
        await asyncio.wait_for(drain(message), 10)
        statuses = [e["response"]["status"] for e in h.of("response.done")]
        assert statuses == ["cancelled", "completed"], h.summary()
        assert no_trouble(h), h.summary()


async def test_generate_reply_cancelled_before_the_response_is_created(serve_url):
    """AgentSession cancels the generate_reply future when its speech is interrupted before
    response.created (speech_handle.interrupted): the plugin sends response.cancel at once,
    and when the response still arrives it cancels it by id and drops its events. Neither
    cancel may come back as an error the plugin reports (OpenAI answers a late one with
    "Cancellation failed: ...", which the plugin ignores)."""
    async with Harness(serve_url, turn_detection=None) as h:
        await say_hello(h)
        fut = h.session.generate_reply()
        fut.cancel()
        await h.until(lambda x: x.of("response.done"))
        await asyncio.sleep(0.5)  # the second cancel's answer, if any
        assert h.of("response.done")[0]["response"]["status"] == "cancelled", h.summary()
        assert len(h.sent_of("response.cancel")) >= 1
        text, frames, _ = await h.reply()
        assert text and frames > 0, h.summary()
        # A cancel that meets no response is refused as OpenAI refuses it, in words the plugin
        # knows to ignore (it reported the old ones as errors).
        assert not h.errors, h.summary()
        # The plugin's own note on the cancelled future: its normal path, not about the server.
        assert all(w.startswith("discarding response that arrived after") for w in h.warnings), h.summary()
        for error in h.of("error"):
            assert error["error"]["message"].startswith("Cancellation failed"), h.summary()


async def test_server_vad_barge_in_handled_as_agent_session_does(serve_url, speech_24k):
    """Server VAD barge-in with AgentSession's reaction: on input_speech_started it calls
    interrupt() while the plugin still has a generation, then truncates the interrupted
    message at what was played. The answer to the new turn completes, with no error."""
    async with Harness(serve_url, turn_detection=_vad(), input_audio_transcription=None) as h:
        interrupts = []

        def on_speech_started(_ev) -> None:
            if h.session.has_active_generation:  # what AgentActivity.interrupt() reaches
                interrupts.append(True)
                h.session.interrupt()

        h.session.on("input_speech_started", on_speech_started)
        generations = []
        h.session.on("generation_created", generations.append)
        for frame in _frames(speech_24k):
            h.session.push_audio(frame)
        await h.until(lambda x: generations)
        message = await asyncio.wait_for(generations[0].message_stream.__anext__(), 10)
        first = [await asyncio.wait_for(message.audio_stream.__anext__(), 10)]
        # talk over the answer, in real time as a microphone does: pushed all at once, the
        # whole turn would reach the server ahead of the cancel, which would then cancel the
        # answer to that turn instead (frames are read in order)
        talking = asyncio.create_task(talk(h, speech_24k))
        first += await asyncio.wait_for(drain(message), 15)
        await talking
        await h.until(lambda x: len(x.of("response.done")) >= 2)
        h.session.truncate(
            message_id=message.message_id,
            modalities=await message.modalities,
            audio_end_ms=min(frames_ms(first), 200),
            audio_transcript="word0",
        )
        await h.until(lambda x: x.of("conversation.item.truncated") or x.of("error"))
        first_done, second_done = (e["response"] for e in h.of("response.done")[:2])
        assert first_done["status"] == "cancelled", h.summary()
        assert second_done["status"] == "completed", h.summary()
        assert interrupts and h.sent_of("response.cancel"), h.summary()
        await asyncio.sleep(0.3)
        assert not h.errors and not h.of("error"), h.summary()


def _speech_ms(pcm: bytes) -> int:
    return len(pcm) // 2 * 1000 // GA_RATE


async def test_push_to_talk_cancel_turn_then_turn(serve_url, speech_24k):
    """AgentSession in push-to-talk (turn_detection="manual"): the model as users make it, its
    session opened with turn detection disabled. A cancelled turn (clear_audio) is dropped:
    input_audio_buffer.cleared, and a commit with nothing pushed since sends nothing. The next
    turn is committed whole (commit_audio) and answered (generate_reply)."""
    async with Harness(serve_url, session_options={"turn_detection_disabled": True}) as h:
        opening = await updated(h, 1)
        assert opening["audio"]["input"]["turn_detection"] is None, opening
        assert not h.session.capabilities.turn_detection
        half = speech_24k[: len(speech_24k) // 4 * 2]  # whole samples
        for frame in _frames(half):
            h.session.push_audio(frame)
        h.session.clear_audio()  # the user lets go of the button and cancels the turn
        await h.until(lambda x: x.of("input_audio_buffer.cleared"))
        h.session.commit_audio()  # nothing pushed since: the plugin sends no commit
        assert not h.sent_of("input_audio_buffer.commit")
        for frame in _frames(speech_24k):
            h.session.push_audio(frame)
        h.session.commit_audio()
        await h.until(lambda x: x.of("input_audio_buffer.committed"))
        committed = h.of("input_audio_buffer.committed")
        assert len(committed) == 1, h.summary()
        # all of the turn, none of the cancelled one (the plugin sends whole 100 ms frames)
        assert abs(committed[0]["audio_ms"] - _speech_ms(speech_24k)) <= 100, committed[0]
        text, frames, _ = await h.reply()
        assert frames > 0, h.summary()
        assert h.of("response.done")[-1]["response"]["status"] == "completed"
        assert no_trouble(h), h.summary()


async def test_push_to_talk_over_the_agent(serve_url, speech_24k):
    """Push-to-talk while the agent speaks: AgentSession's start of turn is interrupt() and
    clear_audio(), its end commit_audio() and generate_reply(). The answer being spoken ends
    cancelled, the new turn is answered."""
    async with Harness(serve_url, session_options={"turn_detection_disabled": True}) as h:
        await say_hello(h)
        generation, message, _ = await start_reply(h)
        h.session.interrupt()
        h.session.clear_audio()
        for frame in _frames(speech_24k):
            h.session.push_audio(frame)
        await asyncio.wait_for(drain(message), 10)
        h.session.commit_audio()
        text, frames, _ = await h.reply()
        assert frames > 0, h.summary()
        statuses = [e["response"]["status"] for e in h.of("response.done")]
        assert statuses == ["cancelled", "completed"], h.summary()
        assert len(h.of("input_audio_buffer.cleared")) == 1 and len(h.of("input_audio_buffer.committed")) == 1
        assert no_trouble(h), h.summary()


def _after_reconnect(h: Harness, kind: str) -> list[dict]:
    """The ``kind`` events the second connection's server session sent."""
    types = [e["type"] for e in h.raw]
    if types.count("session.created") < 2:
        return []
    return [e for e in h.raw[types.index("session.created", 1) :] if e["type"] == kind]


async def test_reconnect_after_max_session_duration_replays_the_context(serve_url):
    """max_session_duration: the plugin closes the connection (code 1000) and opens a new one,
    on which it sends its options, its tools and its whole chat context again (items with
    their ids, each after the previous one). The new server session takes every item, and the
    conversation carries on there: a function output answering a replayed call is read."""
    # 3 s: the setup below takes about 1.5 s, the checks after the reconnect under 1 s, so
    # there is exactly one reconnect while the test talks (the next would be 3 s later)
    async with Harness(serve_url, turn_detection=None, max_session_duration=3.0) as h:
        reconnected = []
        h.session.on("session_reconnected", reconnected.append)
        await h.session.update_instructions("You are a weather assistant.")
        await h.session.update_tools([get_weather])
        await h.session.update_chat_ctx(_history())
        text, _, _ = await h.reply()  # answers with the history's function output
        assert "rainy in Paris" in text, h.summary()
        await say_hello(h, "And in Nice?")
        _, _, calls = await h.reply()  # the scripted engine calls the offered tool
        assert [c.name for c in calls] == ["get_weather"], h.summary()
        before = _ids(h.session.chat_ctx)
        # the plugin replays all but system messages (chat_ctx.copy(exclude_instructions=True))
        expected = [
            i.id for i in h.session.chat_ctx.items if not (i.type == "message" and i.role == "system")
        ]
        first_session = h.of("session.created")[0]["session"]["id"]
        sent_before = len(h.sent)

        await h.until(lambda x: reconnected and len(x.of("session.created")) == 2, timeout=10)
        await h.until(lambda x: len(_after_reconnect(x, "conversation.item.added")) >= len(expected))
        assert h.of("session.created")[1]["session"]["id"] != first_session
        replay = h.sent[sent_before:]
        if [e["type"] for e in replay].count("session.update") > 2:  # a later reconnect's replay
            replay = replay[: [i for i, e in enumerate(replay) if e["type"] == "session.update"][2]]
        kinds = [e["type"] for e in replay]
        assert kinds[:2] == ["session.update", "session.update"], kinds  # options, then tools
        assert replay[0]["session"]["instructions"] == "You are a weather assistant."
        assert [t["name"] for t in replay[1]["session"]["tools"]] == ["get_weather"]
        creates = [e for e in replay if e["type"] == "conversation.item.create"]
        replayed = [e["item"]["id"] for e in creates]
        assert replayed == expected, (before, replayed)
        assert [e["previous_item_id"] for e in creates] == ["root", *replayed[:-1]]
        added = [e["item"]["id"] for e in _after_reconnect(h, "conversation.item.added")]
        assert added == replayed, h.summary()
        assert _ids(h.session.chat_ctx) == expected
        assert not h.of("error") and not h.errors, h.summary()

        # the conversation goes on on the new connection: the tool's output answers its call
        ctx = h.session.chat_ctx.copy()
        ctx.items.append(
            llm.FunctionCallOutput(
                call_id=calls[0].call_id, name="get_weather", output="sunny in Nice", is_error=False
            )
        )
        await h.session.update_chat_ctx(ctx)
        text, frames, _ = await h.reply()
        assert "sunny in Nice" in text and frames > 0, h.summary()
        assert len(h.of("session.created")) == 2, "reconnected again while the test talked"
        assert not h.errors and not h.of("error"), h.summary()


async def test_reconnect_replay_does_not_deliver_answered_outputs_again(serve_url):
    """After the reconnect (max_session_duration; 20 min by default) the plugin replays the
    history, including a function output the model already answered, followed by that answer.
    The first response on the new connection must not be given that output as a new result
    (the scripted engine says every output it is given)."""
    async with Harness(serve_url, turn_detection=None, max_session_duration=3.0) as h:
        reconnected = []
        h.session.on("session_reconnected", reconnected.append)
        await h.session.update_chat_ctx(_history())
        text, _, _ = await h.reply()
        assert text.startswith("rainy in Paris"), h.summary()  # answered on this connection
        await h.until(lambda x: reconnected and len(x.of("session.created")) == 2, timeout=10)
        await h.until(lambda x: len(_after_reconnect(x, "conversation.item.added")) >= 5)
        await say_hello(h, "Thanks!")
        text, frames, _ = await h.reply()
        assert frames > 0 and not h.of("error") and not h.errors, h.summary()
        assert "rainy in Paris" not in text, f"an answered output was delivered again: {text[:60]!r}"


async def test_text_modality_interrupt_and_truncate_by_transcript(serve_url):
    """A text-only model (modalities=["text"], e.g. paired with a TTS): words stream as
    output_text, no audio; after an interruption AgentSession truncates by the forwarded text,
    which the plugin sends as a delete and a create of the assistant message under its id."""
    async with Harness(serve_url, turn_detection=None, modalities=["text"]) as h:
        await updated(h, 1)
        assert h.sent_of("session.update")[0]["session"]["output_modalities"] == ["text"]
        await say_hello(h)
        generation = await asyncio.wait_for(h.session.generate_reply(), 10)
        message = await asyncio.wait_for(generation.message_stream.__anext__(), 10)
        first = await asyncio.wait_for(message.text_stream.__anext__(), 10)
        h.session.interrupt()
        rest = [piece async for piece in message.text_stream]
        assert await message.modalities == ["text"]
        assert [f async for f in message.audio_stream] == []
        await h.until(lambda x: x.of("response.done"))
        assert h.of("response.done")[0]["response"]["status"] == "cancelled", h.summary()
        assert h.of("response.output_text.delta") and not h.of("response.output_audio.delta")
        # what the TTS had spoken when the user cut in: less than the server's transcript
        forwarded = str(first).strip()[:3]
        assert forwarded and forwarded != "".join([str(first), *map(str, rest)])
        h.session.truncate(
            message_id=message.message_id, modalities=["text"], audio_end_ms=0, audio_transcript=forwarded
        )
        await h.until(
            lambda x: x.of("conversation.item.deleted") and len(x.of("conversation.item.added")) >= 3
        )
        readded = h.of("conversation.item.added")[-1]["item"]
        assert readded["id"] == message.message_id and readded["content"][0]["text"] == forwarded, readded
        assert h.session.chat_ctx.get_by_id(message.message_id).text_content == forwarded
        await say_hello(h, "Go on")
        text, frames, _ = await h.reply()
        assert text and frames == 0, h.summary()
        assert no_trouble(h), h.summary()


async def test_agent_handoff_on_the_reused_session(serve_url):
    """A handoff to another agent while the first one speaks, as AgentActivity does with a
    reused realtime session: interrupt(), clear_audio(), then the new agent's instructions,
    chat context (the old one plus a note) and tools. The old answer ends cancelled, every
    update applies, and the new agent's first reply calls its tool."""
    async with Harness(serve_url, turn_detection=None) as h:
        await say_hello(h)
        generation, message, _ = await start_reply(h)
        h.session.interrupt()
        h.session.clear_audio()
        await h.session.update_instructions("You are the weather agent.")
        handed = h.session.chat_ctx.copy()
        handed.add_message(role="system", content="The user was handed over from the greeter.")
        handed.add_message(role="user", content="What is the weather in Paris?")
        await h.session.update_chat_ctx(handed)
        await h.session.update_tools([get_weather])
        await asyncio.wait_for(drain(message), 10)
        _, _, calls = await h.reply()
        assert [c.name for c in calls] == ["get_weather"], h.summary()
        statuses = [e["response"]["status"] for e in h.of("response.done")]
        assert statuses == ["cancelled", "completed"], h.summary()
        updates = [e["session"] for e in h.of("session.updated")]
        assert updates[-2]["instructions"] == "You are the weather agent.", updates
        assert [t["name"] for t in updates[-1]["tools"]] == ["get_weather"]
        assert no_trouble(h), h.summary()


async def test_push_video_frames_are_kept_as_markers_and_the_session_carries_on(serve_url):
    """push_video (AgentSession with video input on) sends each frame as a user message with
    an input_image part. No engine here sees: the server keeps the part as a marker, without
    the image, and says nothing (it answered not_supported, which the plugin logged as an
    error for every frame); the session carries on."""
    async with Harness(serve_url, turn_detection=None) as h:
        frame = rtc.VideoFrame(4, 4, rtc.VideoBufferType.RGBA, bytes(4 * 4 * 4))
        h.session.push_video(frame)
        await h.until(lambda x: x.of("conversation.item.done"))
        item = h.of("conversation.item.done")[0]["item"]
        assert item["role"] == "user" and item["content"] == [{"type": "input_image"}], item
        assert item["id"] == h.sent_of("conversation.item.create")[0]["item"]["id"]
        await say_hello(h)
        text, frames, _ = await h.reply()
        assert text and frames > 0, h.summary()
        assert no_trouble(h), h.summary()


# --- the embedded engine (the default engine's real speech) -------------------------------------


async def test_text_and_push_to_talk_turns_on_the_embedded_engine(embedded_url, speech_24k):
    """The same plugin paths on the embedded engine: a torch thinker (random weights: its
    words mean nothing) and Piper's real speech."""
    async with Harness(embedded_url, turn_detection=None) as h:
        # A response may end at the engine's token limit (incomplete): the plugin then fails
        # its generation's done future, which only it awaits (before a reconnect). Read it.
        generations = []
        h.session.on("generation_created", lambda _ev: generations.append(h.session._current_generation))
        await say_hello(h)
        text, frames, _ = await h.reply(timeout=60)
        assert text and frames > 0, h.summary()
        for frame in _frames(speech_24k):
            h.session.push_audio(frame)
        h.session.commit_audio()
        await h.until(lambda x: x.of("input_audio_buffer.committed") or x.of("error"))
        text, frames, _ = await h.reply(timeout=60)
        assert text and frames > 0, h.summary()
        for generation in generations:
            with contextlib.suppress(llm.RealtimeError):
                await generation._done_fut
        statuses = [e["response"]["status"] for e in h.of("response.done")]
        assert len(statuses) == 2 and set(statuses) <= {"completed", "incomplete"}, h.summary()
        assert not h.errors and not h.of("error"), h.summary()


# --- AgentSession: livekit's own runtime driving the model, without a room -------------------
#
# How nearly every livekit user runs the plugin: ``AgentSession(llm=RealtimeModel(...))`` and
# ``session.start(agent)``. Without a room (no job context either), the session takes the audio
# input and output it is given: a Mic that yields a 20 ms frame every 20 ms (silence unless
# speech was queued) and a Speaker that plays what it gets at real time on a clock, pausable,
# reporting playback as a sink must (AgentSession truncates at what it reports as played).
# Everything else is AgentSession's defaults unless a test says otherwise.


class Mic(voice_io.AudioInput):
    """A microphone: 20 ms frames at real-time pace, silence unless ``say`` queued speech."""

    FRAME = GA_RATE // 50 * 2

    def __init__(self) -> None:
        super().__init__(label="test mic")
        self._queued = bytearray()
        self._next: float | None = None

    def say(self, pcm: bytes) -> None:
        self._queued += pcm

    async def __anext__(self) -> rtc.AudioFrame:
        loop = asyncio.get_running_loop()
        self._next = (loop.time() if self._next is None else self._next) + 0.02
        await asyncio.sleep(max(0.0, self._next - loop.time()))
        chunk = bytes(self._queued[: self.FRAME]).ljust(self.FRAME, b"\0")
        del self._queued[: self.FRAME]
        return rtc.AudioFrame(chunk, sample_rate=GA_RATE, num_channels=1, samples_per_channel=self.FRAME // 2)


class Speaker(voice_io.AudioOutput):
    """Plays at real time (a clock, no device); ``segments`` holds (seconds received, seconds
    played, interrupted) per played segment, ``pauses`` counts pause() calls."""

    def __init__(self) -> None:
        super().__init__(
            label="test speaker",
            capabilities=voice_io.AudioOutputCapabilities(pause=True),
            sample_rate=GA_RATE,
        )
        self.segments: list[tuple[float, float, bool]] = []
        self.pauses = 0
        self._pushed = 0.0
        self._start = 0.0
        self._paused_at: float | None = None
        self._paused_total = 0.0
        self._playout: asyncio.Task | None = None
        self._cleared = asyncio.Event()

    def _played(self) -> float:
        now = self._paused_at if self._paused_at is not None else time.monotonic()
        return max(0.0, min(now - self._start - self._paused_total, self._pushed))

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if self._playout is not None and not self._playout.done():
            await self._playout  # the previous segment plays out first
        if not self._pushed:
            self._start, self._paused_total = time.monotonic(), 0.0
            self.on_playback_started(created_at=time.time())
        self._pushed += frame.duration

    def flush(self) -> None:
        super().flush()
        if self._pushed:
            self._playout = asyncio.ensure_future(self._play_out())

    def clear_buffer(self) -> None:
        if self._pushed:
            self._cleared.set()

    def pause(self) -> None:
        self.pauses += 1
        if self._paused_at is None:
            self._paused_at = time.monotonic()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._paused_total += time.monotonic() - self._paused_at
            self._paused_at = None

    async def _play_out(self) -> None:
        while not self._cleared.is_set() and (self._paused_at is not None or self._played() < self._pushed):
            wait = 0.05 if self._paused_at is not None else self._pushed - self._played()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._cleared.wait(), min(max(wait, 0.005), 0.05))
        interrupted = self._cleared.is_set()
        played = self._played() if interrupted else self._pushed
        self.segments.append((self._pushed, played, interrupted))
        self._pushed, self._paused_at = 0.0, None
        self._cleared.clear()
        self.on_playback_finished(playback_position=played, interrupted=interrupted)


_SESSION_EVENTS = (
    "agent_state_changed",
    "user_state_changed",
    "conversation_item_added",
    "user_input_transcribed",
    "function_tools_executed",
    "speech_created",
    "agent_false_interruption",
    "error",
)


class SessionHarness:
    """An AgentSession on a RealtimeModel pointed at the server, with a Mic and a Speaker. The
    plugin's wire traffic is recorded from the realtime session AgentSession makes (the
    model's ``session()`` is wrapped to subscribe before the connection opens), as are the
    session's events, every livekit warning or error log and asyncio's error logs."""

    def __init__(self, serve_url: str, *, model_options=None, **session_options) -> None:
        self.serve_url = serve_url
        self.model_options = model_options or {}
        self.session_options = session_options
        self.raw: list[dict] = []
        self.sent: list[dict] = []
        self.events: list[tuple[str, object]] = []
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.mic = Mic()
        self.speaker = Speaker()

    async def __aenter__(self):
        self.http = aiohttp.ClientSession()
        self.model = RealtimeModel(
            base_url=self.serve_url,
            api_key=API_KEY,
            model="gpt-realtime",
            http_session=self.http,
            **self.model_options,
        )
        make_session = self.model.session

        def session(*args, **kwargs):
            rt = make_session(*args, **kwargs)
            rt.on("openai_server_event_received", self.raw.append)
            rt.on("openai_client_event_queued", self._record_sent)
            return rt

        self.model.session = session
        self.session = AgentSession(llm=self.model, **self.session_options)
        for name in _SESSION_EVENTS:
            self.session.on(name, lambda ev, name=name: self.events.append((name, ev)))
        self.session.input.audio = self.mic
        self.session.output.audio = self.speaker
        self._log = _ErrorLog(self.errors)
        self._warn_log = _WarningLog(self.warnings)
        logging.getLogger("livekit").addHandler(self._log)
        logging.getLogger("livekit").addHandler(self._warn_log)
        # a failed future or task nobody awaits (e.g. a generation's done future) is logged here
        logging.getLogger("asyncio").addHandler(self._log)
        return self

    def _record_sent(self, event: dict) -> None:
        if event.get("type") == "input_audio_buffer.append":
            return
        self.sent.append(json.loads(json.dumps(event, default=str)))

    async def __aexit__(self, *exc):
        try:
            await self.session.aclose()
            await self.model.aclose()
            await self.http.close()
        finally:
            logging.getLogger("livekit").removeHandler(self._log)
            logging.getLogger("livekit").removeHandler(self._warn_log)
            logging.getLogger("asyncio").removeHandler(self._log)

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.raw if e.get("type") == kind]

    def sent_of(self, kind: str) -> list[dict]:
        return [e for e in self.sent if e.get("type") == kind]

    def events_of(self, name: str) -> list:
        return [ev for n, ev in self.events if n == name]

    def agent_states(self) -> list[str]:
        return [ev.new_state for ev in self.events_of("agent_state_changed")]

    def added(self, role: str | None = None) -> list:
        """Chat messages of conversation_item_added (of ``role``)."""
        items = [ev.item for ev in self.events_of("conversation_item_added")]
        return [i for i in items if i.type == "message" and (role is None or i.role == role)]

    async def until(self, predicate, timeout: float = 10.0) -> None:
        await poll_until(self, predicate, timeout, step=0.02)

    def server_errors(self) -> list[dict]:
        return [e["error"] for e in self.of("error")]

    def summary(self) -> str:
        return (
            f"livekit errors: {self.errors[:6]}; warnings: {self.warnings[:6]}; "
            f"server errors: {self.server_errors()[:6]}; agent states: {self.agent_states()}; "
            f"speaker: {self.speaker.segments}; "
            f"server events: {[e.get('type') for e in self.raw if 'delta' not in e.get('type', '')][-40:]}; "
            f"sent: {[e.get('type') for e in self.sent][-25:]}"
        )

    def no_trouble(self) -> bool:
        """No livekit error or warning log, no session error event, and no server error but
        OpenAI's answer to a second response.cancel (AgentSession's interrupt() cancels, and
        its generation task cancels again; the plugin ignores "Cancellation failed")."""
        cancels_only = all(e["code"] == "response_cancel_not_active" for e in self.server_errors())
        return not self.errors and not self.warnings and not self.events_of("error") and cancels_only


@pytest.fixture(scope="module")
def never_mind_24k() -> bytes:
    """A short user turn to talk over the agent with (about 1.3 s), then 1 s of silence."""
    pytest.importorskip("piper")
    from duplex_actors.audio.utterances import synthesize_utterance

    return synthesize_utterance("Actually, never mind.", sample_rate=GA_RATE) + b"\x00\x00" * GA_RATE


def _approx_s(seconds: float):
    return pytest.approx(seconds, abs=0.05)


#: An answer of the scripted engine: 12 packets of 160 ms.
ANSWER_S = 1.92


def _history_messages(h: SessionHarness) -> list:
    return [i for i in h.session.history.items if i.type == "message"]


def _finals(h: SessionHarness) -> list:
    return [ev for ev in h.events_of("user_input_transcribed") if ev.is_final]


async def test_agent_session_answers_generate_reply_and_a_spoken_turn(serve_url, speech_24k):
    """AgentSession's defaults on RealtimeModel's (server VAD, input transcription):
    session.generate_reply() is answered and plays whole; then the user speaks at microphone
    pace, the server ends the turn and answers it, the words come back as a final
    user_input_transcribed and a user message, and the states go as AgentSession documents."""
    async with SessionHarness(serve_url) as h:
        await h.session.start(Agent(instructions="You are a helpful assistant."))
        greeting = h.session.generate_reply(instructions="Greet the user.")
        await asyncio.wait_for(greeting, 10)  # a SpeechHandle resolves once played out
        assert not greeting.interrupted and h.speaker.segments == [
            (_approx_s(ANSWER_S), _approx_s(ANSWER_S), False)
        ]

        h.mic.say(speech_24k)
        await h.until(
            lambda x: len(x.speaker.segments) == 2 and x.session.agent_state == "listening" and _finals(x)
        )
        assert h.speaker.segments[1] == (_approx_s(ANSWER_S), _approx_s(ANSWER_S), False), h.summary()
        assert h.agent_states() == ["listening", "speaking", "listening", "speaking", "listening"], (
            h.summary()
        )
        assert [ev.new_state for ev in h.events_of("user_state_changed")] == ["speaking", "listening"]

        # the server's VAD committed the turn and created its response (AgentSession sent neither)
        assert [e["type"] for e in h.sent if e["type"].startswith(("response.", "input_audio_buffer."))] == [
            "response.create"
        ], h.summary()
        committed = h.of("input_audio_buffer.committed")
        assert len(committed) == 1, h.summary()
        done = [e["response"] for e in h.of("response.done")]
        assert [d["status"] for d in done] == ["completed", "completed"], h.summary()

        final = _finals(h)
        assert (
            len(final) == 1
            and "weather" in final[0].transcript
            and final[0].item_id == committed[0]["item_id"]
        )
        user = h.added("user")
        assert [(m.id, m.text_content) for m in user] == [(committed[0]["item_id"], final[0].transcript)]
        assistant = h.added("assistant")
        assert [m.id for m in assistant] == [d["output"][0]["id"] for d in done], h.summary()
        assert [m.text_content for m in assistant] == [
            d["output"][0]["content"][0]["transcript"] for d in done
        ]
        assert [m.role for m in _history_messages(h)] == ["assistant", "user", "assistant"]
        assert h.no_trouble(), h.summary()


async def test_agent_session_barge_in_under_server_vad(paced_serve_url, speech_24k, never_mind_24k):
    """The user talks over the answer (server VAD): AgentSession interrupts on the server's
    speech_started (response.cancel), stops the Speaker and truncates the message at what was
    played; the server ends the response cancelled, applies the truncation, commits the new
    turn and answers it, and that answer plays whole. The history holds the interrupted
    answer as interrupted. The paced server keeps the answer generating past the barge-in
    (at the default pace a loaded host could finish it first: then it is completed)."""
    async with SessionHarness(paced_serve_url) as h:
        await h.session.start(Agent(instructions="You are a helpful assistant."))
        # the greeting: AgentSession's echo guard (aec_warmup_duration, 3 s from the first
        # speech) silences the microphone while the agent speaks; it is over by the answer
        await asyncio.wait_for(h.session.generate_reply(instructions="Greet the user."), 10)
        h.mic.say(speech_24k)
        await h.until(lambda x: len(x.of("response.created")) == 2 and x.session.agent_state == "speaking")
        await asyncio.sleep(0.4)
        h.mic.say(never_mind_24k)
        await h.until(lambda x: len(x.speaker.segments) == 3 and x.session.agent_state == "listening")
        await h.until(lambda x: len(_finals(x)) == 2 and x.of("conversation.item.truncated"))

        greeting, cut, answer = h.speaker.segments
        assert not greeting[2] and cut[2] and not answer[2], h.summary()
        assert 0.3 < cut[1] < ANSWER_S and answer[1] == _approx_s(ANSWER_S), h.summary()
        done = [e["response"] for e in h.of("response.done")]
        assert [d["status"] for d in done] == ["completed", "cancelled", "completed"], h.summary()
        assert done[1]["status_details"]["reason"] in ("client_cancelled", "turn_detected")
        assert h.sent_of("response.cancel"), h.summary()
        interrupted_id = done[1]["output"][0]["id"]
        truncate = h.sent_of("conversation.item.truncate")
        assert [(t["item_id"], t["audio_end_ms"]) for t in truncate] == [(interrupted_id, int(cut[1] * 1000))]
        truncated = h.of("conversation.item.truncated")
        assert [(t["item_id"], t["audio_end_ms"]) for t in truncated] == [
            (interrupted_id, int(cut[1] * 1000))
        ]

        messages = {m.id: m for m in _history_messages(h)}
        assert messages[interrupted_id].interrupted, messages
        assert not messages[done[2]["output"][0]["id"]].interrupted
        said = sorted(m.text_content for m in messages.values() if m.role == "user")
        assert "weather" in said[1] and "never" in said[0], said
        assert len(h.of("input_audio_buffer.committed")) == 2, h.summary()
        assert h.no_trouble(), h.summary()


async def test_agent_session_runs_a_function_tool_and_plays_the_follow_up(serve_url):
    """A @function_tool on the Agent: the model calls it (the scripted engine calls an offered
    tool on a turn without function output), AgentSession runs it, sends its output
    (conversation.item.create) and asks for the follow-up (response.create); the answer reads
    the output and plays. The history has the call and its output."""
    calls = []

    @function_tool
    async def lookup_weather(city: str) -> str:
        """Get the weather in a city."""
        calls.append(city)
        return get_weather_impl(city)

    async with SessionHarness(serve_url) as h:
        await h.session.start(Agent(instructions="You tell the weather.", tools=[lookup_weather]))
        handle = h.session.generate_reply(user_input="What is the weather in Paris?")
        await asyncio.wait_for(handle, 10)
        await h.until(lambda x: x.session.agent_state == "listening" and len(x.of("response.done")) == 2)

        assert calls == ["example"], h.summary()  # the scripted engine's example arguments
        executed = h.events_of("function_tools_executed")
        assert len(executed) == 1 and [o.output for o in executed[0].function_call_outputs] == [
            "sunny in example"
        ]
        call = h.of("response.function_call_arguments.done")[0]
        outputs = [
            e["item"]
            for e in h.sent_of("conversation.item.create")
            if e["item"]["type"] == "function_call_output"
        ]
        assert [(o["call_id"], o["output"]) for o in outputs] == [(call["call_id"], "sunny in example")]
        follow_up = h.sent_of("response.create")[-1]["response"]
        assert follow_up.get("tool_choice") == "auto", follow_up
        done = [e["response"] for e in h.of("response.done")]
        assert [d["status"] for d in done] == ["completed", "completed"], h.summary()
        assert h.speaker.segments == [(_approx_s(ANSWER_S), _approx_s(ANSWER_S), False)], h.summary()
        assert "thinking" in h.agent_states() and h.agent_states()[-2:] == ["speaking", "listening"]
        answer = h.added("assistant")[-1]
        assert answer.text_content.startswith("sunny in example"), answer.text_content
        kinds = [
            i.type
            for i in h.session.history.items
            if i.type in ("message", "function_call", "function_call_output")
        ]
        assert kinds == ["message", "function_call", "function_call_output", "message"], kinds
        assert h.no_trouble(), h.summary()


async def test_agent_session_handoff_and_update_agent(serve_url):
    """Agents as users chain them: the greeter's tool returns another Agent (a handoff), then
    the app calls session.update_agent() with a third. Each time AgentSession keeps the
    realtime session and sends the new agent's instructions and tools (and its chat context:
    the weather agent starts empty, so the old items are deleted; the last one carries the
    weather agent's context but not the calls of tools it lacks, which are deleted). The
    server applies each update, and each new agent's first reply uses what it was given: the
    weather agent calls its own tool, the tool-less farewell agent answers without one."""
    calls = []

    @function_tool
    async def lookup_weather(city: str) -> str:
        """Get the weather in a city."""
        calls.append(city)
        return get_weather_impl(city)

    class WeatherAgent(Agent):
        def __init__(self) -> None:
            super().__init__(instructions="You are the weather agent.", tools=[lookup_weather])

        async def on_enter(self) -> None:
            self.session.generate_reply(instructions="Tell the user the weather.")

    class Greeter(Agent):
        def __init__(self) -> None:
            super().__init__(instructions="You are the greeter.")

        @function_tool
        async def transfer_to_weather(self):
            """Hand the user over to the weather agent."""
            return WeatherAgent(), "Transferring you"

    async with SessionHarness(serve_url) as h:
        await h.session.start(Greeter())
        await asyncio.wait_for(h.session.generate_reply(user_input="I want the weather"), 10)
        await h.until(lambda x: len(x.speaker.segments) == 2 and x.session.agent_state == "listening")
        assert calls == ["example"], h.summary()
        updated = [e["session"] for e in h.of("session.updated")]
        assert updated[-2]["instructions"] == "You are the weather agent.", h.summary()
        assert [t["name"] for t in updated[-1]["tools"]] == ["lookup_weather"]
        # the handoff's own reply is asked for without tools (AgentSession is draining)
        creates = [e["response"] for e in h.sent_of("response.create")]
        assert creates[1].get("tool_choice") == "none", creates
        done = [e["response"] for e in h.of("response.done")]
        # a call-only response carries only its call (GA), no empty assistant message before it
        assert [[o["type"] for o in d["output"]] for d in done] == [
            ["function_call"],  # transfer_to_weather
            ["message"],  # "Transferring you ..."
            ["function_call"],  # the weather agent's lookup_weather
            ["message"],  # "sunny in example ..."
        ], h.summary()
        assert done[2]["output"][0]["name"] == "lookup_weather"
        assert h.added("assistant")[-1].text_content.startswith("sunny in example")
        deleted = len(h.of("conversation.item.deleted"))
        assert deleted == len(h.sent_of("conversation.item.delete")) > 0, h.summary()

        h.session.update_agent(
            Agent(instructions="You are the farewell agent.", chat_ctx=h.session.current_agent.chat_ctx)
        )
        # the switch is asynchronous: the new activity starts once the server took its tools
        await h.until(lambda x: [e["session"]["tools"] for e in x.of("session.updated")][-1] == [])
        updated = [e["session"] for e in h.of("session.updated")]
        assert updated[-2]["instructions"] == "You are the farewell agent.", h.summary()
        await h.until(lambda x: len([i for i in x.session.history.items if i.type == "agent_handoff"]) == 3)
        await asyncio.wait_for(h.session.generate_reply(instructions="Say goodbye."), 10)
        # Agent(chat_ctx=...) keeps the calls of its own tools only (ChatContext.copy(tools=)):
        # the weather agent's call and output are deleted, its messages stay
        call = done[2]["output"][0]
        dropped = [e["item_id"] for e in h.of("conversation.item.deleted")[deleted:]]
        output_id = next(
            e["item"]["id"]
            for e in h.sent_of("conversation.item.create")
            if e["item"].get("call_id") == call["call_id"]
        )
        assert dropped == [call["id"], output_id], h.summary()
        done = h.of("response.done")[-1]["response"]
        assert [o["type"] for o in done["output"]] == ["message"] and done["status"] == "completed"
        assert not done["output"][0]["content"][0]["transcript"].startswith("sunny"), done  # nothing re-read
        assert len(h.speaker.segments) == 3 and not h.speaker.segments[-1][2], h.summary()
        handoffs = [i for i in h.session.history.items if i.type == "agent_handoff"]
        assert len(handoffs) == 3, h.session.history.items
        assert h.no_trouble(), h.summary()


async def test_agent_session_client_vad_pauses_truncates_and_answers(serve_url, speech_24k, never_mind_24k):
    """turn_detection="vad" (AgentSession's own Silero VAD; the model's server VAD is turned
    off, as livekit documents for client-side turn taking): each end of speech is committed
    (input_audio_buffer.commit) and answered (response.create). Talking over the answer
    pauses the Speaker after min_interruption_duration (resume_false_interruption's pause);
    the end of that turn commits it, which ends the paused answer: AgentSession truncates it
    at what played and asks for the next answer, which plays. No false interruption fires."""
    async with SessionHarness(serve_url, turn_handling={"turn_detection": "vad"}) as h:
        await h.session.start(Agent(instructions="You are a helpful assistant."))
        await asyncio.wait_for(h.session.generate_reply(instructions="Greet the user."), 10)
        opening = h.sent_of("session.update")[0]["session"]
        assert opening["audio"]["input"]["turn_detection"] is None, opening
        assert h.of("session.updated")[0]["session"]["audio"]["input"]["turn_detection"] is None
        h.mic.say(speech_24k)
        await h.until(
            lambda x: len(x.sent_of("response.create")) == 2 and x.session.agent_state == "speaking"
        )
        await asyncio.sleep(0.4)
        h.mic.say(never_mind_24k)
        await h.until(lambda x: x.speaker.pauses > 0, timeout=5)
        assert h.session.agent_state == "listening", h.summary()  # paused, not yet interrupted
        await h.until(lambda x: len(x.speaker.segments) == 3 and x.session.agent_state == "listening")
        await h.until(lambda x: x.of("conversation.item.truncated") and len(_finals(x)) == 2)

        greeting, cut, answer = h.speaker.segments
        assert cut[2] and not answer[2] and answer[1] == _approx_s(ANSWER_S), h.summary()
        assert (
            len(h.sent_of("input_audio_buffer.commit")) == 2
            and len(h.of("input_audio_buffer.committed")) == 2
        )
        assert len(h.sent_of("response.create")) == 3, h.summary()
        cut_id = h.of("response.done")[1]["response"]["output"][0]["id"]
        truncated = h.of("conversation.item.truncated")
        assert [(t["item_id"], t["audio_end_ms"]) for t in truncated] == [(cut_id, int(cut[1] * 1000))], (
            h.summary()
        )
        assert [d["response"]["status"] for d in h.of("response.done")][-1] == "completed"
        assert not h.events_of("agent_false_interruption")
        messages = {m.id: m for m in _history_messages(h)}
        assert messages[cut_id].interrupted
        assert h.no_trouble(), h.summary()


async def test_agent_session_user_talks_while_a_tool_runs(serve_url, speech_24k):
    """The user speaks while a function tool runs (server VAD): the tool finishes and
    AgentSession sends its output while the user's turn is still open; the server commits
    the turn after that output and answers with it (the scripted engine says the outputs it
    reads first). One answer plays, with the output, and nothing fails."""
    started = asyncio.Event()

    @function_tool
    async def lookup_weather(city: str) -> str:
        """Get the weather in a city."""
        started.set()
        await asyncio.sleep(1.5)
        return get_weather_impl(city)

    async with SessionHarness(serve_url) as h:
        await h.session.start(Agent(instructions="You tell the weather.", tools=[lookup_weather]))
        h.session.generate_reply(user_input="What is the weather in Paris?")
        await asyncio.wait_for(started.wait(), 5)
        h.mic.say(speech_24k)
        await h.until(lambda x: x.speaker.segments and x.session.agent_state == "listening" and _finals(x))

        output = [
            e for e in h.sent_of("conversation.item.create") if e["item"]["type"] == "function_call_output"
        ]
        assert [e["item"]["output"] for e in output] == ["sunny in example"], h.summary()
        committed = h.of("input_audio_buffer.committed")
        assert len(committed) == 1 and committed[0]["previous_item_id"] == output[0]["item"]["id"], (
            h.summary()
        )
        done = [e["response"] for e in h.of("response.done")]
        assert [d["status"] for d in done] == ["completed", "completed"], h.summary()
        answer = done[-1]["output"][0]["content"][0]["transcript"]
        assert answer.startswith("sunny in example"), answer
        assert h.speaker.segments == [(_approx_s(ANSWER_S), _approx_s(ANSWER_S), False)], h.summary()
        assert h.added("assistant")[-1].text_content == answer
        assert h.no_trouble(), h.summary()
