"""A simulated caller: a microphone that streams real speech at real-time cadence.

The caller speaks utterances synthesised with Piper (so the server's real VAD has real speech
to find), streams silence between them as a real microphone does, and while the model answers
it may, at seeded random moments, say a short backchannel ("mm-hm": must not cancel) or barge
in with a new question (must cancel). Everything it hears and does is recorded on a timeline.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from ..audio.server_vad import ServerVad
from ..core.events import AudioDeltaEvent, ResponseCreated, ResponseDone, ServerEvent
from ..errors import MailboxFull, SessionClosed

if TYPE_CHECKING:
    from ..actors.session_handle import SessionHandle
    from ..audio.vad import VoiceActivityModel

CHUNK_MS = 20
SAMPLE_RATE = 16000
CHUNK_BYTES = SAMPLE_RATE * 2 * CHUNK_MS // 1000
SILENCE = bytes(CHUNK_BYTES)


@attrs.frozen(slots=True)
class Behaviour:
    barge_in_probability: float = 0.3
    backchannel_probability: float = 0.3
    pause_s: tuple[float, float] = (0.4, 1.2)


@attrs.define
class Timeline:
    """What one conversation did, in seconds since the caller started."""

    user_speech: list[tuple[float, float, str]] = attrs.Factory(list)
    model_audio: list[tuple[float, float]] = attrs.Factory(list)
    barge_ins: list[float] = attrs.Factory(list)
    backchannels: list[float] = attrs.Factory(list)
    responses: list[tuple[float, str, str | None]] = attrs.Factory(list)


@attrs.define
class CallerStats:
    state: str = "idle"
    turns_spoken: int = 0
    responses_completed: int = 0
    responses_cancelled: int = 0
    responses_failed: int = 0
    barge_ins_attempted: int = 0
    backchannels: int = 0
    audio_packets: int = 0
    stale_audio_after_cancel: int = 0
    last_ttft_ms: float | None = None


class Caller:
    def __init__(
        self,
        index: int,
        session: SessionHandle,
        vad_factory: Callable[[], VoiceActivityModel],
        speech: dict[str, bytes],
        turns: Iterable[str],
        backchannels: Iterable[str],
        rng: random.Random,
        behaviour: Behaviour = Behaviour(),
    ) -> None:
        self.index = index
        self.session = session
        self.vad = ServerVad(session, vad=vad_factory())
        self.speech = speech
        self.turns = list(turns)
        self.backchannel_texts = list(backchannels)
        self.rng = rng
        self.behaviour = behaviour
        self.stats = CallerStats()
        self.timeline = Timeline()
        self.metrics: list[dict[str, Any]] = []
        self._mic: deque[tuple[bytes, str]] = deque()
        self._speaking_until = 0.0
        self._t0 = time.perf_counter()
        self._awaiting_answer = False
        self._response_active = False
        self._cancelled_responses: set[str] = set()
        self._current_audio_end = 0.0
        self._pending: list[tuple[float, Callable[[], None]]] = []
        self.dropped_chunks = 0

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def say(self, text: str) -> None:
        pcm = self.speech[text]
        start = max(self.now(), self._speaking_until)
        self._speaking_until = start + len(pcm) / 2 / SAMPLE_RATE
        self.timeline.user_speech.append((start, self._speaking_until, text))
        for i in range(0, len(pcm), CHUNK_BYTES):
            chunk = pcm[i : i + CHUNK_BYTES]
            self._mic.append((chunk + bytes(CHUNK_BYTES - len(chunk)), text))

    async def microphone(self, deadline: float) -> None:
        """20 ms chunks at real-time cadence, speech when there is some, silence otherwise."""
        next_t = time.perf_counter()
        while time.perf_counter() < deadline:
            chunk = self._mic.popleft()[0] if self._mic else SILENCE
            try:
                self.vad.append(chunk)
            except MailboxFull:
                self.dropped_chunks += 1  # backpressure: the runtime refused it, said so, lost nothing
            except SessionClosed:
                return
            next_t += CHUNK_MS / 1000
            delay = next_t - time.perf_counter()
            if delay > 0:
                await anyio.sleep(delay)
            elif delay < -0.5:  # fell far behind (overloaded machine): do not burst to catch up
                next_t = time.perf_counter()

    async def conversation(self) -> None:
        """Speak a first turn, then react to what the model does until the session closes."""
        self._speak_next_turn()
        async for event in self.session.events():
            self._on_event(event)
            if event.type == "session.closed":
                return

    async def hang_up(self, deadline: float, grace_s: float = 15.0) -> None:
        """At the deadline, let an answer in progress finish (up to ``grace_s``), then close."""
        await anyio.sleep(max(deadline - time.perf_counter(), 0))
        with anyio.move_on_after(grace_s):
            while self._response_active:
                await anyio.sleep(0.05)
        try:
            await self.session.close("demo_finished")
        except SessionClosed:
            pass

    def _speak_next_turn(self) -> None:
        text = self.rng.choice(self.turns)
        self.stats.turns_spoken += 1
        self._awaiting_answer = True
        self.say(text)

    def _on_event(self, event: ServerEvent) -> None:
        t = self.now()
        self.stats.state = self.session.state
        if isinstance(event, ResponseCreated):
            self._response_active = True
            self._plan_overlap(t)
        elif isinstance(event, AudioDeltaEvent):
            if event.response_id in self._cancelled_responses:
                self.stats.stale_audio_after_cancel += 1
                return
            self.stats.audio_packets += 1
            duration = len(event.pcm) / 2 / event.sample_rate
            start = max(t, self._current_audio_end)
            self._current_audio_end = start + duration
            self.timeline.model_audio.append((start, self._current_audio_end))
        elif isinstance(event, ResponseDone):
            self._response_active = False
            self.timeline.responses.append((t, event.status, event.reason))
            m = event.metrics
            if m is not None:
                self.metrics.append(m.to_wire())
                self.stats.last_ttft_ms = m.ttft_ms
            if event.status in ("completed", "incomplete"):
                # incomplete = stopped at the token limit: a full answer as far as the caller hears
                self.stats.responses_completed += 1
                # Wait for the answer to finish playing, pause, then speak again.
                pause = self.rng.uniform(*self.behaviour.pause_s)
                self._queue_turn_after(max(self._current_audio_end - t, 0) + pause)
            elif event.status == "cancelled":
                self.stats.responses_cancelled += 1
                self._cancelled_responses.add(event.response_id)
                self.timeline.barge_ins.append(t)
                # Playback stops at once: audio queued past this moment is never heard.
                self.timeline.model_audio = [(a, min(b, t)) for a, b in self.timeline.model_audio if a < t]
                self._current_audio_end = t
            else:
                self.stats.responses_failed += 1
                self._queue_turn_after(self.rng.uniform(*self.behaviour.pause_s))

    def _plan_overlap(self, t: float) -> None:
        roll = self.rng.random()
        b = self.behaviour
        if roll < b.barge_in_probability:
            self.stats.barge_ins_attempted += 1
            self._later(self.rng.uniform(0.3, 1.5), lambda: self._speak_next_turn())
        elif roll < b.barge_in_probability + b.backchannel_probability and self.backchannel_texts:
            self.stats.backchannels += 1
            self.timeline.backchannels.append(t)
            self._later(self.rng.uniform(0.3, 1.0), lambda: self.say(self.rng.choice(self.backchannel_texts)))

    def _queue_turn_after(self, delay: float) -> None:
        self._later(delay, self._speak_next_turn)

    def _later(self, delay: float, action: Callable[[], None]) -> None:
        self._pending.append((time.perf_counter() + delay, action))

    async def scheduler(self, deadline: float) -> None:
        while time.perf_counter() < deadline:
            now = time.perf_counter()
            due = [p for p in self._pending if p[0] <= now]
            self._pending = [p for p in self._pending if p[0] > now]
            for _, action in due:
                action()
            await anyio.sleep(0.02)

    async def run(self, deadline: float) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.microphone, deadline + 20)
            tg.start_soon(self.scheduler, deadline)
            tg.start_soon(self.hang_up, deadline)
            await self.conversation()
            tg.cancel_scope.cancel()
