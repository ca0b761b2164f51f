"""openai-agents' RealtimeAgent / RealtimeRunner against `duplex-actors serve`, unmodified.

Configured the way a user points it at another server: ``model_config={"url", "api_key"}``.
Every assertion is the GA behaviour the SDK relies on; the SDK's own ``error`` events (it
validates every server event with the openai package's pydantic models) fail the test.
"""

from __future__ import annotations

import asyncio
import json
import logging
import warnings

import pytest

from .conftest import API_KEY, check_pieced_transcript, chunks, get_weather_impl

agents_realtime = pytest.importorskip("agents.realtime")
pytestmark = [pytest.mark.interop, pytest.mark.anyio, pytest.mark.timeout(120)]

from agents import GuardrailFunctionOutput, OutputGuardrail, function_tool  # noqa: E402
from agents.realtime import RealtimeAgent, RealtimePlaybackTracker, RealtimeRunner  # noqa: E402
from agents.realtime.model_inputs import RealtimeModelSendRawMessage  # noqa: E402
from agents.realtime.openai_realtime import OpenAIRealtimeWebSocketModel  # noqa: E402

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
        except TimeoutError:
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


# --- What openai-agents users commonly do beyond a plain turn ---------------------------------
#
# Handoffs, session.interrupt(), structured messages, update_agent, output guardrails, tool
# approval, tool_choice, the Twilio example's G.711 + playback tracker, raw client events and
# the common model_settings fields. Each drives the SDK's public API as a user would; the
# `sent` fixture only observes the client events the SDK puts on the wire (evidence for the
# assertions), and `sdk_log` fails a test on any warning the SDK logs (e.g. "Failed to validate
# server event").


@function_tool
def get_time(city: str) -> str:
    """Get the local time in a city."""
    calls.append(f"time:{city}")
    return f"noon in {city}"


@function_tool(needs_approval=True)
def transfer_money(account: str) -> str:
    """Transfer money to an account (asks the user first)."""
    calls.append(f"transfer:{account}")
    return f"sent to {account}"


@pytest.fixture
def sent(monkeypatch) -> list[dict]:
    """Every client event the SDK sends, parsed. Observes the websocket's ``send``; the SDK
    itself is not changed."""
    frames: list[dict] = []
    create = OpenAIRealtimeWebSocketModel._create_websocket_connection

    async def recording(self, *args, **kwargs):
        ws = await create(self, *args, **kwargs)
        send = ws.send

        async def send_and_record(message, *a, **kw):
            frames.append(json.loads(message))
            return await send(message, *a, **kw)

        ws.send = send_and_record
        return ws

    monkeypatch.setattr(OpenAIRealtimeWebSocketModel, "_create_websocket_connection", recording)
    return frames


@pytest.fixture
def sdk_log(caplog):
    """The SDK's own log ("openai.agents") at WARNING and above: a server event it cannot
    validate is logged there as an error."""
    caplog.set_level(logging.WARNING, logger="openai.agents")
    return caplog


def _sdk_warnings(caplog) -> list[str]:
    return [
        f"{r.levelname}: {r.getMessage()[:300]}" for r in caplog.records if r.name.startswith("openai.agents")
    ]


def _settings(**overrides) -> dict:
    """Manual turns (no server VAD) unless a test says otherwise: turns are text messages."""
    return {"model_name": "gpt-realtime", "output_modalities": ["audio"], "turn_detection": None, **overrides}


async def _start(serve_url, agent: RealtimeAgent, settings: dict | None = None, **config):
    runner = RealtimeRunner(agent, config={"model_settings": settings or _settings(), **config})
    return await runner.run(model_config={"url": serve_url, "api_key": API_KEY})


def _of(rec: Recorder, kind: str) -> list[dict]:
    return [e for e in rec.raw if e.get("type") == kind]


def _sdk(rec: Recorder, kind: str) -> list:
    return [e for e in rec.events if e.type == kind]


def _sent(frames: list[dict], kind: str) -> list[dict]:
    return [f for f in frames if f.get("type") == kind]


def _server_errors(rec: Recorder) -> list[dict]:
    return [e["error"] for e in _of(rec, "error")]


def _calls_in(response: dict) -> list[str]:
    return [item["name"] for item in response["output"] if item["type"] == "function_call"]


def _words(response: dict) -> str:
    parts = [c for item in response["output"] for c in item.get("content") or []]
    return " ".join(c.get("transcript") or c.get("text") or "" for c in parts)


async def _reach(rec: Recorder, check, timeout: float = 15.0):
    """Wait until ``check(rec)`` holds (it may already hold: events already read count)."""
    if not check(rec):
        await rec.until(lambda e, r: check(r), timeout)


def _audio_count(n: int):
    return lambda e, r: len(_sdk(r, "audio")) >= n


