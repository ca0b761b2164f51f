"""A turn's transcription started when the user goes quiet, before server VAD commits it
(InputSpeculator, Runtime._speculate): the commit's transcript is that decode's when the
committed audio holds its speech; speech before the commit discards it unseen; a decode that
fails or was stopped leaves the turn to the usual queue; every turn gets exactly one
``completed`` (or ``failed``), its deltas joined being the transcript."""

from __future__ import annotations

import threading

import anyio
import pytest

from duplex_actors import Runtime, ScriptedEngine
from duplex_actors.actors.transcription_queue import InputSpeculator, Speculation, TranscriptionJob
from duplex_actors.audio.server_vad import ServerVad
from duplex_actors.audio.turn_detection import TurnDetectionConfig
from duplex_actors.core import commands as cmd
from duplex_actors.core.actions import TranscribeInput
from duplex_actors.core.audio_budget import AudioBudget

pytestmark = pytest.mark.anyio

CHUNK = 1600  # samples: 100 ms at 16 kHz


def loud(level: int = 3000) -> bytes:
    return level.to_bytes(2, "little", signed=True) * CHUNK


QUIET = bytes(2 * CHUNK)


class LoudnessVad:
    """A frame is speech when it is loud."""

    sample_rate = 16000
    frame_samples = 320

    def probability(self, frame: bytes) -> float:
        samples = memoryview(frame).cast("h")
        return 0.95 if sum(abs(x) for x in samples) / len(samples) > 1000 else 0.02

    def reset(self) -> None:
        pass


def words_of(pcm: bytes) -> str:
    """What the stand-in recogniser hears: one word per loud chunk, named by its level."""
    said = []
    for i in range(0, len(pcm) - 2 * CHUNK + 1, 2 * CHUNK):
        level = int.from_bytes(pcm[i : i + 2], "little", signed=True)
        if level:
            said.append(f"w{level}")
    return " ".join(said)


class GuessingRecogniser:
    """A speculative recogniser: takes ``decode_s`` per turn, stops when told to."""

    name = "guessing"
    speculative = True
    max_concurrent = 1

    def __init__(self, decode_s: float = 0.05, fail: bool = False) -> None:
        self.decode_s = decode_s
        self.fail = fail
        self.calls: list[tuple[str, threading.Event | None]] = []

    def supports_language(self, language: str | None) -> bool:
        return True

    async def transcribe(
        self, pcm: bytes, sample_rate: int, *, cancelled: threading.Event | None = None
    ) -> str:
        self.calls.append((words_of(pcm), cancelled))
        for _ in range(10):
            await anyio.sleep(self.decode_s / 10)
            if cancelled is not None and cancelled.is_set():
                raise RuntimeError("stopped")
        if self.fail and cancelled is not None:
            raise RuntimeError("the guess failed")
        return words_of(pcm)


# -- the speculator alone (sans-IO) ------------------------------------------------------


def test_the_speculator_starts_once_per_quiet_and_discards_when_speech_resumes():
    started: list[tuple[bytes, bytes]] = []
    discarded: list[int] = []
    spec = InputSpeculator(
        lambda prefix, speech: started.append((prefix, speech)),
        lambda: discarded.append(1),
        sample_rate=16000,
        after_ms=200,
        prefix_ms=100,
    )
    spec.heard([cmd.AppendAudio(pcm=QUIET)], False)
    spec.heard([cmd.AppendAudio(pcm=QUIET)], False)  # before the turn: only 100 ms are kept
    spec.heard([cmd.SpeechStartedSignal(audio_ms=200), cmd.AppendAudio(pcm=loud())], True)
    spec.heard([cmd.AppendAudio(pcm=QUIET)], False)
    assert started == []  # 100 ms of quiet: a pause between words, maybe
    spec.heard([cmd.AppendAudio(pcm=QUIET)], False)
    assert len(started) == 1
    prefix, speech = started[0]
    assert prefix == QUIET and speech == loud() + QUIET + QUIET
    spec.heard([cmd.AppendAudio(pcm=QUIET)], False)
    assert len(started) == 1 and discarded == []  # once per quiet
    spec.heard([cmd.AppendAudio(pcm=loud(4000))], True)  # they speak again
    assert discarded == [1]
    spec.heard([cmd.AppendAudio(pcm=QUIET)], False)
    spec.heard([cmd.AppendAudio(pcm=QUIET)], False)
    assert len(started) == 2 and started[1][1].startswith(speech) and loud(4000) in started[1][1]
    spec.heard([cmd.SpeechStoppedSignal(audio_ms=900), cmd.AppendAudio(pcm=QUIET)], False)
    assert discarded == [1]  # the commit claims the decode: not discarded at the stop
    spec.heard([cmd.SpeechStartedSignal(audio_ms=2000), cmd.AppendAudio(pcm=loud())], True)
    assert discarded == [1, 1]  # a new turn drops one nobody claimed


