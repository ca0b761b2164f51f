"""End-to-end through the real runtime (dispatcher, session actors, engine actor) on the
scripted engine."""

import runpy
import sys
from pathlib import Path

import anyio
import pytest

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.core import commands as cmd
from duplex_actors.errors import InputBufferEmpty, MailboxFull, ResourceExhausted, SessionClosed

CHUNK = b"\x01\x00" * 320
pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


async def collect_until(session, type_, limit=500):
    seen = []
    with anyio.fail_after(10):
        async for e in session.events():
            seen.append(e)
            if e.type == type_ or len(seen) >= limit:
                return seen
    return seen


async def test_two_sessions_converse_and_close():
    engine = ScriptedEngine(Script(token_latency_s=0.001))
    async with Runtime(engine) as rt:
        a, b = await rt.open_session(), await rt.open_session()
        for s in (a, b):
            s.append_audio(CHUNK)
            await s.commit()
        for s in (a, b):
            evs = await collect_until(s, "response.done")
            assert [e.type for e in evs].count("response.created") == 1
            assert evs[-1].status == "completed"
            assert (
                "".join(e.delta for e in evs if e.type == "response.output_text.delta")
                == "Hello there, how can I help?"
            )
        await a.close()
        evs = await collect_until(a, "session.closed")
        assert evs[-1].type == "session.closed"
        with pytest.raises(SessionClosed):
            a.append_audio(CHUNK)
        with pytest.raises(SessionClosed):
            await a.commit()
        assert rt.session_count == 1
    assert engine.active == set()


async def test_barge_in_aborts_the_engine_request_and_no_old_audio_follows():
    engine = ScriptedEngine(
        Script(
            token_latency_s=0.005,
            packet_latency_s=0.005,
            audio_packets=50,
            tokens=tuple(f" w{i}" for i in range(50)),
        )
    )
    async with Runtime(engine) as rt:
        s = await rt.open_session()
        s.append_audio(CHUNK)
        await s.commit()
        evs = await collect_until(s, "response.output_audio.delta")
        await s.barge_in()
        evs += await collect_until(s, "response.done")
        done = evs[-1]
        assert done.status == "cancelled" and done.reason == "turn_detected"
        with anyio.fail_after(2):
            while engine.active:
                await anyio.sleep(0.005)
        assert engine.aborted == [f"{s.id}/e0/t0"]
        # next turn works under the new epoch; nothing of epoch 0 arrives any more
        s.append_audio(CHUNK)
        await s.commit()
        later = await collect_until(s, "response.done")
        assert all(e.epoch == 1 for e in later)
        assert rt.engine.statistics().routes == 0


async def test_errors_of_told_commands_arrive_as_error_events_with_event_id():
    async with Runtime(ScriptedEngine()) as rt:
        s = await rt.open_session()
        s.tell(cmd.CommitInput(event_id="evt_42"))
        evs = await collect_until(s, "error")
        err = evs[-1]
        assert err.code == InputBufferEmpty.code and err.client_event_id == "evt_42"
        with pytest.raises(InputBufferEmpty):
            await s.commit()
        assert s.state == "idle"


async def test_admission_and_mailbox_backpressure():
    async with Runtime(ScriptedEngine(), max_sessions=2, mailbox_capacity=4) as rt:
        s = await rt.open_session()
        await rt.open_session()
        with pytest.raises(ResourceExhausted):
            await rt.open_session()
        accepted = 0
        # An append to a session with nothing queued is processed at once, by its caller; one
        # told while a message waits queues behind it. A told heartbeat makes the burst queue.
        s.tell(cmd.Heartbeat())
        with pytest.raises(MailboxFull):
            for _ in range(100):  # no await: the dispatcher cannot drain in between
                s.append_audio(CHUNK)
                accepted += 1
        assert accepted == 4
        await s.heartbeat()  # control lane is separate and still open
        assert s.core.buffered_input_bytes == 4 * len(CHUNK)  # every accepted chunk, once


async def test_engine_failure_mid_stream_gives_one_failed_done_and_session_goes_on():
    script = {"n": 0}

    def choose(request):
        script["n"] += 1
        return Script(fail_after=3, fail_mode="raise") if script["n"] == 1 else Script()

    async with Runtime(ScriptedEngine(choose)) as rt:
        s = await rt.open_session()
        s.append_audio(CHUNK)
        await s.commit()
        evs = await collect_until(s, "response.done")
        assert evs[-1].status == "failed"
        s.append_audio(CHUNK)
        await s.commit()
        evs = await collect_until(s, "response.done")
        assert evs[-1].status == "completed"


@pytest.mark.parametrize("backend_flag", [[], ["--trio"]], ids=["asyncio", "trio"])
def test_embedding_example_runs(capsys, backend_flag):
    path = Path(__file__).resolve().parents[2] / "examples" / "embed_app.py"
    sys.argv = [str(path), *backend_flag]
    runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    assert "turn 0: response.done status=completed" in out
    assert "turn 1: response.done status=cancelled reason=turn_detected" in out
    assert "session.closed reason=client_closed" in out