def _assert_clean(rec: Recorder, sdk_log, allowed_codes: tuple[str, ...] = ()) -> None:
    unexpected = [e for e in _server_errors(rec) if e.get("code") not in allowed_codes]
    assert unexpected == [], rec.summary()
    if not allowed_codes:
        assert rec.errors == [], rec.summary()
    assert _sdk_warnings(sdk_log) == []


# --- 1. handoffs ------------------------------------------------------------------------------


async def test_handoff_moves_the_session_to_the_second_agent_and_its_tools(serve_url, sent, sdk_log):
    """The triage agent offers only its handoff, so the scripted engine calls it
    (docs/engines.md: a turn offering tools calls the first). The SDK then sends a
    session.update with the weather desk's instructions and tools, the transfer's
    function_call_output and a response.create; the next turn runs the weather desk's tool."""
    calls.clear()
    desk = RealtimeAgent(name="weather_desk", instructions="You are the weather desk.", tools=[get_weather])
    triage = RealtimeAgent(name="triage", instructions="Route weather questions.", handoffs=[desk])
    session = await _start(serve_url, triage)
    async with session:
        rec = Recorder(session)
        await session.send_message("I have a weather question")
        handoff = await rec.until(lambda e, r: e.type == "handoff")
        assert handoff.from_agent is triage and handoff.to_agent is desk
        await _reach(rec, lambda r: len(r.done_responses()) >= 2)
        first, second = rec.done_responses()[:2]
        assert first["status"] == "completed" and _calls_in(first) == ["transfer_to_weather_desk"]
        assert second["status"] == "completed" and _calls_in(second) == []
        assert '{"assistant": "weather_desk"}' in _words(second)  # the transfer output reached it

        # On the wire: the new agent's session.update goes out before the follow-up's create,
        # and the server applied it before that response began.
        update = next(
            i
            for i, f in enumerate(sent)
            if f["type"] == "session.update"
            and f["session"].get("instructions") == "You are the weather desk."
        )
        follow_create = [i for i, f in enumerate(sent) if f["type"] == "response.create"][1]
        assert update < follow_create
        types = [e["type"] for e in rec.raw]
        desk_updated = next(
            i
            for i, e in enumerate(rec.raw)
            if e["type"] == "session.updated" and e["session"]["instructions"] == "You are the weather desk."
        )
        second_created = [i for i, t in enumerate(types) if t == "response.created"][1]
        assert desk_updated < second_created
        assert [t["name"] for t in rec.raw[desk_updated]["session"]["tools"]] == ["get_weather"]

        # The following turn is the weather desk's: it calls the desk's own tool.
        await session.send_message("What is the weather in Paris?")
        tool_end = await rec.until(lambda e, r: e.type == "tool_end")
        assert tool_end.agent is desk and tool_end.tool.name == "get_weather"
        assert calls == ["example"]
        await _reach(rec, lambda r: len(r.done_responses()) >= 4)
        third, fourth = rec.done_responses()[2:4]
        assert _calls_in(third) == ["get_weather"]
        assert fourth["status"] == "completed" and "sunny in example" in _words(fourth)
        assert [e.agent.name for e in _sdk(rec, "agent_start")] == [
            "triage",
            "weather_desk",
            "weather_desk",
            "weather_desk",
        ]
        _assert_clean(rec, sdk_log)


async def test_handoff_by_voice_under_server_vad(serve_url, speech_24k, sdk_log):
    """The same handoff from spoken turns (server VAD ends them), as a voice app does."""
    calls.clear()
    desk = RealtimeAgent(name="weather_desk", instructions="You are the weather desk.", tools=[get_weather])
    triage = RealtimeAgent(name="triage", instructions="Route weather questions.", handoffs=[desk])
    td = {"type": "server_vad", "interrupt_response": True, "silence_duration_ms": 500}
    session = await _start(serve_url, triage, _settings(turn_detection=td))
    async with session:
        rec = Recorder(session)
        for chunk in chunks(speech_24k):
            await session.send_audio(chunk)
        await rec.until(lambda e, r: e.type == "handoff")
        await _reach(rec, lambda r: len(r.done_responses()) >= 2)
        assert _calls_in(rec.done_responses()[0]) == ["transfer_to_weather_desk"]
        assert rec.done_responses()[1]["status"] == "completed"
        for chunk in chunks(speech_24k):
            await session.send_audio(chunk)
        await _reach(rec, lambda r: len(r.done_responses()) >= 4)
        third, fourth = rec.done_responses()[2:4]
        assert _calls_in(third) == ["get_weather"] and calls == ["example"]
        assert fourth["status"] == "completed"
        assert len(_of(rec, "input_audio_buffer.committed")) == 2
        _assert_clean(rec, sdk_log)


# --- 2. session.interrupt() -----------------------------------------------------------------


