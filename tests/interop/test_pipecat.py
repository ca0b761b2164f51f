"""pipecat's OpenAIRealtimeLLMService against `duplex-actors serve`, unmodified.

Configured the way a user points it at another server: ``base_url`` and ``api_key``, in the
pipeline pipecat documents for realtime services (user aggregator -> LLM -> assistant
aggregator). A collector after the service records what comes out. pipecat parses every server
event with its own pydantic models (events.parse_server_event); an event it cannot parse is
logged and dropped, so the test records those too.
"""

from __future__ import annotations

import asyncio

import pytest

from .conftest import API_KEY, GA_RATE, check_pieced_transcript, chunks, get_weather_impl

pytest.importorskip("pipecat.services.openai.realtime")
pytestmark = [pytest.mark.interop, pytest.mark.anyio, pytest.mark.timeout(120)]

from loguru import logger  # noqa: E402
from pipecat.adapters.schemas.function_schema import FunctionSchema  # noqa: E402
from pipecat.adapters.schemas.tools_schema import ToolsSchema  # noqa: E402
from pipecat.frames.frames import (  # noqa: E402
    ErrorFrame,
    FunctionCallInProgressFrame,
    InputAudioRawFrame,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    TTSAudioRawFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.runner import PipelineRunner  # noqa: E402
from pipecat.pipeline.worker import PipelineParams, PipelineWorker  # noqa: E402
from pipecat.processors.aggregators.llm_context import LLMContext  # noqa: E402
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor  # noqa: E402
from pipecat.services.openai.realtime import events  # noqa: E402
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService  # noqa: E402


class Collector(FrameProcessor):
    def __init__(self) -> None:
        super().__init__()
        self.frames: list = []

    async def process_frame(self, frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        self.frames.append(frame)
        await self.push_frame(frame, direction)

    def of(self, kind) -> list:
        return [f for f in self.frames if isinstance(f, kind)]


class Harness:
    """One pipeline around the service, run in the background; logs of pipecat's own errors
    (events it failed to parse, server errors) are captured for the failure message."""

    def __init__(self, serve_url: str, session: events.SessionProperties, tools=None) -> None:
        self.llm = OpenAIRealtimeLLMService(
            api_key=API_KEY,
            base_url=serve_url,
            settings=OpenAIRealtimeLLMService.Settings(model="gpt-realtime", session_properties=session),
        )
        self.context = LLMContext(messages=[], **({"tools": tools} if tools is not None else {}))
        pair = LLMContextAggregatorPair(self.context)
        self.collector = Collector()
        self.worker = PipelineWorker(
            Pipeline([pair.user(), self.llm, self.collector, pair.assistant()]),
            params=PipelineParams(audio_in_sample_rate=GA_RATE, audio_out_sample_rate=GA_RATE),
            idle_timeout_secs=None,
            check_dangling_tasks=False,
        )
        self.logs: list[str] = []

    async def __aenter__(self):
        self._sink = logger.add(lambda m: self.logs.append(str(m).strip()[:400]), level="ERROR")
        self._run = asyncio.create_task(PipelineRunner(handle_sigint=False).run(self.worker))
        await asyncio.sleep(0.5)
        return self

    async def __aexit__(self, *exc):
        await self.worker.cancel()
        try:
            await asyncio.wait_for(self._run, 10)
        finally:
            logger.remove(self._sink)

    async def until(self, predicate, timeout: float = 20.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate(self.collector):
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out; {self.summary()}")
            await asyncio.sleep(0.05)

    def summary(self) -> str:
        kinds = sorted({type(f).__name__ for f in self.collector.frames})
        return f"pipecat warnings/errors: {self.logs[:12]}; frames seen: {kinds}"


def _session(turn_detection) -> events.SessionProperties:
    return events.SessionProperties(
        instructions="Be brief.",
        audio=events.AudioConfiguration(input=events.AudioInput(turn_detection=turn_detection)),
    )


def _responses(n: int):
    return lambda c: len(c.of(LLMFullResponseEndFrame)) >= n


async def test_text_turn(serve_url):
    async with Harness(serve_url, _session(False)) as h:
        h.context.add_message({"role": "user", "content": "Hello there"})
        await h.worker.queue_frame(LLMContextFrame(h.context))
        await h.until(_responses(1))
        assert h.collector.of(TTSAudioRawFrame), h.summary()
        assert not h.collector.of(ErrorFrame) and not h.logs, h.summary()


async def _speak(h: Harness, pcm: bytes) -> None:
    for chunk in chunks(pcm, ms=20):
        await h.worker.queue_frame(InputAudioRawFrame(audio=chunk, sample_rate=GA_RATE, num_channels=1))
        await asyncio.sleep(0.001)


async def test_push_to_talk_audio_turn(serve_url, speech_24k):
    # turn_detection=False: pipecat's documented push-to-talk mode (commit + response.create
    # when the user stops speaking).
    async with Harness(serve_url, _session(False)) as h:
        await h.worker.queue_frame(UserStartedSpeakingFrame())
        await _speak(h, speech_24k)
        await h.worker.queue_frame(UserStoppedSpeakingFrame())
        await h.until(_responses(1))
        assert h.collector.of(TTSAudioRawFrame), h.summary()
        assert not h.collector.of(ErrorFrame) and not h.logs, h.summary()


async def test_server_vad_turn_with_barge_in(serve_url, speech_24k):
    async with Harness(serve_url, _session(events.TurnDetection(silence_duration_ms=500))) as h:
        await _speak(h, speech_24k)
        await h.until(lambda c: c.of(TTSAudioRawFrame))
        await _speak(h, speech_24k)  # the user talks over the answer
        # The server cancels the first response and answers the second turn.
        await h.until(_responses(2))
        assert not h.collector.of(ErrorFrame) and not h.logs, h.summary()


def _weather_tools() -> ToolsSchema:
    """get_weather(city), as pipecat declares a function."""
    return ToolsSchema(
        standard_tools=[
            FunctionSchema(
                name="get_weather",
                description="Get the weather in a city",
                properties={"city": {"type": "string"}},
                required=["city"],
            )
        ]
    )


async def test_tool_call(serve_url):
    ran: list[str] = []

    async def get_weather(params):
        ran.append(params.arguments.get("city", ""))
        await params.result_callback({"weather": get_weather_impl(params.arguments.get("city", "?"))})

    async with Harness(serve_url, _session(False), tools=_weather_tools()) as h:
        h.llm.register_function("get_weather", get_weather)
        h.context.add_message({"role": "user", "content": "What is the weather in Paris?"})
        await h.worker.queue_frame(LLMContextFrame(h.context))
        await h.until(lambda c: c.of(FunctionCallInProgressFrame))
        await h.until(lambda c: ran and _responses(2)(c))
        assert h.collector.of(TTSAudioRawFrame), h.summary()
        assert not h.collector.of(ErrorFrame) and not h.logs, h.summary()


# --- pipeline-driven scenarios, with the service's raw traffic recorded -------------------------

import base64  # noqa: E402
import json  # noqa: E402

from pipecat.frames.frames import (  # noqa: E402
    InputImageRawFrame,
    InterimTranscriptionFrame,
    InterruptionFrame,
    LLMMessagesAppendFrame,
    LLMMessagesUpdateFrame,
    LLMRunFrame,
    LLMSetToolsFrame,
    LLMTextFrame,
    LLMUpdateSettingsFrame,
    TranscriptionFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.processors.aggregators.llm_response_universal import LLMUserAggregatorParams  # noqa: E402

from .conftest import UTTERANCE  # noqa: E402

#: Errors the service itself treats as harmless (it logs them at debug and carries on): OpenAI
#: answers a response.cancel with nothing to cancel this way, and pipecat cancels on every
#: interruption in manual mode.
BENIGN_ERRORS = {"response_cancel_not_active"}


class WireHarness(Harness):
    """The documented realtime pipeline, configurable the way users configure it (service
    settings, a starting context, the user aggregator's params, the transport's input rate), with
    every client event the service sends and every server event it receives recorded, and its
    warnings kept as well as its errors."""

    def __init__(
        self,
        serve_url: str,
        session: events.SessionProperties,
        *,
        messages: list | None = None,
        tools=None,
        user_params: LLMUserAggregatorParams | None = None,
        in_rate: int = GA_RATE,
    ) -> None:
        settings = OpenAIRealtimeLLMService.Settings(model="gpt-realtime", session_properties=session)
        self.llm = OpenAIRealtimeLLMService(api_key=API_KEY, base_url=serve_url, settings=settings)
        self.context = LLMContext(
            messages=list(messages or []), **({"tools": tools} if tools is not None else {})
        )
        pair = LLMContextAggregatorPair(self.context, **({"user_params": user_params} if user_params else {}))
        self.collector = Collector()
        #: What the service pushes upstream (transcriptions), seen before the user aggregator.
        self.upstream = Collector()
        self.worker = PipelineWorker(
            Pipeline([pair.user(), self.upstream, self.llm, self.collector, pair.assistant()]),
            params=PipelineParams(audio_in_sample_rate=in_rate, audio_out_sample_rate=GA_RATE),
            idle_timeout_secs=None,
            check_dangling_tasks=False,
        )
        self.logs: list[str] = []
        self.warnings: list[str] = []
        self.sent: list[dict] = []
        self.received: list[dict] = []
        send = self.llm._ws_send

        async def recording_send(message: dict) -> None:
            self.sent.append(message)
            await send(message)

        self.llm._ws_send = recording_send

    async def __aenter__(self):
        parse = events.parse_server_event

        def recording_parse(raw):
            self.received.append(json.loads(raw))
            return parse(raw)

        self._parse = parse
        events.parse_server_event = recording_parse
        self._warn_sink = logger.add(
            lambda m: self.warnings.append(str(m).strip()[:400]),
            level="WARNING",
            filter=lambda r: r["level"].name == "WARNING",
        )
        return await super().__aenter__()

    async def __aexit__(self, *exc):
        try:
            await super().__aexit__(*exc)
        finally:
            events.parse_server_event = self._parse
            logger.remove(self._warn_sink)

    # what went over the wire

    def sent_of(self, kind: str) -> list[dict]:
        return [e for e in self.sent if e.get("type") == kind]

    def received_of(self, kind: str) -> list[dict]:
        return [e for e in self.received if e.get("type") == kind]

    async def until_received(self, kind: str, n: int = 1, timeout: float = 20.0) -> list[dict]:
        """Wait until the service has received ``n`` server events of this type."""
        deadline = asyncio.get_running_loop().time() + timeout
        while len(self.received_of(kind)) < n:
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out waiting for {n} {kind}; {self.summary()}")
            await asyncio.sleep(0.05)
        return self.received_of(kind)

    def audio_ms(self, item_id: str) -> float:
        """How much response audio (24 kHz pcm16) the service received for an item."""
        deltas = [
            e["delta"] for e in self.received_of("response.output_audio.delta") if e["item_id"] == item_id
        ]
        return sum(len(base64.b64decode(d)) for d in deltas) / 48

    def statuses(self) -> list[tuple]:
        """(status, reason) of every response.done, in order."""
        return [
            (r["status"], (r.get("status_details") or {}).get("reason"))
            for r in (e["response"] for e in self.received_of("response.done"))
        ]

    def assistant_items(self) -> list[str]:
        return [
            e["item"]["id"]
            for e in self.received_of("response.output_item.added")
            if e["item"].get("role") == "assistant"
        ]

    def server_errors(self, ignore=BENIGN_ERRORS) -> list[dict]:
        return [e["error"] for e in self.received_of("error") if e["error"].get("code") not in ignore]

    def wire(self, limit: int = 6000) -> str:
        """The traffic, audio left out and each event shortened to what tells it apart."""

        def brief(e: dict) -> dict:
            e = {k: v for k, v in e.items() if k not in ("event_id", "server_event_seq", "epoch", "metrics")}
            for k in ("audio", "delta"):
                if isinstance(e.get(k), str) and len(e[k]) > 40:
                    e[k] = f"<{len(e[k])} chars>"
            if isinstance(e.get("session"), dict):
                s = e["session"]
                e["session"] = {
                    k: s.get(k) for k in ("instructions", "output_modalities", "audio", "tools") if k in s
                }
            if isinstance(e.get("response"), dict):
                r = e["response"]
                e["response"] = {
                    k: r.get(k) for k in ("id", "status", "status_details", "output_modalities") if k in r
                }
            return e

        sent = [brief(e) for e in self.sent if e.get("type") != "input_audio_buffer.append"]
        got = [brief(e) for e in self.received if e.get("type") != "response.output_audio.delta"]
        return f"sent: {json.dumps(sent)[:limit]}\nreceived: {json.dumps(got)[:limit]}"

    def summary(self) -> str:
        return f"{super().summary()}; warnings: {self.warnings[:8]}; server errors: {self.server_errors(())}\n{self.wire()}"

    def assert_clean(self, also: set[str] = frozenset()) -> None:
        """No server error but those the service itself handles, and none from the service."""
        assert not self.server_errors(BENIGN_ERRORS | set(also)), self.summary()
        assert not self.collector.of(ErrorFrame) and not self.logs, self.summary()


def _td_session(turn_detection) -> events.SessionProperties:
    return events.SessionProperties(
        instructions="Be brief.",
        audio=events.AudioConfiguration(input=events.AudioInput(turn_detection=turn_detection)),
    )


@pytest.fixture(scope="module")
def speech_16k() -> bytes:
    """The same utterance at 16 kHz (a telephony/WebRTC transport's input rate, and what
    pipecat's Silero VAD needs), with 1 s of silence after it."""
    pytest.importorskip("piper")
    from duplex_actors.audio.utterances import synthesize_utterance

    return synthesize_utterance(UTTERANCE, sample_rate=16000) + b"\x00\x00" * 16000


async def _speak_at(h: Harness, pcm: bytes, rate: int) -> None:
    for chunk in chunks(pcm, ms=20, rate=rate):
        await h.worker.queue_frame(InputAudioRawFrame(audio=chunk, sample_rate=rate, num_channels=1))
        await asyncio.sleep(0.002)


def _assert_truncated_as_heard(h: WireHarness, item_id: str) -> int:
    """pipecat truncated the interrupted assistant item at no more than it had received of it,
    and the server confirmed exactly those cuts. (Under server VAD pipecat may cut twice: at
    speech_started, and again at the pipeline's InterruptionFrame when audio of the item arrived
    in between.) Returns the last cut."""
    cuts = [e for e in h.sent_of("conversation.item.truncate") if e["item_id"] == item_id]
    assert cuts, h.summary()
    assert all(e["content_index"] == 0 and 0 <= e["audio_end_ms"] <= h.audio_ms(item_id) for e in cuts), (
        h.summary()
    )
    done = [e for e in h.received_of("conversation.item.truncated") if e["item_id"] == item_id]
    assert [(e["content_index"], e["audio_end_ms"]) for e in done] == [
        (0, e["audio_end_ms"]) for e in cuts
    ], h.summary()
    return cuts[-1]["audio_end_ms"]


async def test_interruption_frame_in_manual_mode_cancels_truncates_and_the_next_turn_answers(
    serve_url, speech_24k
):
    # turn_detection=False: the pipeline owns turn-taking, and an InterruptionFrame (what the
    # user aggregator broadcasts when the user starts talking over the bot) makes the service
    # clear the input buffer, cancel the response and truncate what the user heard of it.
    async with WireHarness(serve_url, _td_session(False)) as h:
        h.context.add_message({"role": "user", "content": "Tell me a long story"})
        await h.worker.queue_frame(LLMContextFrame(h.context))
        await h.until(lambda c: c.of(TTSAudioRawFrame))
        await h.worker.queue_frame(InterruptionFrame())
        await h.until_received("response.done")
        await h.until_received("conversation.item.truncated")
        kinds = [e["type"] for e in h.sent]
        assert "input_audio_buffer.clear" in kinds and "response.cancel" in kinds, h.summary()
        assert kinds.index("input_audio_buffer.clear") < kinds.index("response.cancel"), h.summary()
        assert h.received_of("input_audio_buffer.cleared"), h.summary()
        assert h.statuses() == [("cancelled", "client_cancelled")], h.summary()
        first = h.assistant_items()[0]
        _assert_truncated_as_heard(h, first)
        # The service closed the bot's turn for the rest of the pipeline.
        await h.until(lambda c: c.of(TTSStoppedFrame) and c.of(LLMFullResponseEndFrame))

        # The user's turn (push-to-talk) is answered in full.
        await h.worker.queue_frame(UserStartedSpeakingFrame())
        await _speak(h, speech_24k)
        await h.worker.queue_frame(UserStoppedSpeakingFrame())
        await h.until_received("response.done", 2)
        assert h.statuses()[1] == ("completed", None), h.summary()
        second = h.assistant_items()[1]
        assert h.audio_ms(second) > 1000, h.summary()
        committed = h.received_of("input_audio_buffer.committed")
        assert len(committed) == 1 and committed[0]["audio_ms"] > 2000, h.summary()
        h.assert_clean()


async def test_local_vad_barge_in_cancels_truncates_and_answers_the_new_turn(serve_url, speech_16k):
    # pipecat's "locally driven turns" setup (examples/realtime/realtime-openai-locally-driven-
    # turns.py): server turn detection off, Silero VAD in the user aggregator at a 16 kHz
    # transport rate. The user speaks, is answered, and speaks again over the answer.
    from pipecat.audio.vad.silero import SileroVADAnalyzer

    async with WireHarness(
        serve_url,
        _td_session(False),
        user_params=LLMUserAggregatorParams(vad_analyzer=SileroVADAnalyzer()),
        in_rate=16000,
    ) as h:
        await _speak_at(h, speech_16k, 16000)
        await h.until(lambda c: c.of(TTSAudioRawFrame))
        await _speak_at(h, speech_16k, 16000)  # over the answer
        await h.until_received("response.done", 2)
        # Each user turn: interruption (clear, cancel), then commit + response.create.
        assert len(h.sent_of("input_audio_buffer.clear")) == 2, h.summary()
        assert len(h.sent_of("input_audio_buffer.commit")) == 2, h.summary()
        assert [e["audio_ms"] > 1500 for e in h.received_of("input_audio_buffer.committed")] == [
            True,
            True,
        ], h.summary()
        assert h.statuses() == [("cancelled", "client_cancelled"), ("completed", None)], h.summary()
        _assert_truncated_as_heard(h, h.assistant_items()[0])
        # The first turn's cancel found nothing to cancel: OpenAI's code, which pipecat ignores.
        codes = [e["error"]["code"] for e in h.received_of("error")]
        assert codes == ["response_cancel_not_active"], h.summary()
        assert h.collector.of(UserStartedSpeakingFrame) and h.collector.of(UserStoppedSpeakingFrame), (
            h.summary()
        )
        h.assert_clean()


async def test_semantic_vad_barge_in_truncates_and_each_turn_is_transcribed(serve_url, speech_24k):
    # pipecat's own OpenAI Realtime example: semantic VAD, input transcription
    # (gpt-realtime-whisper), near-field noise reduction, a developer prompt run at once with
    # LLMRunFrame (the greeting); then the user speaks, and speaks again over the answer.
    session = events.SessionProperties(
        instructions="Be brief.",
        audio=events.AudioConfiguration(
            input=events.AudioInput(
                transcription=events.InputAudioTranscription(),
                turn_detection=events.SemanticTurnDetection(),
                noise_reduction=events.InputAudioNoiseReduction(type="near_field"),
            )
        ),
    )
    async with WireHarness(
        serve_url, session, messages=[{"role": "developer", "content": "Say hello!"}]
    ) as h:
        await h.worker.queue_frame(LLMRunFrame())
        await h.until_received("response.done", 1)
        greeting = h.assistant_items()[0]
        await _speak(h, speech_24k)
        await h.until(lambda c: len(h.assistant_items()) >= 2 and h.audio_ms(h.assistant_items()[1]) > 0)
        await _speak(h, speech_24k)  # over the answer
        await h.until_received("response.done", 3)
        assert h.statuses() == [("completed", None), ("cancelled", "turn_detected"), ("completed", None)], (
            h.summary()
        )
        assert len(h.assistant_items()) == 3, h.summary()
        # The greeting (finished, but pipecat has no transport to tell it the bot stopped
        # speaking) is truncated when the user starts, and the interrupted answer when the user
        # talks over it: both cuts are accepted.
        _assert_truncated_as_heard(h, greeting)
        _assert_truncated_as_heard(h, h.assistant_items()[1])
        # The developer prompt went in as a user item (GA has no developer role).
        created = h.sent_of("conversation.item.create")
        assert [(e["item"]["role"], e["item"]["content"][0]["text"]) for e in created] == [
            ("user", "Say hello!")
        ], h.summary()

        # Each committed turn is transcribed, and the transcript reaches the user aggregator.
        def finals(c):
            return [f.text for f in c.of(TranscriptionFrame)]

        await h.until(lambda c: len(finals(h.upstream)) >= 2)
        assert all("weather" in t and "paris" in t.lower() for t in finals(h.upstream)), h.summary()
        assert h.upstream.of(InterimTranscriptionFrame), h.summary()
        updated = h.received_of("session.updated")[-1]["session"]["audio"]["input"]
        assert updated["transcription"]["model"] == "gpt-realtime-whisper", h.summary()
        # Server VAD's events became pipecat's user turn frames.
        assert h.collector.of(UserStartedSpeakingFrame) and h.collector.of(UserStoppedSpeakingFrame), (
            h.summary()
        )
        h.assert_clean()


def _no_turn_detection(**kw) -> events.SessionProperties:
    """Manual turns and no instructions of the service's own (a context's system message then
    becomes the session's instructions)."""
    return events.SessionProperties(
        audio=events.AudioConfiguration(input=events.AudioInput(turn_detection=False)), **kw
    )


async def _push_to_talk(h: Harness, pcm: bytes) -> None:
    await h.worker.queue_frame(UserStartedSpeakingFrame())
    await _speak(h, pcm)
    await h.worker.queue_frame(UserStoppedSpeakingFrame())


async def test_a_context_with_a_system_prompt_and_history_starts_the_session(serve_url):
    # A saved conversation as the starting context. pipecat 1.14's adapter makes the system
    # message the session's instructions and packs the rest into one user item (it does not
    # send one item per message), then asks for a response.
    history = [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Ahoy"},
        {"role": "user", "content": "What's up?"},
    ]
    async with WireHarness(serve_url, _no_turn_detection(), messages=history) as h:
        await h.worker.queue_frame(LLMRunFrame())
        await h.until_received("response.done")
        assert h.statuses() == [("completed", None)], h.summary()
        assert h.sent_of("session.update")[-1]["session"]["instructions"] == "You are a pirate.", h.summary()
        assert h.received_of("session.updated")[-1]["session"]["instructions"] == "You are a pirate.", (
            h.summary()
        )
        created = h.sent_of("conversation.item.create")
        assert len(created) == 1, h.summary()
        item = created[0]["item"]
        assert item["role"] == "user" and "Ahoy" in item["content"][0]["text"], h.summary()
        # The server keeps the client's item id and content.
        added = h.received_of("conversation.item.added")[0]["item"]
        assert (added["id"], added["role"], added["content"][0]["text"]) == (
            item["id"],
            "user",
            item["content"][0]["text"],
        ), h.summary()
        assert h.audio_ms(h.assistant_items()[0]) > 1000, h.summary()
        # The answer is written into the context after the history.
        await h.until(lambda c: h.context.get_messages()[-1].get("role") == "assistant")
        assert h.context.get_messages()[-1]["content"].startswith("word0"), h.summary()
        h.assert_clean()


async def test_messages_update_and_set_tools_mid_session_reach_the_session(serve_url, speech_24k):
    # As pipecat documents for realtime services: new instructions by replacing the context's
    # system message (LLMMessagesUpdateFrame), new tools with LLMSetToolsFrame, which sends a
    # session.update carrying both. The next turn is offered the tool, so the scripted engine
    # calls it; the function runs and its result is answered.
    ran: list[dict] = []

    async def get_weather(params):
        ran.append(params.arguments)
        await params.result_callback({"weather": get_weather_impl(params.arguments.get("city", "?"))})

    messages = [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi"}]
    async with WireHarness(serve_url, _no_turn_detection(), messages=messages) as h:
        h.llm.register_function("get_weather", get_weather)
        await h.worker.queue_frame(LLMRunFrame())
        await h.until_received("response.done")
        updates = len(h.received_of("session.updated"))
        await h.worker.queue_frame(
            LLMMessagesUpdateFrame(
                messages=[{"role": "system", "content": "You are a robot."}, *messages[1:]]
            )
        )
        await h.worker.queue_frame(LLMSetToolsFrame(tools=_weather_tools()))
        updated = (await h.until_received("session.updated", updates + 1))[-1]["session"]
        sent = h.sent_of("session.update")[-1]["session"]
        assert sent["instructions"] == "You are a robot." and [t["name"] for t in sent["tools"]] == [
            "get_weather"
        ]
        assert updated["instructions"] == "You are a robot.", h.summary()
        assert [(t["name"], t["parameters"]["required"]) for t in updated["tools"]] == [
            ("get_weather", ["city"])
        ]

        await _push_to_talk(h, speech_24k)
        await h.until_received("response.done", 3)
        assert ran == [{"city": "example"}], h.summary()
        outputs = [
            e["item"]
            for e in h.received_of("conversation.item.added")
            if e["item"]["type"] == "function_call_output"
        ]
        assert len(outputs) == 1 and "sunny in example" in outputs[0]["output"], h.summary()
        assert h.statuses()[1:] == [("completed", None), ("completed", None)], h.summary()
        assert h.audio_ms(h.assistant_items()[-1]) > 1000, h.summary()
        h.assert_clean()


async def _hello(h) -> None:
    """A first user message, answered: the session is up and the context synced."""
    h.context.add_message({"role": "user", "content": "Hello there"})
    await h.worker.queue_frame(LLMContextFrame(h.context))
    await h.until_received("response.done")


async def test_messages_appended_at_the_service_become_items_and_are_answered(serve_url):
    # An LLMMessagesAppendFrame that reaches the service (pushed by a processor in front of it;
    # one queued at the pipeline's head is consumed by the user aggregator, which only updates
    # its context). The service writes each message as a system item and the assistant
    # aggregator's context push asks for the response.
    async with WireHarness(serve_url, _td_session(False)) as h:
        await _hello(h)
        before = len(h.sent_of("conversation.item.create"))
        appended = [
            {"role": "user", "content": "Now tell me about Paris."},
            {"role": "system", "content": "Mention the weather."},
        ]
        await h.llm.queue_frame(LLMMessagesAppendFrame(messages=appended, run_llm=True))
        await h.until_received("response.done", 2)
        items = [e["item"] for e in h.sent_of("conversation.item.create")[before:]]
        assert [(i["role"], i["content"][0]["text"]) for i in items] == [
            ("system", "Now tell me about Paris."),
            ("system", "Mention the weather."),
        ], h.summary()
        added = {e["item"]["id"]: e["item"]["role"] for e in h.received_of("conversation.item.added")}
        assert all(added.get(i["id"]) == "system" for i in items), h.summary()
        assert h.statuses() == [("completed", None), ("completed", None)], h.summary()
        h.assert_clean()


async def test_an_appended_assistant_message_is_refused_as_openai_refuses_it(serve_url):
    # pipecat 1.14 writes an appended assistant message with an input_text part. GA's assistant
    # content is output_text/output_audio (OpenAI refuses input_text there too), and so does
    # this server: invalid_value naming the part, the client's event_id echoed, nothing added.
    # pipecat treats every error as fatal, so its session ends here: a pipecat bug.
    async with WireHarness(serve_url, _td_session(False)) as h:
        await _hello(h)
        await h.llm.queue_frame(LLMMessagesAppendFrame(messages=[{"role": "assistant", "content": "Said"}]))
        await h.until_received("error")
        sent = h.sent_of("conversation.item.create")[-1]
        assert sent["item"]["role"] == "assistant" and sent["item"]["content"][0]["type"] == "input_text"
        error = h.received_of("error")[0]["error"]
        assert (error["type"], error["code"], error["param"], error["event_id"]) == (
            "invalid_request_error",
            "invalid_value",
            "item.content[0].type",
            sent["event_id"],
        ), h.summary()
        assert sent["item"]["id"] not in {e["item"]["id"] for e in h.received_of("conversation.item.added")}
        # ... and the service reports it as its own error (pushed upstream as an ErrorFrame).
        await h.until(lambda c: any("invalid_value" in m for m in h.logs))


async def test_a_long_turn_transcribed_in_pieces_then_a_short_turn(serve_url, long_speech_24k, speech_24k):
    # Push-to-talk with input transcription on. A ~9 s turn: the server sends one
    # input_audio_transcription.delta per piece, then completed. The service pushes each delta
    # upstream as an InterimTranscriptionFrame (pipecat passes OpenAI's deltas on as they come:
    # each frame is that piece's words, not the text so far), then one TranscriptionFrame with
    # the server's transcript; the turn is answered. A short turn after it: one interim, one final.
    session = events.SessionProperties(
        instructions="Be brief.",
        audio=events.AudioConfiguration(
            input=events.AudioInput(
                turn_detection=False,
                transcription=events.InputAudioTranscription(model="gpt-4o-transcribe", language="en"),
            )
        ),
    )
    async with WireHarness(serve_url, session) as h:

        async def turn(pcm: bytes, n: int) -> tuple[str, list[str]]:
            await _push_to_talk(h, pcm)
            await h.until_received("conversation.item.input_audio_transcription.completed", n)
            await h.until_received("response.done", n)
            await h.until(lambda c: len(h.upstream.of(TranscriptionFrame)) >= n)
            item_id = h.received_of("input_audio_buffer.committed")[n - 1]["item_id"]
            completed = h.received_of("conversation.item.input_audio_transcription.completed")
            assert [e["item_id"] for e in completed][n - 1 :] == [item_id], h.summary()
            transcript = completed[-1]["transcript"]
            deltas = [
                e["delta"]
                for e in h.received_of("conversation.item.input_audio_transcription.delta")
                if e["item_id"] == item_id
            ]
            assert [f.text for f in h.upstream.of(TranscriptionFrame)][n - 1 :] == [transcript], h.summary()
            assert h.upstream.of(TranscriptionFrame)[-1].result.item_id == item_id
            interims = [
                f.text for f in h.upstream.of(InterimTranscriptionFrame) if f.result.item_id == item_id
            ]
            assert interims == deltas, h.summary()
            assert h.statuses()[n - 1] == ("completed", None), h.summary()
            return transcript, deltas

        transcript, deltas = await turn(long_speech_24k, 1)
        check_pieced_transcript(deltas, transcript)
        transcript, deltas = await turn(speech_24k, 2)
        assert deltas == [transcript] and "weather" in transcript and "paris" in transcript, deltas
        h.assert_clean()


async def test_update_settings_mid_session_turns_on_server_vad_transcription_and_a_voice(
    serve_url, speech_24k
):
    # LLMUpdateSettingsFrame with new session properties (they replace the old ones whole):
    # instructions, server VAD, transcription (a model that takes a prompt), a voice. Then only
    # new instructions; then turn detection off again.
    async with WireHarness(serve_url, _td_session(False)) as h:
        await _hello(h)
        updates = len(h.received_of("session.updated"))

        properties = events.SessionProperties(
            instructions="Talk like a robot.",
            audio=events.AudioConfiguration(
                input=events.AudioInput(
                    turn_detection=events.TurnDetection(silence_duration_ms=400),
                    transcription=events.InputAudioTranscription(
                        model="gpt-4o-transcribe", language="en", prompt="weather"
                    ),
                ),
                output=events.AudioOutput(voice="marin"),
            ),
        )
        await h.worker.queue_frame(
            LLMUpdateSettingsFrame(delta=OpenAIRealtimeLLMService.Settings(session_properties=properties))
        )
        session = (await h.until_received("session.updated", updates + 1))[-1]["session"]
        assert session["instructions"] == "Talk like a robot.", h.summary()
        assert session["audio"]["output"]["voice"] == "marin", h.summary()
        vad = session["audio"]["input"]["turn_detection"]
        assert (vad["type"], vad["silence_duration_ms"]) == ("server_vad", 400), h.summary()
        assert session["audio"]["input"]["transcription"]["model"] == "gpt-4o-transcribe", h.summary()

        # No pipeline turn frames now: the server hears the turn, answers it and transcribes it.
        await _speak(h, speech_24k)
        await h.until_received("response.done", 2)
        assert h.statuses()[1] == ("completed", None) and h.received_of("input_audio_buffer.speech_stopped")
        await h.until(lambda c: h.upstream.of(TranscriptionFrame))
        assert "weather" in h.upstream.of(TranscriptionFrame)[0].text, h.summary()

        await h.worker.queue_frame(
            LLMUpdateSettingsFrame(
                delta=OpenAIRealtimeLLMService.Settings(system_instruction="Speak French.")
            )
        )
        session = (await h.until_received("session.updated", updates + 2))[-1]["session"]
        assert session["instructions"] == "Speak French.", h.summary()

        manual = events.SessionProperties(
            audio=events.AudioConfiguration(input=events.AudioInput(turn_detection=False))
        )
        await h.worker.queue_frame(
            LLMUpdateSettingsFrame(delta=OpenAIRealtimeLLMService.Settings(session_properties=manual))
        )
        session = (await h.until_received("session.updated", updates + 3))[-1]["session"]
        assert session["audio"]["input"]["turn_detection"] is None, h.summary()
        await _push_to_talk(h, speech_24k)
        await h.until_received("response.done", 3)
        assert h.statuses()[2] == ("completed", None), h.summary()
        assert len(h.sent_of("input_audio_buffer.commit")) == 1, h.summary()
        h.assert_clean()


async def test_text_only_output_modalities_stream_output_text_into_llm_text_frames(serve_url, speech_24k):
    # output_modalities ["text"] (pipecat's realtime-openai-text example puts a TTS service
    # after the LLM): every response.create asks for text, the server streams
    # response.output_text.delta, and the service turns them into LLMTextFrames for the
    # context and the TTS, with no audio frames.
    session = events.SessionProperties(
        instructions="Be brief.",
        output_modalities=["text"],
        audio=events.AudioConfiguration(input=events.AudioInput(turn_detection=False)),
    )
    async with WireHarness(serve_url, session) as h:
        h.context.add_message({"role": "user", "content": "Hello there"})
        await h.worker.queue_frame(LLMContextFrame(h.context))
        await h.until_received("response.done")
        await h.until(_responses(1))  # the service has handled response.done
        assert h.sent_of("response.create")[0]["response"]["output_modalities"] == ["text"], h.summary()
        deltas = [e["delta"] for e in h.received_of("response.output_text.delta")]
        assert len(deltas) == 24 and not h.received_of("response.output_audio.delta"), h.summary()
        text = "".join(f.text for f in h.collector.of(LLMTextFrame))
        assert text == "".join(deltas) == h.received_of("response.output_text.done")[0]["text"], h.summary()
        assert not h.collector.of(TTSAudioRawFrame) and not h.collector.of(TTSStartedFrame), h.summary()
        assert h.received_of("response.done")[0]["response"]["output_modalities"] == ["text"], h.summary()
        await h.until(lambda c: h.context.get_messages()[-1].get("role") == "assistant")
        assert h.context.get_messages()[-1]["content"] == text.strip(), h.summary()

        # A spoken turn is answered in text too (push-to-talk's response.create names no
        # modalities: the session's hold).
        await _push_to_talk(h, speech_24k)
        await h.until_received("response.done", 2)
        await h.until(_responses(2))
        assert h.received_of("response.done")[1]["response"]["output_modalities"] == ["text"], h.summary()
        assert len(h.received_of("response.output_text.delta")) == 48, h.summary()
        assert not h.received_of("response.output_audio.delta") and not h.collector.of(TTSAudioRawFrame)
        h.assert_clean()


async def test_retrieve_conversation_item_returns_the_users_and_the_assistants_items(serve_url):
    async with WireHarness(serve_url, _td_session(False)) as h:
        await _hello(h)
        user_id = h.sent_of("conversation.item.create")[0]["item"]["id"]
        user = await asyncio.wait_for(h.llm.retrieve_conversation_item(user_id), 5)
        assert (user.role, user.content[0].type, user.content[0].text) == (
            "user",
            "input_text",
            "Hello there",
        )
        answer_id = h.assistant_items()[0]
        answer = await asyncio.wait_for(h.llm.retrieve_conversation_item(answer_id), 5)
        transcript = h.received_of("response.output_audio_transcript.done")[0]["transcript"]
        assert (answer.role, answer.status, answer.content[0].type) == (
            "assistant",
            "completed",
            "output_audio",
        )
        assert answer.content[0].transcript == transcript, h.summary()
        h.assert_clean()


async def test_retrieve_of_a_missing_item_fails_that_call_and_the_session_carries_on(serve_url, speech_24k):
    # pipecat routes the error to the waiting call by its code and by the event_id it chose
    # ("rci_<item id>"), e.g. when an app checks that an item it deleted is gone.
    async with WireHarness(serve_url, _td_session(False)) as h:
        with pytest.raises(Exception) as failed:
            await asyncio.wait_for(h.llm.retrieve_conversation_item("item_gone"), 5)
        assert not isinstance(failed.value, (TimeoutError, asyncio.TimeoutError)), h.summary()
        await _push_to_talk(h, speech_24k)
        await h.until_received("response.done")
        h.assert_clean(also={"item_retrieve_invalid_item_id"})


async def test_reset_conversation_reconnects_to_a_new_session_and_it_answers(serve_url, speech_24k):
    # OpenAIRealtimeLLMService.reset_conversation(): disconnect, connect again, configure the
    # new session from the service's settings.
    async with WireHarness(serve_url, _td_session(False)) as h:
        await _hello(h)
        updates = len(h.sent_of("session.update"))
        await h.llm.reset_conversation()
        created = await h.until_received("session.created", 2)
        assert created[0]["session"]["id"] != created[1]["session"]["id"], h.summary()
        await h.until_received("session.updated", 3)
        assert len(h.sent_of("session.update")) == updates + 1, h.summary()
        assert h.received_of("session.updated")[-1]["session"]["instructions"] == "Be brief.", h.summary()
        await _push_to_talk(h, speech_24k)
        await h.until_received("response.done", 2)
        assert h.statuses() == [("completed", None), ("completed", None)], h.summary()
        # The new session's turn is its first: its items do not link to the old session's.
        committed = h.received_of("input_audio_buffer.committed")
        assert len(committed) == 1 and committed[0]["previous_item_id"] is None, h.summary()
        h.assert_clean()


async def test_a_video_frame_does_not_end_the_session(serve_url, speech_24k):
    # pipecat forwards camera frames (InputImageRawFrame, at most one a second) as user items
    # with an input_image part (examples/realtime/realtime-openai-video.py).
    async with WireHarness(serve_url, _td_session(False)) as h:
        await h.worker.queue_frame(
            InputImageRawFrame(image=b"\x80" * (16 * 16 * 3), size=(16, 16), format="RGB")
        )
        await h.until(lambda c: h.sent_of("conversation.item.create"))
        await h.until_received("conversation.item.added")
        # No engine here sees: the image part is kept as a marker, without the image.
        (added,) = h.received_of("conversation.item.added")
        assert added["item"]["content"] == [{"type": "input_image"}], h.summary()
        assert not h.server_errors(), h.summary()
        await _push_to_talk(h, speech_24k)
        await h.until_received("response.done", timeout=10)
        h.assert_clean()


# --- the embedded engine (the default engine's real speech) -------------------------------------


async def test_text_and_push_to_talk_turns_on_the_embedded_engine(embedded_url, speech_24k):
    """The same service paths on the embedded engine: a torch thinker (random weights: its
    words mean nothing) and Piper's real speech, in pipecat's push-to-talk mode."""
    async with Harness(embedded_url, _session(False)) as h:
        h.context.add_message({"role": "user", "content": "Hello there"})
        await h.worker.queue_frame(LLMContextFrame(h.context))
        await h.until(_responses(1), timeout=60)
        spoken = len(h.collector.of(TTSAudioRawFrame))
        assert spoken, h.summary()
        await h.worker.queue_frame(UserStartedSpeakingFrame())
        await _speak(h, speech_24k)
        await h.worker.queue_frame(UserStoppedSpeakingFrame())
        await h.until(_responses(2), timeout=60)
        assert len(h.collector.of(TTSAudioRawFrame)) > spoken, h.summary()
        assert not h.collector.of(ErrorFrame) and not h.logs, h.summary()
