"""A response is produced no faster than its reader takes it: while a session holds
``unsent_audio_bytes`` of audio its reader has not taken, the engine's stream waits, and goes on
once half of it is taken. Nothing is lost, the watchdog does not take the wait for a stall, and
a cancel or a barge-in still ends a waiting response at once.

The scripted engine here never waits between packets (``packet_latency_s=0``): its stream does
not yield to the loop, so the whole answer would reach the session's mailbox before the
dispatcher ran once, unless the session counts what is on its way as well as its outbox."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import pytest

from duplex_actors import Runtime, Script, ScriptedEngine, SessionConfig

pytestmark = pytest.mark.anyio

PACKETS = 200
PACKET_MS = 100
PACKET_BYTES = 16000 * 2 * PACKET_MS // 1000  # pcm16 at the session's 16 kHz
LIMIT = 32 << 10  # ten packets
ANSWER = Script(
    tokens=(), audio_packets=PACKETS, packet_ms=PACKET_MS, packet_latency_s=0.0, fresh_packets=True
)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


async def _read_until_done(session) -> list:
    events = []
    with anyio.fail_after(10):
        async for event in session.events():
            events.append(event)
            if event.type == "response.done":
                return events
    return events


async def _until(predicate, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.005)


@contextlib.asynccontextmanager
async def _asked(limit: int | None = LIMIT, *, waiting: bool = True, **runtime) -> AsyncIterator[tuple]:
    """A runtime on the scripted answer, and a session that asked for it and reads nothing;
    ``waiting``: once the engine waits for that session's reader."""
    engine = ScriptedEngine(ANSWER)
    config = SessionConfig(unsent_audio_bytes=limit, modalities=("audio",))
    async with Runtime(engine, config=config, **runtime) as rt:
        session = await rt.open_session()
        await session.create_response()
        if waiting:
            await _until(lambda: rt.engine.statistics().waiting_for_listeners)
        yield rt, engine, session


async def test_the_engine_waits_for_a_reader_that_does_not_read_and_nothing_is_lost():
    async with _asked(waiting=False, stall_timeout_s=0.1) as (rt, _, session):
        await anyio.sleep(0.6)  # six stall timeouts, reading nothing

        stats = rt.engine.statistics()
        assert stats.waiting_for_listeners == 1 and stats.in_flight == 1
        assert stats.restarts == 0, "a wait for the listener is not a stall"
        # At most the allowance and the packet that reached it: never the whole answer.
        assert LIMIT <= session.unsent_audio_bytes < LIMIT + PACKET_BYTES

        events = await _read_until_done(session)
    audio = [e for e in events if e.type == "response.output_audio.delta"]
    assert len(audio) == PACKETS and all(len(e.pcm) == PACKET_BYTES for e in audio)
    assert events[-1].status == "completed"
    seqs = [e.seq for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "every event once, in order"


async def test_without_an_allowance_the_engine_runs_ahead_of_the_reader():
    # The same answer with the wait turned off: what the test above bounds is really held.
    async with _asked(None, waiting=False) as (rt, _, session):
        await _until(lambda: not rt.engine.statistics().in_flight)
        assert session.unsent_audio_bytes == PACKETS * PACKET_BYTES


@pytest.mark.parametrize("how", ["cancel", "barge_in"])
async def test_a_waiting_response_ends_at_once_when_cancelled_or_talked_over(how):
    async with _asked() as (rt, engine, session):
        await (session.cancel() if how == "cancel" else session.barge_in())
        events = await _read_until_done(session)
        assert [e.type for e in events].count("response.done") == 1
        assert events[-1].status == "cancelled"
        await _until(lambda: not (rt.engine.statistics().in_flight or engine.active), 2)
        assert rt.engine.statistics().aborted == 1
        if how == "barge_in":
            assert session.unsent_audio_bytes == 0, "the talked-over audio that was never sent is dropped"


async def test_a_reader_that_keeps_up_never_makes_the_engine_wait_long():
    # Reading as it comes: every packet arrives, and the waits (if any) end as the reader takes.
    async with _asked(waiting=False) as (_, _, session):
        events = await _read_until_done(session)
    assert sum(e.type == "response.output_audio.delta" for e in events) == PACKETS
    assert events[-1].status == "completed"


async def test_a_closed_session_leaves_no_stream_waiting():
    async with _asked() as (rt, engine, session):
        await session.close()
        await _until(lambda: not (rt.engine.statistics().in_flight or engine.active), 2)
        stats = rt.engine.statistics()
        assert stats.waiting_for_listeners == 0 and stats.aborted == 1


async def test_a_drain_does_not_wait_for_a_reader_that_is_away():
    # While the runtime drains, the server takes no resume: a response waiting for a client that
    # is away would hold the shutdown up until its deadline. It runs to its end instead.
    async with _asked() as (rt, _, session):
        rt.drain()
        await _until(lambda: not rt.responses_in_flight, 2)
        assert rt.engine.statistics().completed == 1
        events = await _read_until_done(session)
        assert sum(e.type == "response.output_audio.delta" for e in events) == PACKETS
        assert events[-1].status == "completed"


async def test_a_long_text_answer_waits_at_half_the_outbox_instead_of_closing_the_session():
    # Small deltas fill the outbox's capacity in events long before any byte bound: a reader
    # that did not keep up (or a client away for a resume) had its session closed as a slow
    # consumer. The engine now waits at half the capacity, and the reader gets all of it.
    script = Script(tokens=tuple(f" t{i}" for i in range(400)), audio_packets=0)
    async with Runtime(ScriptedEngine(script)) as rt:
        session = await rt.open_session(outbox_capacity=64, outbox_reserve=8, modalities=("text",))
        await session.create_response()
        await _until(lambda: rt.engine.statistics().waiting_for_listeners)
        await anyio.sleep(0.2)
        assert session.state != "closed"
        # Half the capacity, and what the last output and the response's opening added.
        assert 32 <= session.core.pending_events <= 36
        events = await _read_until_done(session)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "".join(
        script.tokens
    )
    assert events[-1].status == "completed"