async def test_interrupt_with_manual_turns_truncates_and_cancels_the_response(serve_url, sent, sdk_log):
    """With turn detection off the SDK's interrupt() sends conversation.item.truncate (what
    was heard) and response.cancel: the response ends cancelled (client_cancelled), and the
    next turn is answered."""
    session = await _start(serve_url, RealtimeAgent(name="assistant", instructions="Be brief."))
    async with session:
        rec = Recorder(session)
        await session.send_message("Tell me a long story")
        await rec.until(_audio_count(3))
        assert rec.done_responses() == []
        await session.interrupt()
        await rec.until(_responses_done(1))
        done = rec.done_responses()[0]
        assert done["status"] == "cancelled", rec.summary()
        assert done["status_details"]["reason"] == "client_cancelled"
        assert _sent(sent, "response.cancel") == [{"type": "response.cancel"}]
        truncate = _sent(sent, "conversation.item.truncate")
        assert len(truncate) == 1
        await _reach(rec, lambda r: _of(r, "conversation.item.truncated"))
        truncated = _of(rec, "conversation.item.truncated")[0]
        assert truncated["item_id"] == truncate[0]["item_id"] == done["output"][0]["id"]
        assert truncated["audio_end_ms"] == truncate[0]["audio_end_ms"]
        assert _sdk(rec, "audio_interrupted")

        await session.send_message("Shorter, please")
        await rec.until(_responses_done(2))
        assert rec.done_responses()[1]["status"] == "completed"
        _assert_clean(rec, sdk_log)


async def test_interrupt_before_any_audio_cancels_once(serve_url, sent, sdk_log):
    """interrupt() as soon as the response starts (no audio yet), twice (a user pressing the
    button again): nothing to truncate, one response.cancel, one cancelled response."""
    session = await _start(serve_url, RealtimeAgent(name="assistant", instructions="Be brief."))
    async with session:
        rec = Recorder(session)
        await session.send_message("Tell me a long story")
        await rec.until(lambda e, r: e.type == "agent_start")
        await session.interrupt()
        await session.interrupt()
        await rec.until(_responses_done(1))
        assert rec.done_responses()[0]["status"] == "cancelled", rec.summary()
        assert len(_sent(sent, "response.cancel")) == 1
        assert _sent(sent, "conversation.item.truncate") == []
        await session.send_message("Again")
        await rec.until(_responses_done(2))
        assert rec.done_responses()[1]["status"] == "completed"
        _assert_clean(rec, sdk_log)


async def test_interrupt_under_server_vad_truncates_and_leaves_cancelling_to_the_server(
    serve_url, sent, sdk_log
):
    """With server VAD and interrupt_response true the SDK's interrupt() only truncates (it
    leaves cancellation to the server's VAD): the truncation is acknowledged while the
    response still streams, the response completes, and the next turn is answered."""
    td = {"type": "server_vad", "interrupt_response": True}
    session = await _start(
        serve_url, RealtimeAgent(name="assistant", instructions="Be brief."), _settings(turn_detection=td)
    )
    async with session:
        rec = Recorder(session)
        await session.send_message("Tell me a long story")
        await rec.until(_audio_count(3))
        await session.interrupt()
        await rec.until(_responses_done(1))
        assert _sent(sent, "response.cancel") == []
        truncate = _sent(sent, "conversation.item.truncate")
        assert len(truncate) == 1
        truncated = _of(rec, "conversation.item.truncated")
        assert [(t["item_id"], t["audio_end_ms"]) for t in truncated] == [
            (truncate[0]["item_id"], truncate[0]["audio_end_ms"])
        ]
        assert rec.done_responses()[0]["status"] == "completed"
        await session.send_message("Again")
        await rec.until(_responses_done(2))
        assert rec.done_responses()[1]["status"] == "completed"
        _assert_clean(rec, sdk_log)


async def test_interrupt_after_the_response_while_its_audio_still_plays(serve_url, sent, sdk_log):
    """The server streams faster than real time, so the user often interrupts after
    response.done while the answer still plays. With a RealtimePlaybackTracker saying 500 ms
    were played, the SDK truncates the finished item at 500 ms and sends no cancel."""
    tracker = RealtimePlaybackTracker()
    runner = RealtimeRunner(
        RealtimeAgent(name="assistant", instructions="Be brief."), config={"model_settings": _settings()}
    )
    session = await runner.run(
        model_config={"url": serve_url, "api_key": API_KEY, "playback_tracker": tracker}
    )
    async with session:
        rec = Recorder(session)
        await session.send_message("Tell me a story")
        await rec.until(_responses_done(1))
        done = rec.done_responses()[0]
        assert done["status"] == "completed"
        item_id = done["output"][0]["id"]
        tracker.on_play_ms(item_id, 0, 500.0)
        await session.interrupt()
        await rec.until(lambda e, r: bool(_of(r, "conversation.item.truncated")))
        assert _sent(sent, "conversation.item.truncate") == [
            {
                "type": "conversation.item.truncate",
                "item_id": item_id,
                "content_index": 0,
                "audio_end_ms": 500,
            }
        ]
        assert _sent(sent, "response.cancel") == []
        truncated = _of(rec, "conversation.item.truncated")[0]
        assert (truncated["item_id"], truncated["audio_end_ms"]) == (item_id, 500)
        await session.send_message("Again")
        await rec.until(_responses_done(2))
        assert rec.done_responses()[1]["status"] == "completed"
        _assert_clean(rec, sdk_log)


