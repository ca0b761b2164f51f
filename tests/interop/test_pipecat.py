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

from .conftest import API_KEY, GA_RATE, chunks, get_weather_impl

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


async def test_tool_call(serve_url):
    ran: list[str] = []

    async def get_weather(params):
        ran.append(params.arguments.get("city", ""))
        await params.result_callback({"weather": get_weather_impl(params.arguments.get("city", "?"))})

    tools = ToolsSchema(
        standard_tools=[
            FunctionSchema(
                name="get_weather",
                description="Get the weather in a city",
                properties={"city": {"type": "string"}},
                required=["city"],
            )
        ]
    )
    async with Harness(serve_url, _session(False), tools=tools) as h:
        h.llm.register_function("get_weather", get_weather)
        h.context.add_message({"role": "user", "content": "What is the weather in Paris?"})
        await h.worker.queue_frame(LLMContextFrame(h.context))
        await h.until(lambda c: c.of(FunctionCallInProgressFrame))
        await h.until(lambda c: ran and _responses(2)(c))
        assert h.collector.of(TTSAudioRawFrame), h.summary()
        assert not h.collector.of(ErrorFrame) and not h.logs, h.summary()