def test_the_speculator_follows_only_wanted_turns_and_not_past_its_length():
    started: list[bytes] = []
    discarded: list[int] = []
    wanted = [False]
    spec = InputSpeculator(
        lambda prefix, speech: started.append(speech),
        lambda: discarded.append(1),
        sample_rate=16000,
        after_ms=100,
        max_s=0.45,
        wanted=lambda: wanted[0],
    )
    spec.heard([cmd.SpeechStartedSignal(audio_ms=0), cmd.AppendAudio(pcm=loud())], True)
    spec.heard([cmd.AppendAudio(pcm=QUIET)], False)
    assert started == []  # the session does not transcribe: the turn is not even copied
    spec.heard([cmd.SpeechStoppedSignal(audio_ms=100)], False)
    wanted[0] = True
    spec.heard([cmd.SpeechStartedSignal(audio_ms=1000), cmd.AppendAudio(pcm=loud())], True)
    spec.heard([cmd.AppendAudio(pcm=QUIET)], False)
    assert len(started) == 1
    spec.heard([cmd.AppendAudio(pcm=loud())], True)
    assert discarded == [1]
    spec.heard([cmd.AppendAudio(pcm=loud())], True)
    spec.heard([cmd.AppendAudio(pcm=QUIET)], False)  # 500 ms: past max_s
    spec.heard([cmd.AppendAudio(pcm=QUIET)], False)
    assert len(started) == 1  # a turn that long is left to the queue


def test_the_turn_the_speculator_keeps_counts_in_the_audio_budget_until_it_lets_it_go():
    # Its copy of the turn (the input buffer holds the same audio) was counted nowhere: up to
    # max_s (20 s, 640 KB at 16 kHz) a session with server VAD and transcription on.
    budget = AudioBudget(1 << 20)
    account = budget.join("client")
    spec = InputSpeculator(
        lambda prefix, speech: None, lambda: None, sample_rate=16000, max_s=0.45, account=account
    )
    spec.heard([cmd.AppendAudio(pcm=QUIET)], False)
    assert account.held == 0  # the quiet before a turn is not a copy kept for it
    spec.heard([cmd.SpeechStartedSignal(audio_ms=100), cmd.AppendAudio(pcm=loud())], True)
    spec.heard([cmd.AppendAudio(pcm=QUIET)], False)
    assert account.held == budget.total == 2 * len(QUIET)
    spec.heard([cmd.SpeechStoppedSignal(audio_ms=300)], False)  # committed: let go
    assert account.held == 0
    spec.heard([cmd.SpeechStartedSignal(audio_ms=1000), cmd.AppendAudio(pcm=loud())], True)
    for _ in range(3):
        spec.heard([cmd.AppendAudio(pcm=loud())], True)
    assert account.held == 4 * len(QUIET)  # 400 ms
    spec.heard([cmd.AppendAudio(pcm=loud())], True)  # 500 ms, past max_s: no longer followed
    assert account.held == 0
    spec.heard([cmd.SpeechStartedSignal(audio_ms=2000), cmd.AppendAudio(pcm=loud())], True)
    assert account.held == len(QUIET)
    spec.release()  # its session closed
    assert account.held == 0
    spec.heard([cmd.AppendAudio(pcm=loud())], True)
    assert account.held == 0  # released: counted no more


async def test_a_sessions_speculators_give_their_audio_back_when_replaced_and_at_close():
    async with Runtime(ScriptedEngine(), transcriber=GuessingRecogniser()) as rt:
        session = await rt.open_session(server_vad=True, transcription="any", auto_respond=False)
        budget = rt.audio_budget
        first = session.input_speculator()
        assert first is not None and first.account is not None
        first.heard([cmd.SpeechStartedSignal(audio_ms=0), cmd.AppendAudio(pcm=loud())], True)
        assert budget.total == len(QUIET)
        second = session.input_speculator()  # a new server VAD (an update, a resume)
        assert budget.total == 0 and first.account is None
        second.heard([cmd.SpeechStartedSignal(audio_ms=0), cmd.AppendAudio(pcm=loud())], True)
        assert budget.total == len(QUIET)
        await session.close()
        with anyio.fail_after(5):
            while budget.clients:
                await anyio.sleep(0.01)
        assert budget.total == 0