# --- 3. structured messages and update_agent --------------------------------------------------


def _user_message(*parts: dict) -> dict:
    """A structured user message, as send_message takes one."""
    return {"type": "message", "role": "user", "content": list(parts)}


async def test_structured_message_then_update_agent_switches_instructions_and_tools(serve_url, sent, sdk_log):
    calls.clear()
    session = await _start(serve_url, RealtimeAgent(name="assistant", instructions="Be brief."))
    async with session:
        rec = Recorder(session)
        await session.send_message(
            _user_message(
                {"type": "input_text", "text": "Hello"},
                {"type": "input_text", "text": "I am planning a trip."},
            )
        )
        await rec.until(_responses_done(1))
        assert rec.done_responses()[0]["status"] == "completed"
        user_items = [
            e["item"] for e in _of(rec, "conversation.item.added") if e["item"].get("role") == "user"
        ]
        assert user_items[0]["content"] == [
            {"type": "input_text", "text": "Hello"},
            {"type": "input_text", "text": "I am planning a trip."},
        ]
        # The SDK's history holds the same message.
        assert [c.text for c in session._history[0].content] == ["Hello", "I am planning a trip."]

        planner = RealtimeAgent(name="planner", instructions="You plan trips.", tools=[get_weather])
        await session.update_agent(planner)
        await session.send_message("What is the weather in Rome?")
        tool_end = await rec.until(lambda e, r: e.type == "tool_end")
        assert tool_end.agent is planner and calls == ["example"]
        await _reach(rec, lambda r: len(r.done_responses()) >= 3)
        assert _calls_in(rec.done_responses()[1]) == ["get_weather"]
        assert rec.done_responses()[2]["status"] == "completed"
        updated = [
            e["session"]
            for e in _of(rec, "session.updated")
            if e["session"]["instructions"] == "You plan trips."
        ]
        assert updated and [t["name"] for t in updated[0]["tools"]] == ["get_weather"]
        assert [e.agent.name for e in _sdk(rec, "agent_start")] == ["assistant", "planner", "planner"]
        _assert_clean(rec, sdk_log)


async def test_update_agent_while_a_response_streams(serve_url, sdk_log):
    """update_agent() mid-response: the response in flight completes, the update is applied,
    and the next turn runs under the new agent (its tool is called)."""
    calls.clear()
    session = await _start(serve_url, RealtimeAgent(name="assistant", instructions="Be brief."))
    async with session:
        rec = Recorder(session)
        await session.send_message("Tell me a story")
        await rec.until(_audio_count(2))
        await session.update_agent(
            RealtimeAgent(name="planner", instructions="You plan trips.", tools=[get_weather])
        )
        await rec.until(_responses_done(1))
        assert rec.done_responses()[0]["status"] == "completed"
        await session.send_message("Weather in Rome?")
        await rec.until(_responses_done(3))
        assert _calls_in(rec.done_responses()[1]) == ["get_weather"] and calls == ["example"]
        assert rec.done_responses()[2]["status"] == "completed"
        _assert_clean(rec, sdk_log)


