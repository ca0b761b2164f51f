"""Admission and backpressure: session limit, input bytes, mailbox bound, bounded output with
a reserve for terminal events and the slow-consumer policy."""

from __future__ import annotations

import anyio
import pytest

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.core import commands as cmd
from duplex_actors.errors import Backpressure, MailboxFull, ResourceExhausted

from .conftest import CHUNK, Reader, audit, settle, turn

pytestmark = pytest.mark.anyio


async def test_session_limit_is_a_retryable_resource_exhausted_and_the_slot_comes_back():
    async with Runtime(ScriptedEngine(), max_sessions=3, reaper_interval_s=0) as rt:
        sessions = [await rt.open_session() for _ in range(3)]
        with pytest.raises(ResourceExhausted) as info:
            await rt.open_session()
        assert info.value.retryable and info.value.code == "resource_exhausted"
        assert rt.session_count == 3 and rt.opened == 3
        r = Reader(sessions[0])
        await sessions[0].close()
        await r.drain()
        s4 = await rt.open_session()  # the closed session's slot is free again
        r4 = Reader(s4)
        await turn(s4, r4)
        assert rt.session_count == 3


async def test_input_bytes_beyond_the_limit_are_refused_and_change_nothing():
    limit = len(CHUNK) * 4
    async with Runtime(ScriptedEngine(), reaper_interval_s=0) as rt:
        s = await rt.open_session(max_input_bytes=limit)
        r = Reader(s)
        for _ in range(4):
            await s.ask(cmd.AppendAudio(pcm=CHUNK))
        with pytest.raises(Backpressure) as info:
            await s.ask(cmd.AppendAudio(pcm=CHUNK, event_id="evt-5"))
        assert info.value.code == "input_backpressure" and info.value.retryable
        assert s.core.buffered_input_bytes == limit  # nothing of the refused chunk kept
        # Told (fire-and-forget) appends get the refusal as an error event echoing event_id.
        s.append_audio(CHUNK, event_id="evt-6")
        err = await r.until_type("error")
        assert err.code == "input_backpressure" and err.client_event_id == "evt-6"
        await s.commit()  # committing frees the buffer: input is accepted again
        assert (await r.until_type("response.done")).status == "completed"
        await s.ask(cmd.AppendAudio(pcm=CHUNK))
        assert s.core.buffered_input_bytes == len(CHUNK)


async def test_full_mailbox_refuses_with_mailbox_full_and_loses_nothing_accepted():
    async with Runtime(ScriptedEngine(), mailbox_capacity=8, reaper_interval_s=0) as rt:
        s = await rt.open_session()
        accepted = refused = 0
        # Appends queue only behind a waiting message (to a session with nothing queued they
        # are processed by their caller at once): a told heartbeat makes the burst queue.
        s.tell(cmd.Heartbeat())
        for _i in range(20):  # no await: the dispatcher cannot drain in between
            try:
                s.append_audio(CHUNK)
                accepted += 1
            except MailboxFull as err:
                assert err.retryable and err.code == "mailbox_full"
                refused += 1
        assert (accepted, refused) == (8, 12)
        stats = s.mailbox_statistics()
        assert stats.data == 8 and stats.refused == 12
        await s.heartbeat()  # the control lane is separate and still takes commands
        await anyio.sleep(0.01)
        assert s.core.buffered_input_bytes == accepted * len(CHUNK)
        assert s.mailbox_statistics().depth == 0


async def test_a_consumer_that_never_reads_hits_the_slow_consumer_policy():
    # The engine's output waits for a reader at half the outbox (tests/runtime/test_listener_flow.py);
    # what the client asks for itself does not: heartbeats it never reads the acks of fill the
    # rest, mid-response.
    script = Script(tokens=tuple(f" t{i}" for i in range(400)), audio_packets=400, packet_ms=20)
    async with Runtime(ScriptedEngine(script), reaper_interval_s=0) as rt:
        s = await rt.open_session(outbox_capacity=64, outbox_reserve=8)
        other = await rt.open_session()
        ro = Reader(other)
        s.append_audio(CHUNK * 5)
        await s.commit()
        with anyio.fail_after(5):
            while not rt.engine.statistics().waiting_for_listeners:
                await anyio.sleep(0.005)
        for _ in range(64):
            s.tell(cmd.Heartbeat())
        with anyio.fail_after(5):
            while s.state != "closed":
                await anyio.sleep(0.005)
        # Memory stayed bounded: never more than the outbox capacity held for the client.
        assert s.core.pending_events <= 64
        assert s.core.close_reason == "slow_consumer"
        r = Reader(s)
        events = await r.drain()
        audit(events)  # contiguous seqs, the response ended exactly once, one session.closed
        assert events[-1].reason == "slow_consumer"
        done = r.of_type("response.done")
        assert len(done) == 1 and done[0].status == "cancelled"
        await settle(rt)  # the engine request was aborted, not left streaming
        await turn(other, ro)  # a neighbour is untouched


async def test_terminal_events_always_fit_the_reserve():
    # The non-reserved part (16 events) fills up mid-response, nobody reading (the engine's
    # output waits at half of it; heartbeats the client sends fill the rest): the response's
    # response.done and the session.closed must still be there, in that order, and the buffer
    # never holds more than its capacity.
    script = Script(tokens=tuple(f" t{i}" for i in range(40)), audio_packets=0)
    async with Runtime(ScriptedEngine(script), reaper_interval_s=0) as rt:
        s = await rt.open_session(outbox_capacity=20, outbox_reserve=4)
        s.append_audio(CHUNK)
        await s.commit()
        with anyio.fail_after(5):
            while not rt.engine.statistics().waiting_for_listeners:
                await anyio.sleep(0.005)
        for _ in range(20):
            s.tell(cmd.Heartbeat())
        with anyio.fail_after(5):
            while s.state != "closed":
                await anyio.sleep(0.005)
        assert s.core.pending_events <= 20
        r = Reader(s)
        events = await r.drain()
        audit(events)
        assert [e.type for e in events if e.TERMINAL] == ["response.done", "session.closed"]
        await settle(rt)


async def test_a_closed_session_keeps_its_slot_until_engine_cleanup_succeeds():
    """Close mid-response while the backend's abort keeps failing: the session is closed (one
    session.closed), but its admission slot comes back only once the retried abort went through."""
    from duplex_actors.testing.faults import FaultyEngine

    engine = FaultyEngine(ScriptedEngine(Script(token_latency_s=0.05, tokens=("x",) * 200)), abort_failures=3)
    async with Runtime(engine, max_sessions=1, reaper_interval_s=0) as rt:
        s = await rt.open_session()
        s.append_audio(b"\x01\x00" * 320)
        await s.commit()
        async for e in s.events():
            if e.type == "response.output_text.delta":
                break
        await s.close()
        assert s.state == "closed"
        assert rt.statistics().draining == 1
        with pytest.raises(ResourceExhausted):
            await rt.open_session()
        with anyio.fail_after(10):  # the watchdog retries the abort every 0.5 s
            while rt.statistics().draining:
                await anyio.sleep(0.05)
        assert engine.abort_calls >= 4 and engine.abort_ok
        await rt.open_session()  # the slot is back