async def test_runtime_exit_closes_the_backend():
    engine = ScriptedEngine()
    async with Runtime(engine):
        assert engine.started == 1
    assert engine.closed == 1


# The reader woken by the first audio runs before the dispatcher's next round on asyncio (FIFO);
# trio promises no order among runnable tasks, so the split of batches is asyncio's only.
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_waiting_reader_gets_a_responses_first_audio_before_the_rest_of_its_batch():
    """The engine hands over a response's first packet together with more (here: every output
    at once, as a phrase's packets or a short response's end come). The session stops its batch
    at the first audio, so a waiting reader wakes with that audio as the last ready event, and
    the rest follows on the next wake-up: nothing lost, nothing reordered."""
    engine = ScriptedEngine(Script(tokens=("Hi", " there"), audio_packets=3, packet_ms=20))
    async with Runtime(engine) as rt:
        s = await rt.open_session()
        s.append_audio(CHUNK)
        await s.commit()
        batches: list[list[str]] = []
        with anyio.fail_after(10):
            while not batches or "response.done" not in batches[-1]:
                assert await s.wait_events()
                batches.append([e.type for e in s.ready_events()])
    audio_batch = next(b for b in batches if "response.output_audio.delta" in b)
    assert audio_batch.count("response.output_audio.delta") == 1
    # Only the first packet's own transcript comes after its audio in that batch.
    after = audio_batch[audio_batch.index("response.output_audio.delta") + 1 :]
    assert set(after) <= {"response.output_audio_transcript.delta"}
    # The first audio is the batch's only audio; the later packets and the end came after it.
    everything = [t for b in batches for t in b]
    assert everything.count("response.output_audio.delta") == 3
    assert everything.count("response.done") == 1 and everything[-1] == "response.done"


async def test_the_idle_timer_follows_the_core_and_a_close_cancels_it():
    """One loop timer per session for server VAD's idle timeout: set when a response ends,
    dropped when the user speaks, and cancelled by a close (a closed session holds none)."""
    async with Runtime(ScriptedEngine(Script(token_latency_s=0.001, audio_packets=0))) as rt:
        session = await rt.open_session(server_vad=True, respond_on_commit=False, idle_timeout_ms=200)
        actor = session._actor
        await session.create_response()
        await collect_until(session, "response.done")
        assert actor._idle_timer is not None and actor._idle_at == session.core.idle_deadline
        session.tell(cmd.SpeechStartedSignal(audio_ms=0))
        with anyio.fail_after(5):
            while actor._idle_timer is not None:
                await anyio.sleep(0.01)
        assert session.core.idle_deadline is None
        session.tell(cmd.SpeechStoppedSignal(audio_ms=0))  # nothing buffered: no turn, quiet again
        with anyio.fail_after(5):
            while actor._idle_timer is None:
                await anyio.sleep(0.01)
        # It runs out: the session answers on its own.
        evs = await collect_until(session, "response.done")
        assert [e.type for e in evs][:3] == [
            "input_audio_buffer.speech_started",
            "input_audio_buffer.speech_stopped",
            "input_audio_buffer.timeout_triggered",
        ]
        assert actor._idle_timer is not None  # set again after that response
        await session.close()
        await collect_until(session, "session.closed")
        assert actor._idle_timer is None and actor._idle_at is None


async def test_metered_dispatcher_time_is_counted_by_tenant_and_split_by_session():
    # A server sharing the loop by client bills each client for its sessions' state machines;
    # here a clock that advances 1 s a reading makes every round cost 1 s.
    readings = iter(range(10**6))
    async with Runtime(ScriptedEngine(Script(token_latency_s=0.001))) as rt:
        rt.meter_tenant_work(lambda: float(next(readings)))
        mine = [await rt.open_session(tenant="key:a") for _ in range(3)]
        theirs = await rt.open_session(tenant="key:b")
        alone = await rt.open_session()  # no tenant: a tenant of its own
        for s in (*mine, theirs, alone):
            s.append_audio(CHUNK)
            await s.commit()
        for s in (*mine, theirs, alone):
            await collect_until(s, "response.done")
        work = rt.take_tenant_work()
        assert set(work) == {"key:a", "key:b", alone.id}
        # Every round cost 1 s, split evenly: all of it was handed out, and the client with
        # three sessions was billed more than the one with one.
        assert sum(work.values()) == pytest.approx(round(sum(work.values())))
        assert work["key:a"] > work["key:b"] > 0
        rt.meter_tenant_work(None)
        theirs.append_audio(CHUNK)
        await theirs.commit()
        await collect_until(theirs, "response.done")
        assert rt.take_tenant_work() == {}
