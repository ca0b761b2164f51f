"""openai-agents' RealtimeAgent / RealtimeRunner against `duplex-actors serve`, unmodified.

Configured the way a user points it at another server: ``model_config={"url", "api_key"}``.
Every assertion is the GA behaviour the SDK relies on; the SDK's own ``error`` events (it
validates every server event with the openai package's pydantic models) fail the test.
"""

from __future__ import annotations

import asyncio

import pytest

from .conftest import API_KEY, chunks, get_weather_impl

agents_realtime = pytest.importorskip("agents.realtime")
pytestmark = [pytest.mark.interop, pytest.mark.anyio, pytest.mark.timeout(120)]

from agents import function_tool  # noqa: E402
from agents.realtime import RealtimeAgent, RealtimeRunner  # noqa: E402
from agents.realtime.model_inputs import RealtimeModelSendRawMessage  # noqa: E402

calls: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """Get the weather in a city."""
    calls.append(city)
    return get_weather_impl(city)


def _describe(error) -> str:
    """One line per failed check of a pydantic ValidationError (which event, which field)."""
    inner = getattr(error, "error", error)
    errors = getattr(inner, "errors", None)
    if callable(errors):
        try:
            return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors()[:6])
        except Exception:  # not a pydantic error after all
            pass
    return repr(inner)[:300]


class Recorder:
    """Collects the session's events: the SDK's own and the raw server events."""

    def __init__(self, session) -> None:
        self.session = session
        self.events: list = []
        self.raw: list[dict] = []
        self.errors: list = []

    async def until(self, predicate, timeout: float = 20.0):
        async def run():
            async for event in self.session:
                self.events.append(event)
                if event.type == "error":
                    self.errors.append(_describe(event.error))
                if event.type == "raw_model_event" and event.data.type == "raw_server_event":
                    self.raw.append(event.data.data)
                if predicate(event, self):
                    return event
            raise AssertionError("session ended")

        try:
            return await asyncio.wait_for(run(), timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"timed out; {self.summary()}") from None

    def summary(self) -> str:
        """What went wrong, for the failure message: the SDK's errors and the server's."""
        server_errors = [e.get("error") for e in self.raw if e.get("type") == "error"]
        return (
            f"sdk errors: {self.errors}; server errors: {server_errors}; "
            f"server events: {[e.get('type') for e in self.raw][:40]}"
        )

    def done_responses(self) -> list[dict]:
        return [e["response"] for e in self.raw if e.get("type") == "response.done"]


def _responses_done(n: int):
    return lambda event, rec: len(rec.done_responses()) >= n


def _runner(turn_detection, tools: list) -> RealtimeRunner:
    # Tools only where the test is about them: the scripted engine calls an offered tool on
    # every first turn (docs/engines.md), which would turn a plain turn into a tool call.
    agent = RealtimeAgent(name="assistant", instructions="Be brief.", tools=tools)
    settings = {"model_name": "gpt-realtime", "output_modalities": ["audio"]}
    if turn_detection != "default":
        settings["turn_detection"] = turn_detection
    return RealtimeRunner(agent, config={"model_settings": settings})


async def _open(serve_url, turn_detection="default", tools: list | None = None):
    runner = _runner(turn_detection, tools or [])
    return await runner.run(model_config={"url": serve_url, "api_key": API_KEY})


async def test_text_turn(serve_url):
    session = await _open(serve_url, turn_detection=None)
    async with session:
        rec = Recorder(session)
        await session.send_message("Hello there")
        await rec.until(_responses_done(1))
        assert rec.errors == [], rec.summary()
        assert rec.done_responses()[0]["status"] == "completed"
        assert any(e.type == "audio" for e in rec.events), "no audio reached the SDK"