def test_a_speculation_answers_only_a_committed_turn_that_holds_its_speech():
    speech = loud() + QUIET
    spec = Speculation(QUIET + speech, speech, 16000)

    def job(audio: bytes, rate: int = 16000) -> TranscriptionJob:
        return TranscriptionJob("s", TranscribeInput("item", audio, rate), lambda result: None)

    assert not spec.claim(job(QUIET + loud(4000) + QUIET))  # other speech
    assert not spec.claim(job(QUIET + speech + QUIET, rate=24000))
    assert spec.claim(job(QUIET * 3 + speech + QUIET * 3))
    assert not spec.claim(job(QUIET + speech))  # claimed once
    spec.cancel()
    assert not spec.cancelled.is_set()  # a claimed decode is never cancelled
    other = Speculation(speech, speech, 16000)
    other.cancel()
    assert not other.claim(job(speech))


# -- through the runtime ------------------------------------------------------------------


async def _talk(recogniser: GuessingRecogniser, chunks: list[bytes]) -> list:
    """Speak ``chunks`` (100 ms each) into a server-VAD session with transcription on, then
    wait for the turn's transcription to end; the session's events."""
    async with Runtime(ScriptedEngine(), transcriber=recogniser) as rt:
        session = await rt.open_session(server_vad=True, transcription="any", auto_respond=False)
        vad = ServerVad(session, vad=LoudnessVad(), config=TurnDetectionConfig(silence_duration_ms=500))
        assert (vad.listener is not None) == recogniser.speculative
        seen: list = []

        async def listen():
            async for event in session.events():
                seen.append(event)

        async with anyio.create_task_group() as tg:
            tg.start_soon(listen)
            for chunk in chunks:
                vad.append(chunk)
                await anyio.sleep(0.1)  # real time: a decode runs while the VAD waits
            with anyio.fail_after(10):
                while not any(
                    e.type.endswith("transcription.completed") or e.type.endswith("transcription.failed")
                    for e in seen
                ):
                    await anyio.sleep(0.01)
            await anyio.sleep(0.3)  # nothing more comes
            await session.close()
    return seen


def _transcription(events: list) -> tuple[list[str], list]:
    deltas = [e.delta for e in events if e.type.endswith("input_audio_transcription.delta")]
    ends = [e for e in events if e.type.endswith(("transcription.completed", "transcription.failed"))]
    return deltas, ends


async def test_the_decode_started_in_the_quiet_is_the_committed_turns_transcript():
    recogniser = GuessingRecogniser()
    events = await _talk(
        recogniser, [QUIET, loud(), loud(3001), QUIET, QUIET, QUIET, QUIET, QUIET, QUIET, QUIET]
    )
    deltas, ends = _transcription(events)
    assert len(ends) == 1 and ends[0].type.endswith("completed")
    assert ends[0].transcript == "w3000 w3001" and "".join(deltas) == ends[0].transcript
    # One decode, the speculative one (it was given a way to stop); none after the commit.
    assert [(words, cancelled is not None) for words, cancelled in recogniser.calls] == [
        ("w3000 w3001", True)
    ]
    stopped = [e for e in events if e.type == "input_audio_buffer.speech_stopped"]
    completed_at = events.index(ends[0])
    assert stopped and events.index(stopped[0]) < completed_at


async def test_speech_after_the_quiet_discards_the_first_decode_and_yields_no_event_for_it():
    recogniser = GuessingRecogniser(decode_s=0.05)
    chunks = [QUIET, loud(), QUIET, QUIET, QUIET, loud(3002), QUIET, QUIET, QUIET, QUIET, QUIET, QUIET, QUIET]
    events = await _talk(recogniser, chunks)
    deltas, ends = _transcription(events)
    assert len(ends) == 1 and ends[0].transcript == "w3000 w3002"
    assert "".join(deltas) == ends[0].transcript
    # The first guess heard only the first word, and no event ever carried it alone.
    assert recogniser.calls[0][0] == "w3000"
    assert all(d != "w3000" for d in deltas)
    assert len([e for e in events if e.type == "input_audio_buffer.committed"]) == 1


async def test_a_failed_guess_leaves_the_turn_to_the_queue():
    recogniser = GuessingRecogniser(fail=True)
    events = await _talk(recogniser, [QUIET, loud(), QUIET, QUIET, QUIET, QUIET, QUIET, QUIET, QUIET])
    deltas, ends = _transcription(events)
    assert len(ends) == 1 and ends[0].type.endswith("completed") and ends[0].transcript == "w3000"
    assert "".join(deltas) == "w3000"
    # The guess, then the committed turn decoded the usual way (without a way to stop it).
    assert [cancelled is not None for _, cancelled in recogniser.calls] == [True, False]


async def test_a_recogniser_that_cannot_stop_is_never_asked_to_guess():
    recogniser = GuessingRecogniser()
    recogniser.speculative = False  # type: ignore[misc]
    events = await _talk(recogniser, [QUIET, loud(), QUIET, QUIET, QUIET, QUIET, QUIET, QUIET, QUIET])
    _, ends = _transcription(events)
    assert ends[0].transcript == "w3000"
    assert [cancelled for _, cancelled in recogniser.calls] == [None]
