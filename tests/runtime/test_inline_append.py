"""An append told to a session with nothing queued is processed by its caller, at once; any
other append waits in the mailbox behind what was queued before it (SessionActor.tell_audio).
Both paths keep the runtime's contract: order, exactly once, errors as events."""

from __future__ import annotations

import pytest

from duplex_actors import Runtime, ScriptedEngine
from duplex_actors.core import commands as cmd
from duplex_actors.core.session import SessionCore

from ..reliability.conftest import CHUNK, Reader

pytestmark = pytest.mark.anyio


async def test_an_append_to_an_idle_session_is_processed_before_the_call_returns():
    async with Runtime(ScriptedEngine(), reaper_interval_s=0) as rt:
        s = await rt.open_session()
        before = s.mailbox_statistics()
        s.append_audio(CHUNK)  # no await: nothing else could have run
        assert s.core.buffered_input_bytes == len(CHUNK)
        after = s.mailbox_statistics()
        assert after.accepted == before.accepted + 1
        assert (after.depth, after.high_water) == (0, before.high_water)
        s.tell(cmd.AppendAudio(pcm=CHUNK))  # tell takes the same path for an append
        assert s.core.buffered_input_bytes == 2 * len(CHUNK)


async def test_an_append_never_overtakes_a_message_queued_before_it():
    async with Runtime(ScriptedEngine(), reaper_interval_s=0) as rt:
        s = await rt.open_session()
        s.append_audio(CHUNK)  # processed now
        s.tell(cmd.ClearInput())  # queued: the session is now scheduled
        s.append_audio(CHUNK + CHUNK)  # must wait behind the clear
        assert s.core.buffered_input_bytes == len(CHUNK)
        assert s.mailbox_statistics().depth == 2
        await s.barrier()
        # Clear, then the second append: had the append run first, the clear took it too.
        assert s.core.buffered_input_bytes == 2 * len(CHUNK)


async def test_an_append_told_inside_a_dispatcher_round_is_queued_not_run_inside_it():
    async with Runtime(ScriptedEngine(), reaper_interval_s=0) as rt:
        closing = await rt.open_session()
        other = await rt.open_session()
        seen: list[int] = []

        def on_close(session_id: str) -> None:
            # Runs inside the dispatcher's round that processes the close.
            if session_id == closing.id:
                other.append_audio(CHUNK)
                seen.append(other.mailbox_statistics().data)

        rt.add_close_listener(on_close)
        await closing.close()
        assert seen == [1]  # it waited in the mailbox
        await other.barrier()
        assert other.core.buffered_input_bytes == len(CHUNK)  # and was processed once


async def test_a_refused_inline_append_is_an_error_event_with_its_event_id():
    async with Runtime(ScriptedEngine(), reaper_interval_s=0) as rt:
        s = await rt.open_session(max_input_bytes=len(CHUNK))
        r = Reader(s)
        s.append_audio(CHUNK)
        s.append_audio(CHUNK, event_id="evt-over")  # no exception for the caller
        err = await r.until_type("error")
        assert (err.code, err.client_event_id) == ("input_backpressure", "evt-over")
        assert s.core.buffered_input_bytes == len(CHUNK)


async def test_a_bug_while_processing_inline_fails_that_session_not_the_caller(monkeypatch):
    async with Runtime(ScriptedEngine(), reaper_interval_s=0) as rt:
        s = await rt.open_session()
        neighbour = await rt.open_session()
        r = Reader(s)

        original = SessionCore.handle

        def broken(core, command, *, received_at=None):
            if core is s.core:
                raise RuntimeError("a bug")
            original(core, command, received_at=received_at)

        monkeypatch.setattr(SessionCore, "handle", broken)
        s.append_audio(CHUNK)  # the caller sees nothing raised
        err = await r.until_type("error")
        assert err.code == "internal_error"
        await r.until_type("session.closed")
        assert s.state == "closed"
        neighbour.append_audio(CHUNK)
        assert neighbour.core.buffered_input_bytes == len(CHUNK)