async def test_push_to_talk_audio_turn(serve_url, speech_24k):
    session = await _open(serve_url, turn_detection=None)
    async with session:
        rec = Recorder(session)
        pieces = chunks(speech_24k)
        for chunk in pieces[:-1]:
            await session.send_audio(chunk)
        await session.send_audio(pieces[-1], commit=True)  # push-to-talk: release = commit
        # With turn detection off a GA server does not answer a commit by itself.
        await session.model.send_event(RealtimeModelSendRawMessage(message={"type": "response.create"}))
        await rec.until(_responses_done(1))
        assert rec.errors == [], rec.summary()
        assert any(e.get("type") == "input_audio_buffer.committed" for e in rec.raw)
        assert rec.done_responses()[0]["status"] == "completed"
        assert any(e.type == "audio" for e in rec.events)


async def _talk_over_the_answer(session, speech_24k) -> Recorder:
    """Say a turn, wait for the answer to begin, say it again over the answer, and wait for
    the answer's response.done."""
    rec = Recorder(session)
    for chunk in chunks(speech_24k):
        await session.send_audio(chunk)
    await rec.until(lambda e, r: any(x.get("type") == "response.created" for x in r.raw))
    for chunk in chunks(speech_24k):
        await session.send_audio(chunk)
    await rec.until(_responses_done(1))
    return rec


async def test_server_vad_turn_with_barge_in(serve_url, speech_24k):
    session = await _open(
        serve_url,
        turn_detection={"type": "server_vad", "interrupt_response": True, "silence_duration_ms": 500},
    )
    async with session:
        # The user talks over the answer: the server must cancel it (turn_detected).
        rec = await _talk_over_the_answer(session, speech_24k)
        first = rec.done_responses()[0]
        assert first["status"] == "cancelled"
        assert first["status_details"]["reason"] == "turn_detected"
        assert any(e.get("type") == "input_audio_buffer.speech_started" for e in rec.raw)
        # ...and answer the new turn.
        await rec.until(_responses_done(2))
        assert rec.done_responses()[1]["status"] == "completed"
        assert rec.errors == [], rec.summary()


async def test_tool_call(serve_url):
    calls.clear()
    session = await _open(serve_url, turn_detection=None, tools=[get_weather])
    async with session:
        rec = Recorder(session)
        await session.send_message("What is the weather in Paris?")
        await rec.until(lambda e, r: e.type == "tool_end")
        assert calls, "the SDK never ran the function"
        # The SDK sends the function_call_output and asks for the follow-up response.
        await rec.until(_responses_done(2))
        follow = rec.done_responses()[1]
        assert follow["status"] == "completed"
        assert rec.errors == [], rec.summary()
        text = [c for item in follow["output"] for c in item.get("content", [])]
        assert any("sunny in" in (c.get("transcript") or c.get("text") or "") for c in text)


async def test_idle_timeout_prompts_a_silent_user(serve_url):
    """GA ``idle_timeout_ms``: nobody speaks after the answer has played, so the server says
    input_audio_buffer.timeout_triggered (the SDK's own input_audio_timeout_triggered event)
    and answers on its own."""
    session = await _open(serve_url, turn_detection={"type": "server_vad", "idle_timeout_ms": 1000})
    async with session:
        rec = Recorder(session)
        await session.send_message("Hello there")
        await rec.until(_responses_done(1))
        await rec.until(lambda e, r: e.type == "input_audio_timeout_triggered")
        await rec.until(_responses_done(2))
        assert rec.done_responses()[1]["status"] == "completed"
        assert rec.errors == [], rec.summary()


async def test_speech_over_the_answer_does_not_interrupt_it_when_interrupt_response_is_false(
    serve_url, speech_24k
):
    """GA ``interrupt_response: false``: the user talks over the answer, which plays to its
    end; the speech is committed as the user's next item."""
    session = await _open(
        serve_url,
        turn_detection={"type": "server_vad", "interrupt_response": False, "silence_duration_ms": 500},
    )
    async with session:
        rec = await _talk_over_the_answer(session, speech_24k)
        assert rec.done_responses()[0]["status"] == "completed"
        await rec.until(
            lambda e, r: [x.get("type") for x in r.raw].count("input_audio_buffer.committed") >= 2
        )
        assert rec.errors == [], rec.summary()