async def test_an_image_part_is_kept_as_a_marker_and_the_session_goes_on(serve_url, sdk_log):
    """The SDK's app example sends input_image parts. No engine here sees: the item is added
    with the image part as a marker (no image), the words are read, and no error is sent
    (it was refused with not_supported, which pipecat takes as fatal)."""
    session = await _start(serve_url, RealtimeAgent(name="assistant", instructions="Be brief."))
    async with session:
        rec = Recorder(session)
        await session.send_message(
            _user_message(
                {"type": "input_text", "text": "What is in this picture?"},
                {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="},
            )
        )
        await rec.until(_responses_done(1))
        (added,) = [e for e in _of(rec, "conversation.item.added") if e["item"].get("role") == "user"]
        assert added["item"]["content"] == [
            {"type": "input_text", "text": "What is in this picture?"},
            {"type": "input_image"},
        ]
        assert rec.done_responses()[0]["status"] == "completed"
        await session.send_message("Describe Paris instead")
        await rec.until(_responses_done(2))
        assert rec.done_responses()[1]["status"] == "completed"
        _assert_clean(rec, sdk_log)


# --- 4. output guardrails ---------------------------------------------------------------------


def _trip_once(trips: list[str]) -> OutputGuardrail:
    """Trips on the first response whose words reach "word3" (the scripted engine says
    " word0 word1 ..."), and never again, so the SDK's feedback turn is not tripped too."""

    def no_word3(ctx, agent, output: str) -> GuardrailFunctionOutput:
        hit = "word3" in output and not trips
        if hit:
            trips.append(output)
        return GuardrailFunctionOutput(output_info={"chars": len(output)}, tripwire_triggered=hit)

    return OutputGuardrail(guardrail_function=no_word3, name="no_word3")


@pytest.mark.parametrize("modality", ["audio", "text"])
async def test_output_guardrail_trips_cancels_the_response_and_the_session_goes_on(
    serve_url, sent, sdk_log, modality
):
    """A tripped output guardrail: the SDK emits guardrail_tripped, cancels the response by
    id (audio: after truncating what was heard; text: cancel only), tells the model with a
    "guardrail triggered" user message and a new response; the next turn works."""
    trips: list[str] = []
    agent = RealtimeAgent(name="assistant", instructions="Be brief.", output_guardrails=[_trip_once(trips)])
    session = await _start(
        serve_url,
        agent,
        _settings(output_modalities=[modality]),
        guardrails_settings={"debounce_text_length": 20},
    )
    async with session:
        rec = Recorder(session)
        await session.send_message("Tell me a long story")
        await rec.until(lambda e, r: e.type == "guardrail_tripped")
        await _reach(rec, lambda r: len(r.done_responses()) >= 2)
        first, feedback = rec.done_responses()[:2]
        assert first["status"] == "cancelled", rec.summary()
        assert first["status_details"]["reason"] == "client_cancelled"
        assert _sent(sent, "response.cancel") == [{"type": "response.cancel", "response_id": first["id"]}]
        assert len(_sent(sent, "conversation.item.truncate")) == (1 if modality == "audio" else 0)
        assert feedback["status"] == "completed"
        user_texts = [
            c.get("text")
            for e in _of(rec, "conversation.item.added")
            if e["item"].get("role") == "user"
            for c in e["item"]["content"]
        ]
        assert "guardrail triggered: no_word3" in user_texts
        assert len(trips) == 1
        await session.send_message("Something else")
        await rec.until(_responses_done(3))
        assert rec.done_responses()[2]["status"] == "completed"
        _assert_clean(rec, sdk_log)


# --- 5. tool approval, tool_choice, model settings, raw events, G.711 -------------------------


async def test_tool_approval_approve_then_reject(serve_url, sent, sdk_log):
    """A function tool with needs_approval: the SDK holds the call (tool_approval_required);
    approve_tool_call runs it, reject_tool_call answers the call with a rejection. Both
    follow-ups complete."""
    calls.clear()
    agent = RealtimeAgent(name="bank", instructions="Be careful.", tools=[transfer_money])
    session = await _start(serve_url, agent)
    async with session:
        rec = Recorder(session)
        await session.send_message("Send money to my savings")
        pending = await rec.until(lambda e, r: e.type == "tool_approval_required")
        assert calls == []
        await session.approve_tool_call(pending.call_id)
        await rec.until(_responses_done(2))
        assert calls == ["transfer:example"]
        assert "sent to example" in _words(rec.done_responses()[1])

        await session.send_message("And again")
        pending = await rec.until(lambda e, r: e.type == "tool_approval_required")
        await session.reject_tool_call(pending.call_id)
        await rec.until(_responses_done(4))
        assert calls == ["transfer:example"]  # the rejected call never ran
        outputs = [
            f["item"]
            for f in _sent(sent, "conversation.item.create")
            if f["item"]["type"] == "function_call_output"
        ]
        call_ids = [e["call_id"] for e in _of(rec, "response.function_call_arguments.done")]
        assert [o["call_id"] for o in outputs] == call_ids[:2]
        assert outputs[0]["output"] == "sent to example"
        assert outputs[1]["output"] != "sent to example"  # the SDK's rejection message
        assert outputs[1]["output"] in _words(rec.done_responses()[3])  # it reached the model
        assert all(r["status"] == "completed" for r in rec.done_responses())
        _assert_clean(rec, sdk_log)


async def test_tool_choice_none_and_required(serve_url, sdk_log):
    """model_settings tool_choice: "none" never calls (a plain answer), "required" calls."""
    calls.clear()
    for choice, expect_calls in (("none", []), ("required", ["get_weather"])):
        agent = RealtimeAgent(name="assistant", instructions="Be brief.", tools=[get_weather, get_time])
        session = await _start(serve_url, agent, _settings(tool_choice=choice))
        async with session:
            rec = Recorder(session)
            await session.send_message("What is the weather in Oslo?")
            await rec.until(_responses_done(1 if not expect_calls else 2))
            assert _of(rec, "session.updated")[0]["session"]["tool_choice"] == choice
            assert _calls_in(rec.done_responses()[0]) == expect_calls
            assert all(r["status"] == "completed" for r in rec.done_responses())
            _assert_clean(rec, sdk_log)
    assert calls == ["example"]


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")  # the SDK's own, client-side
async def test_tool_choice_naming_a_function_keeps_the_tools(serve_url, sent, sdk_log):
    """openai-agents' ToolChoice may be a tool's name (a plain string). The SDK passes it as
    it is: session.update carries tool_choice "get_time". GA's schema only allows "auto",
    "none", "required" or {"type": "function", "name"}, so a refusal naming session.tool_choice
    is fair; but the update's other fields, the tools, must still apply, and the turn call a
    tool."""
    calls.clear()
    agent = RealtimeAgent(name="assistant", instructions="Be brief.", tools=[get_weather, get_time])
    session = await _start(serve_url, agent, _settings(tool_choice="get_time"))
    async with session:
        rec = Recorder(session)
        await session.send_message("What time is it in Oslo?")
        await rec.until(_responses_done(1))
        first_update = _sent(sent, "session.update")[0]["session"]
        assert first_update["tool_choice"] == "get_time"
        assert [t["name"] for t in first_update["tools"]] == ["get_weather", "get_time"]
        assert all(e.get("param") == "session.tool_choice" for e in _server_errors(rec)), rec.summary()
        updated = _of(rec, "session.updated")[-1]["session"]
        assert [t["name"] for t in updated["tools"]] == ["get_weather", "get_time"], updated["tools"]
        assert _calls_in(rec.done_responses()[0]), rec.done_responses()[0]["output"]


async def test_max_output_tokens_limits_the_response(serve_url, sdk_log):
    session = await _start(
        serve_url, RealtimeAgent(name="assistant", instructions="Be brief."), _settings(max_output_tokens=3)
    )
    async with session:
        rec = Recorder(session)
        await session.send_message("Tell me a long story")
        await rec.until(_responses_done(1))
        done = rec.done_responses()[0]
        assert done["max_output_tokens"] == 3
        assert done["usage"]["output_tokens"] <= 3, done["usage"]
        assert done["status"] == "incomplete"
        assert done["status_details"]["reason"] == "max_output_tokens"
        _assert_clean(rec, sdk_log)


async def test_common_model_settings_are_accepted(serve_url, sent, sdk_log):
    """Fields users set in model_settings: voice, speed, input_audio_noise_reduction,
    input_audio_transcription, tracing (a config object). No field is refused; what the server
    implements is echoed in session.updated; the turn is answered."""
    settings = _settings(
        voice="marin",
        speed=1.2,
        input_audio_noise_reduction={"type": "near_field"},
        input_audio_transcription={"model": "gpt-4o-mini-transcribe", "language": "en"},
        tracing={"workflow_name": "interop", "group_id": "g1", "metadata": {"suite": "interop"}},
    )
    session = await _start(serve_url, RealtimeAgent(name="assistant", instructions="Be brief."), settings)
    async with session:
        rec = Recorder(session)
        await session.send_message("Hello")
        await rec.until(_responses_done(1))
        first = _sent(sent, "session.update")[0]["session"]
        assert first["audio"]["output"] == {
            "format": {"type": "audio/pcm", "rate": 24000},
            "voice": "marin",
            "speed": 1.2,
        }
        assert first["audio"]["input"]["noise_reduction"] == {"type": "near_field"}
        tracing = [
            f["session"]["tracing"] for f in _sent(sent, "session.update") if "tracing" in f["session"]
        ]
        assert tracing == [{"workflow_name": "interop", "group_id": "g1", "metadata": {"suite": "interop"}}]
        updated = _of(rec, "session.updated")[-1]["session"]
        assert updated["audio"]["output"]["voice"] == "marin"
        assert updated["audio"]["output"]["speed"] == 1.2  # applied (engines that speak)
        assert updated["audio"]["input"]["transcription"]["model"] == "gpt-4o-mini-transcribe"
        assert updated["instructions"] == "Be brief."
        assert rec.done_responses()[0]["status"] == "completed"
        assert _sdk(rec, "audio")
        _assert_clean(rec, sdk_log)


def _history(rec: Recorder) -> list:
    """The SDK's history as its last history_updated / history_added events tell it."""
    history: list = []
    for event in rec.events:
        if event.type == "history_updated":
            history = list(event.history)
        elif event.type == "history_added" and all(i.item_id != event.item.item_id for i in history):
            history.append(event.item)
    return history


async def test_a_long_turn_transcribed_in_pieces_then_a_short_turn(
    serve_url, long_speech_24k, speech_24k, sdk_log
):
    """input_audio_transcription on, push-to-talk. A ~9 s turn: the server sends one
    input_audio_transcription.delta per piece, then completed. The SDK (which ignores the
    deltas) surfaces one input_audio_transcription_completed with the server's transcript, and
    its history's user message holds that transcript; the turn is answered. A short turn after
    it (one delta) gets the same, and nothing is logged or refused."""
    settings = _settings(input_audio_transcription={"model": "gpt-4o-transcribe", "language": "en"})
    session = await _start(serve_url, RealtimeAgent(name="assistant", instructions="Be brief."), settings)
    async with session:
        rec = Recorder(session)

        async def turn(pcm: bytes, n: int) -> tuple[str, list[str]]:
            pieces = chunks(pcm)
            for chunk in pieces[:-1]:
                await session.send_audio(chunk)
            await session.send_audio(pieces[-1], commit=True)
            await session.model.send_event(RealtimeModelSendRawMessage(message={"type": "response.create"}))

            def transcribed(r: Recorder) -> list:
                return [
                    e.data
                    for e in _sdk(r, "raw_model_event")
                    if e.data.type == "input_audio_transcription_completed"
                ]

            def in_history(r: Recorder) -> bool:  # the history event follows the model's
                committed = _of(r, "input_audio_buffer.committed")
                return len(committed) >= n and any(
                    i.item_id == committed[n - 1]["item_id"] and i.content[0].transcript for i in _history(r)
                )

            await _reach(rec, lambda r: in_history(r) and len(r.done_responses()) >= n, 20)
            item_id = _of(rec, "input_audio_buffer.committed")[n - 1]["item_id"]
            completed = _of(rec, "conversation.item.input_audio_transcription.completed")
            assert [e["item_id"] for e in completed][n - 1 :] == [item_id], rec.summary()
            transcript = completed[-1]["transcript"]
            assert [(t.item_id, t.transcript) for t in transcribed(rec)][n - 1 :] == [(item_id, transcript)]
            deltas = [
                e["delta"]
                for e in _of(rec, "conversation.item.input_audio_transcription.delta")
                if e["item_id"] == item_id
            ]
            user = [i for i in _history(rec) if i.item_id == item_id]
            assert len(user) == 1 and user[0].role == "user", _history(rec)
            assert [c.transcript for c in user[0].content] == [transcript], user
            assert rec.done_responses()[n - 1]["status"] == "completed", rec.summary()
            return transcript, deltas

        transcript, deltas = await turn(long_speech_24k, 1)
        check_pieced_transcript(deltas, transcript)
        transcript, deltas = await turn(speech_24k, 2)
        assert deltas == [transcript] and "weather" in transcript and "paris" in transcript, deltas
        assert len(_history(rec)) == 4, _history(rec)  # two user turns, two answers
        _assert_clean(rec, sdk_log)


async def test_ga_audio_config_with_server_vad_answers_a_spoken_turn(serve_url, speech_24k, sdk_log):
    """model_settings["audio"] in the GA shape (input format, noise reduction, turn detection
    with silence_duration_ms and idle_timeout_ms; output voice and speed): applied, and a
    spoken turn is answered."""
    settings = _settings(
        audio={
            "input": {
                "format": {"type": "audio/pcm", "rate": 24000},
                "noise_reduction": {"type": "far_field"},
                "turn_detection": {
                    "type": "server_vad",
                    "silence_duration_ms": 400,
                    "idle_timeout_ms": 30000,
                },
            },
            "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "cedar", "speed": 0.9},
        }
    )
    del settings["turn_detection"]
    session = await _start(serve_url, RealtimeAgent(name="assistant", instructions="Be brief."), settings)
    async with session:
        rec = Recorder(session)
        for chunk in chunks(speech_24k):
            await session.send_audio(chunk)
        await rec.until(_responses_done(1))
        td = _of(rec, "session.updated")[0]["session"]["audio"]["input"]["turn_detection"]
        assert (td["type"], td["silence_duration_ms"], td["idle_timeout_ms"]) == ("server_vad", 400, 30000)
        assert _of(rec, "session.updated")[0]["session"]["audio"]["output"]["voice"] == "cedar"
        assert _of(rec, "session.updated")[0]["session"]["audio"]["output"]["speed"] == 0.9
        assert _of(rec, "input_audio_buffer.speech_started") and _of(rec, "input_audio_buffer.committed")
        assert rec.done_responses()[0]["status"] == "completed"
        _assert_clean(rec, sdk_log)


async def test_raw_response_create_with_instructions_metadata_and_text_output(serve_url, sent, sdk_log):
    """The SDK's app example forwards client events with RealtimeModelSendRawMessage: a
    response.create carrying its own instructions, metadata and output_modalities."""
    session = await _start(serve_url, RealtimeAgent(name="assistant", instructions="Be brief."))
    async with session:
        rec = Recorder(session)
        await session.send_message("Hello")
        await rec.until(_responses_done(1))
        response = {
            "instructions": "Say goodbye.",
            "metadata": {"topic": "bye"},
            "output_modalities": ["text"],
        }
        await session.model.send_event(
            RealtimeModelSendRawMessage(
                message={"type": "response.create", "other_data": {"response": response}}
            )
        )
        await rec.until(_responses_done(2))
        assert _sent(sent, "response.create")[-1]["response"] == response
        created = _of(rec, "response.created")[-1]["response"]
        done = rec.done_responses()[1]
        assert created["metadata"] == done["metadata"] == {"topic": "bye"}
        assert done["status"] == "completed" and done["output_modalities"] == ["text"]
        assert done["output"][0]["content"][0]["type"] == "output_text"
        assert _of(rec, "response.output_text.delta") and _sdk(rec, "raw_model_event")
        _assert_clean(rec, sdk_log)


def _ulaw_8k(pcm_24k: bytes) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import audioop  # Python 3.11 here; the Twilio example sends G.711 mu-law at 8 kHz

    pcm_8k, _ = audioop.ratecv(pcm_24k, 2, 1, 24000, 8000, None)
    return audioop.lin2ulaw(pcm_8k, 2)


async def test_twilio_style_g711_ulaw_with_a_playback_tracker(serve_url, speech_24k, sent, sdk_log):
    """The SDK's Twilio example: input/output_audio_format g711_ulaw, semantic_vad, and a
    RealtimePlaybackTracker fed as audio plays. A spoken mu-law turn is answered in mu-law
    (8 bytes per ms), and interrupt() truncates at what the tracker says was played."""
    tracker = RealtimePlaybackTracker()
    runner = RealtimeRunner(RealtimeAgent(name="phone", instructions="Be brief."))
    session = await runner.run(
        model_config={
            "url": serve_url,
            "api_key": API_KEY,
            "playback_tracker": tracker,
            "initial_model_settings": {
                "input_audio_format": "g711_ulaw",
                "output_audio_format": "g711_ulaw",
                "turn_detection": {
                    "type": "semantic_vad",
                    "interrupt_response": True,
                    "create_response": True,
                },
            },
        }
    )
    ulaw = _ulaw_8k(speech_24k)
    async with session:
        rec = Recorder(session)
        for i in range(0, len(ulaw), 800):  # 100 ms of mu-law
            await session.send_audio(ulaw[i : i + 800])
        played = 0

        def play(event, r) -> bool:
            nonlocal played
            if event.type == "audio" and played < 400:
                tracker.on_play_bytes(event.item_id, event.content_index, event.audio.data[: 400 - played])
                played += len(event.audio.data[: 400 - played])
            return len(r.done_responses()) >= 1

        await rec.until(play)
        assert _sent(sent, "session.update")[0]["session"]["audio"]["input"]["format"] == {
            "type": "audio/pcmu"
        }
        fmt = _of(rec, "session.updated")[0]["session"]["audio"]["output"]["format"]
        assert fmt == {"type": "audio/pcmu"}
        done = rec.done_responses()[0]
        assert done["status"] == "completed"
        audio = b"".join(e.audio.data for e in _sdk(rec, "audio"))
        assert len(audio) == 8 * 12 * 160  # the scripted answer: 12 packets of 160 ms at 8 kHz, 1 byte each
        await session.interrupt()  # 400 bytes = 50 ms played
        await rec.until(lambda e, r: bool(_of(r, "conversation.item.truncated")))
        assert _of(rec, "conversation.item.truncated")[0]["audio_end_ms"] == 50
        assert [t["audio_end_ms"] for t in _sent(sent, "conversation.item.truncate")] == [50]
        _assert_clean(rec, sdk_log)


# --- the embedded engine (the default engine's real speech) -------------------------------------


async def test_text_and_push_to_talk_turns_on_the_embedded_engine(embedded_url, speech_24k):
    """The same SDK paths on the embedded engine: a torch thinker (random weights: its words
    mean nothing) and Piper's real speech. A response may end at the engine's token limit
    (incomplete), which the SDK takes as any response end."""
    session = await _open(embedded_url, turn_detection=None)
    async with session:
        rec = Recorder(session)
        await session.send_message("Hello there")
        await rec.until(_responses_done(1), timeout=60)
        pieces = chunks(speech_24k)
        for chunk in pieces[:-1]:
            await session.send_audio(chunk)
        await session.send_audio(pieces[-1], commit=True)
        await session.model.send_event(RealtimeModelSendRawMessage(message={"type": "response.create"}))
        await rec.until(_responses_done(2), timeout=60)
        assert rec.errors == [], rec.summary()
        assert [r["status"] for r in rec.done_responses()] in (
            [a, b] for a in ("completed", "incomplete") for b in ("completed", "incomplete")
        ), rec.summary()
        assert all(r["output"][0]["content"][0]["transcript"] for r in rec.done_responses())
        audio = [e for e in rec.events if e.type == "audio"]
        assert len({e.item_id for e in audio}) == 2, "both responses spoke"
