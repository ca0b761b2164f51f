"""Abrupt disconnects detach; resume replays every missed event once, in order."""

from __future__ import annotations

import base64
import contextlib
import json

import anyio
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from duplex_actors import Script
from duplex_actors.client import DuplexClient, SessionLost
from duplex_actors.core import commands as cmd
from duplex_actors.errors import ResyncRequired
from duplex_actors.server.app import (
    CLOSE_RESUME_CONFLICT,
    CLOSE_RESYNC_REQUIRED,
    CLOSE_SUPERSEDED,
    CLOSE_UNKNOWN_SESSION,
)

from .conftest import CHUNK_100MS, recv_json, recv_until, resume_frame, running_server, user_text

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

SLOW = Script(
    token_latency_s=0.02, tokens=tuple(f"w{i} " for i in range(30)), audio_packets=5, packet_latency_s=0.02
)


async def wait_until(predicate, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.005)


async def test_client_resumes_after_the_socket_dies_mid_response_and_misses_nothing():
    async with running_server(SLOW) as server:
        client = await DuplexClient.connect(server.url, reconnect_backoff_s=0.15)
        async with client:
            events = [await client.recv()]
            await client.send_audio(CHUNK_100MS)
            await client.commit()
            await client.create_response()
            for _ in range(200):
                events.append(await client.recv())
                if events[-1]["type"] == "response.output_audio_transcript.delta":
                    break
            seq_at_drop = client.last_seq
            client.abort_transport()  # no close frame: the server sees an abnormal closure
            async for event in client.events():
                events.append(event)
                if event["type"] == "response.done":
                    break
            await client.heartbeat()  # and the resumed session still takes commands
            events.append((await client.wait_for("heartbeat.ack"))[0])

        types = [e["type"] for e in events]
        seqs = [e["server_event_seq"] for e in events]
        assert seqs == list(range(1, len(seqs) + 1)), "every event exactly once, in order"
        assert client.reconnects == 1 and client.gaps == 0 and client.duplicates_dropped == 0
        assert types.count("session.resumed") == 1 and types.count("response.done") == 1
        resumed = events[types.index("session.resumed")]
        # events were produced while the client was away, and came before session.resumed
        assert resumed["server_event_seq"] > seq_at_drop + 1
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
        assert text == "".join(SLOW.tokens)
        done = events[types.index("response.done")]
        assert done["response"]["status"] == "completed"
        assert server.metrics.resumes.labels("ok")._value.get() == 1
        # the replay was not counted twice
        assert server.metrics.responses.labels("completed")._value.get() == 1


async def test_abrupt_disconnect_detaches_instead_of_closing():
    async with running_server(session_overrides={"disconnect_grace_s": 30.0}) as server:
        ws = await connect(server.url)
        created = await recv_json(ws)
        session_id = created["session"]["id"]
        ws.transport.abort()
        handle = server.runtime.get(session_id)
        await wait_until(lambda: handle.core.lease.detached)
        assert handle.state != "closed" and server.runtime.session_count == 1


async def test_half_written_frame_then_drop_detaches_and_the_session_resumes():
    async with running_server(SLOW) as server:
        ws = await connect(server.url)
        created = await recv_json(ws)
        sid, token = created["session"]["id"], created["resume_token"]
        await ws.send(
            json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(CHUNK_100MS).decode()})
        )
        # A text frame header announcing 256 bytes, then only a few of them, then the drop.
        ws.transport.write(b"\x81\xfe\x01\x00" + b"\x00\x00\x00\x00" + b'{"type": "inp')
        ws.transport.abort()
        handle = server.runtime.get(sid)
        await wait_until(lambda: handle.core.lease.detached)

        async with connect(f"{server.url}?session_id={sid}") as ws2:
            await ws2.send(resume_frame(session_id=sid, generation=0, resume_token=token, last_seq=1))
            resumed = await recv_json(ws2)
            assert resumed["type"] == "session.resumed" and resumed["replayed"] == 0
            await ws2.send(json.dumps({"type": "input_audio_buffer.commit", "event_id": "c"}))
            await ws2.send(json.dumps({"type": "response.create"}))
            events = await recv_until(ws2, "response.done")
            committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
            assert committed["audio_ms"] == 100  # the append accepted before the drop was kept


async def _resume_refusal(server, session_id: str, **resume) -> tuple[dict, int]:
    async with connect(f"{server.url}?session_id={session_id}") as ws:
        await ws.send(json.dumps({"type": "session.resume", "session_id": session_id, **resume}))
        error = await recv_json(ws)
        with pytest.raises(ConnectionClosed):
            with anyio.fail_after(5):
                await ws.recv()
        return error, ws.close_code


async def test_resume_refusals_have_an_error_event_and_a_close_code():
    async with running_server(session_overrides={"journal_max_events": 3}) as server:
        ws = await connect(server.url)
        created = await recv_json(ws)
        sid, token = created["session"]["id"], created["resume_token"]
        for _ in range(6):
            await ws.send(json.dumps({"type": "heartbeat"}))
            await recv_json(ws)
        ws.transport.abort()
        handle = server.runtime.get(sid)
        await wait_until(lambda: handle.core.lease.detached)

        error, code = await _resume_refusal(server, sid, generation=0, resume_token="forged", last_seq=7)
        assert error["error"]["code"] == "resume_conflict" and code == CLOSE_RESUME_CONFLICT
        assert error["server_event_seq"] is None
        error, code = await _resume_refusal(server, sid, generation=5, resume_token=token, last_seq=7)
        assert error["error"]["code"] == "resume_conflict" and code == CLOSE_RESUME_CONFLICT
        error, code = await _resume_refusal(server, sid, generation=0, resume_token=token, last_seq=1)
        assert error["error"]["code"] == "resync_required" and code == CLOSE_RESYNC_REQUIRED
        error, code = await _resume_refusal(server, "sess_nope", generation=0, resume_token=token)
        assert error["error"]["code"] == "unknown_session" and code == CLOSE_UNKNOWN_SESSION
        # The refusals changed nothing: the real client still resumes.
        async with connect(f"{server.url}?session_id={sid}") as ws2:
            await ws2.send(resume_frame(session_id=sid, generation=0, resume_token=token, last_seq=7))
            assert (await recv_json(ws2))["type"] == "session.resumed"


async def test_first_frame_of_a_resuming_connection_must_be_session_resume(server):
    ws = await connect(server.url)
    sid = (await recv_json(ws))["session"]["id"]
    async with connect(f"{server.url}?session_id={sid}") as ws2:
        await ws2.send(json.dumps({"type": "heartbeat", "event_id": "h"}))
        error = await recv_json(ws2)
        assert error["type"] == "error" and error["error"]["event_id"] == "h"
        with pytest.raises(ConnectionClosed):
            with anyio.fail_after(5):
                await ws2.recv()
    # the first connection was never disturbed
    await ws.send(json.dumps({"type": "heartbeat"}))
    assert (await recv_json(ws))["type"] == "heartbeat.ack"
    await ws.close()


async def test_resume_while_the_old_connection_lingers_supersedes_it():
    async with running_server(SLOW) as server:
        old = await connect(server.url)
        created = await recv_json(old)
        sid, token = created["session"]["id"], created["resume_token"]
        await old.send(
            json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(CHUNK_100MS).decode()})
        )
        await old.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await old.send(json.dumps({"type": "response.create"}))
        seen = await recv_until(old, "response.output_audio_transcript.delta")
        last = seen[-1]["server_event_seq"]
        await anyio.sleep(0.15)  # the old connection keeps receiving; this client ignores it
        # The old socket is still open (its drop went unnoticed); the client comes back anyway.
        async with connect(f"{server.url}?session_id={sid}") as new:
            await new.send(resume_frame(session_id=sid, generation=0, resume_token=token, last_seq=last))
            events = await recv_until(new, "response.done")
            seqs = [e["server_event_seq"] for e in events]
            assert seqs == list(range(last + 1, last + 1 + len(seqs)))
            resumed = next(e for e in events if e["type"] == "session.resumed")
            # what the old connection had already sent past `last` came from the journal
            assert resumed["replayed"] >= 1
        with pytest.raises(ConnectionClosed):
            with anyio.fail_after(5):
                while True:
                    await old.recv()
        assert old.close_code == CLOSE_SUPERSEDED


async def test_grace_expiry_ends_the_client_with_session_lost():
    async with running_server(
        session_overrides={"disconnect_grace_s": 0.1}, runtime_kw={"reaper_interval_s": 0.02}
    ) as server:
        client = await DuplexClient.connect(server.url, reconnect_backoff_s=0.5)
        async with client:
            await client.recv()
            client.abort_transport()
            with pytest.raises(SessionLost) as info:
                with anyio.fail_after(10):
                    async for event in client.events():
                        last = event
            assert info.value.close_code == CLOSE_UNKNOWN_SESSION
            assert last["type"] == "error" and last["error"]["code"] == "unknown_session"
        assert server.runtime.session_count == 0


async def test_a_detached_session_is_not_prompted_and_the_quiet_counts_from_the_resume():
    """GA idle_timeout_ms over a socket that drops: no prompt while nobody is attached (it
    would cost the engine and fill the journal for the whole grace), and after the resume the
    prompt comes at least the timeout later."""
    import time

    from .test_server_vad import LoudnessVad

    async with running_server(Script(token_latency_s=0.001), vad_factory=LoudnessVad) as server:
        ws = await connect(server.url)
        created = await recv_json(ws)
        sid, token = created["session"]["id"], created["resume_token"]
        detection = {"type": "server_vad", "idle_timeout_ms": 1000}
        update = {"type": "realtime", "audio": {"input": {"turn_detection": detection}}}
        await ws.send(json.dumps({"type": "session.update", "session": update}))
        await ws.send(json.dumps({"type": "response.create"}))
        seen = await recv_until(ws, "response.done")
        ws.transport.abort()  # gone without a goodbye: the session waits for a resume
        handle = server.runtime.get(sid)
        await wait_until(lambda: handle.core.lease.detached)
        await anyio.sleep(1.6)  # past the timeout and the answer's playback
        assert handle.core.counters.responses == 1 and handle.core.idle_deadline is None
        async with connect(f"{server.url}?session_id={sid}") as ws2:
            last_seq = max(e["server_event_seq"] or 0 for e in seen)
            await ws2.send(resume_frame(session_id=sid, generation=0, resume_token=token, last_seq=last_seq))
            resumed_at = time.monotonic()
            replay = await recv_until(ws2, "session.resumed")
            assert "input_audio_buffer.timeout_triggered" not in [e["type"] for e in replay]
            await recv_until(ws2, "input_audio_buffer.timeout_triggered", timeout=5.0)
            assert time.monotonic() - resumed_at >= 1.0 - 0.05


async def test_a_resuming_connection_that_leaves_before_its_first_frame_is_not_a_failure():
    # Each one logged server.connection_failed with a traceback's worth of text: 2,000 such
    # connections in 2 s made 2,000 error lines.
    from structlog.testing import capture_logs

    async with running_server() as server:
        with capture_logs() as logs:
            for _ in range(5):
                ws = await connect(f"{server.url}?session_id=sess_nope")
                await ws.close()
            await wait_until(lambda: server.metrics.resumes.labels("invalid_event")._value.get() >= 5)
        assert not [e for e in logs if e["event"] == "server.connection_failed"], logs


async def test_a_captured_resume_frame_replayed_later_takes_nothing_over():
    """A hostile probe's steps (2026-12-02): the client resumes with a control_id, adds an
    item on the resumed connection and drops. Whoever captured its resume frame replays it
    (asking for the whole journal, then verbatim): refused both times, nothing replayed to
    them, nothing of theirs written; the client itself resumes with its current credentials."""
    async with running_server(session_overrides={"disconnect_grace_s": 30.0}) as server:
        ws = await connect(server.url)
        created = await recv_json(ws)
        sid, token = created["session"]["id"], created["resume_token"]
        handle = server.runtime.get(sid)
        ws.transport.abort()
        await wait_until(lambda: handle.core.lease.detached)
        captured = dict(session_id=sid, generation=0, resume_token=token, last_seq=1, control_id="resume_abc")
        async with connect(f"{server.url}?session_id={sid}") as ws2:
            await ws2.send(resume_frame(**captured))
            resumed = await recv_json(ws2)
            assert resumed["type"] == "session.resumed"
            create = {"type": "conversation.item.create", "item": user_text("secret-two")}
            await ws2.send(json.dumps(create))
            await recv_until(ws2, "conversation.item.done")
            ws2.transport.abort()
        await wait_until(lambda: handle.core.lease.detached)
        for last_seq in (0, captured["last_seq"]):
            frame = {k: v for k, v in captured.items() if k != "session_id"}
            error, code = await _resume_refusal(server, sid, **{**frame, "last_seq": last_seq})
            assert error["type"] == "error" and error["error"]["code"] == "resume_conflict"
            assert code == CLOSE_RESUME_CONFLICT
        assert handle.core.lease.detached and handle.core.lease.generation == 1
        async with connect(f"{server.url}?session_id={sid}") as ws3:
            await ws3.send(
                resume_frame(session_id=sid, generation=1, resume_token=resumed["resume_token"], last_seq=0)
            )
            replayed = [await recv_json(ws3)]
            while not (replayed[-1]["type"] == "session.resumed" and replayed[-1]["generation"] == 2):
                replayed.append(await recv_json(ws3))
            texts = [json.dumps(e) for e in replayed]
            assert any("secret-two" in t for t in texts)  # the client's own item, for the client


async def test_a_close_queued_when_another_connection_resumes_still_reaches_its_client():
    """A hostile probe's race (7 in 200 runs): connection A sends session.close while B resumes
    with the current token. The close was queued, not yet processed, when the chart was asked
    about B's resume; A was pushed out (4001, no session.closed), then the close was processed
    and B refused: an accepted close with no terminal event. The race is made certain here: the
    close is queued at the very moment the resume is checked."""
    async with running_server() as server:
        a = await connect(server.url)
        created = await recv_json(a)
        sid, token = created["session"]["id"], created["resume_token"]
        queued = []

        def queue_a_close_first(handle, command) -> None:
            if not queued:
                queued.append(True)
                handle.tell(cmd.Close(reason="client_closed"))  # A's session.close, in the mailbox

        with _before_each_resume_check(queue_a_close_first):
            error, code = await _resume_refusal(server, sid, generation=0, resume_token=token, last_seq=1)
        assert queued
        assert error["error"]["code"] == "session_closed" and code == CLOSE_UNKNOWN_SESSION
        events = await recv_until(a, "session.closed")  # A's close got its terminal event
        assert events[-1]["reason"] == "client_closed"
        with pytest.raises(ConnectionClosed):
            with anyio.fail_after(5):
                await a.recv()
        assert a.close_code == 1000


async def test_a_resume_refused_after_the_old_connection_was_held_leaves_it_reading():
    """The old connection stops reading while the resume is decided; a resume refused at that
    point (here: the journal evicted what it asks for meanwhile) gives it back its reading."""
    async with running_server() as server:
        a = await connect(server.url)
        created = await recv_json(a)
        sid, token = created["session"]["id"], created["resume_token"]
        calls = []

        def refuse_the_second_check(handle, command) -> None:
            calls.append(True)
            if len(calls) == 2:
                raise ResyncRequired("the journal moved on meanwhile")

        with _before_each_resume_check(refuse_the_second_check):
            error, code = await _resume_refusal(server, sid, generation=0, resume_token=token, last_seq=1)
        assert len(calls) == 2 and error["error"]["code"] == "resync_required"
        await a.send(json.dumps({"type": "heartbeat"}))
        assert (await recv_until(a, "heartbeat.ack"))[-1]["type"] == "heartbeat.ack"


@contextlib.contextmanager
def _before_each_resume_check(hook):
    """Run ``hook(handle, command)`` before the server asks the chart about each resume."""
    from duplex_actors.actors.session_handle import SessionHandle

    real_check = SessionHandle.check

    def check(handle, command) -> None:
        if command.TRIGGER == "resume":
            hook(handle, command)
        real_check(handle, command)

    SessionHandle.check = check  # type: ignore[method-assign]
    try:
        yield
    finally:
        SessionHandle.check = real_check  # type: ignore[method-assign]


class _RecordingFrontLink:
    """What a worker of ``serve --workers`` reports to its front, applied to a real FrontLedger
    as it comes (the front's view of which responses a session has in flight)."""

    def __init__(self) -> None:
        from duplex_actors.server.front_ledger import FrontLedger

        self.ledger = FrontLedger()
        self.reports: list[tuple[str, str]] = []

    def response_started(self, session_id: str, response_id: str) -> None:
        self.reports.append(("started", response_id))
        self.ledger.response_started(session_id, response_id)

    def response_ended(self, session_id: str, response_id: str) -> None:
        self.reports.append(("ended", response_id))
        self.ledger.response_ended(session_id, response_id)

    def session_ended(self, session_id: str) -> None:
        self.reports.append(("session_ended", session_id))
        self.ledger.session_ended(session_id)


async def test_a_replayed_response_created_does_not_reopen_the_response_at_the_front():
    # serve --workers: a worker reported response.created again when a resume replayed it, and
    # the front's ledger reopened a response that had ended; a worker killed before the replay
    # reached its response.done left the front to send that client a second response.done
    # (worker_lost). The soak that kills both workers in turn counted such a violation once.
    async with running_server(session_overrides={"disconnect_grace_s": 30.0}) as server:
        link = _RecordingFrontLink()
        server.front_link = link  # type: ignore[assignment]
        ws = await connect(server.url)
        created = await recv_json(ws)
        sid, token = created["session"]["id"], created["resume_token"]
        await ws.send(json.dumps({"type": "conversation.item.create", "item": user_text("hello")}))
        await ws.send(json.dumps({"type": "response.create"}))
        done = (await recv_until(ws, "response.done"))[-1]
        rid = done["response"]["id"]
        assert link.reports == [("started", rid), ("ended", rid)]
        handle = server.runtime.get(sid)
        ws.transport.abort()
        await wait_until(lambda: handle.core.lease.detached)
        async with connect(f"{server.url}?session_id={sid}") as ws2:
            # The whole journal again, the response's created and done among it.
            await ws2.send(resume_frame(session_id=sid, generation=0, resume_token=token, last_seq=0))
            replay = await recv_until(ws2, "response.done")
            assert any(e["type"] == "response.created" for e in replay)
        # Never reopened: the front has nothing of this session in flight at any point.
        assert ("started", rid) not in link.reports[2:], link.reports
        assert link.ledger._responses == {}


@pytest.mark.parametrize("leaves", ["drops_and_expires", "closes_mid_response"])
async def test_the_front_hears_of_every_sessions_end_and_keeps_none_of_its_responses(leaves):
    # serve --workers: the worker told the front of a session's end only as it wrote its
    # session.closed. A session that closed with no connection to write it on (expired after
    # its client dropped mid-response), or whose connection ended first (a client closing
    # mid-response), was never reported, and the front kept its responses for good: a few
    # hundred bytes each, growing without bound (a probe through serve --workers 2, 2026-12-07).
    slow = Script(tokens=("a",) * 40, token_latency_s=0.05, audio_packets=0)
    async with running_server(slow, session_overrides={"disconnect_grace_s": 0.3}) as server:
        link = _RecordingFrontLink()
        server.front_link = link  # type: ignore[assignment]
        ws = await connect(server.url)
        sid = (await recv_json(ws))["session"]["id"]
        await ws.send(json.dumps({"type": "response.create"}))
        await recv_until(ws, "response.created")
        assert list(link.ledger._responses) == [sid]
        handle = server.runtime.get(sid)
        if leaves == "drops_and_expires":
            ws.transport.abort()
        else:
            await ws.close()
        await wait_until(
            lambda: handle.state == "closed" and ("session_ended", sid) in link.reports, timeout=10
        )
        assert link.ledger._responses == {}


async def test_the_front_hears_of_a_response_right_before_its_frames_are_written(monkeypatch):
    # serve --workers: the worker told the front of a response.created as it encoded it, then
    # encoded the rest of the burst, then wrote it. A worker killed in between left the front to
    # end, with worker_lost, a response its client never saw start (clean-ci met it). A kill
    # can always land between the report and the write (two sockets); what is kept small is
    # that window: nothing is encoded in it.
    from duplex_actors.server import codec, session_connection, ws_internals

    log: list[str] = []
    encode = codec.encode

    def logged_encode(event, wire):
        log.append("encode")
        return encode(event, wire)

    send_burst = ws_internals.send_burst

    async def logged_send_burst(ws, frames):
        log.append("write")  # send_burst writes before it first waits
        cost = await send_burst(ws, frames)
        await anyio.sleep(0.05)  # a socket slow to drain: the next events pile up meanwhile
        return cost

    monkeypatch.setattr(session_connection.codec, "encode", logged_encode)
    monkeypatch.setattr(session_connection.ws_internals, "send_burst", logged_send_burst)
    answer = Script(tokens=("a", "b"), audio_packets=3, packet_latency_s=0.0)
    async with running_server(answer) as server:
        link = _RecordingFrontLink()
        report = link.response_started
        link.response_started = lambda sid, rid: (log.append("report"), report(sid, rid))  # type: ignore[method-assign]
        server.front_link = link  # type: ignore[assignment]
        async with connect(server.url) as ws:
            await recv_json(ws)  # session.created
            # The session.updated burst is still "draining" when the response starts: the
            # response.created then goes out in a burst with what follows it.
            await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "Be brief."}}))
            await ws.send(json.dumps({"type": "response.create"}))
            await recv_until(ws, "response.done")
    at = log.index("report")
    assert log[at + 1] == "write", log
    # The burst the report went with was encoded before it (more than the created alone).
    assert log[at - 2 : at] == ["encode", "encode"], log


async def test_a_dropped_clients_answer_waits_for_its_resume_and_the_resume_gets_all_of_it():
    # An answer produced as fast as the engine can, for a client that dropped right after
    # asking: the server holds the session's allowance of it, not the whole answer, until the
    # client resumes and takes it; then the rest follows, every packet once, in order.
    limit = 32 << 10
    answer = Script(tokens=(), audio_packets=200, packet_ms=100, packet_latency_s=0.0, fresh_packets=True)
    overrides = {"unsent_audio_bytes": limit, "disconnect_grace_s": 30.0}
    async with running_server(answer, session_overrides=overrides) as server:
        ws = await connect(server.url)
        created = await recv_json(ws)
        sid, token = created["session"]["id"], created["resume_token"]
        await ws.send(json.dumps({"type": "response.create"}))
        last_seq = (await recv_until(ws, "response.created"))[-1]["server_event_seq"]
        ws.transport.abort()

        handle = server.runtime.get(sid)
        await wait_until(lambda: handle.detached and server.runtime.engine.statistics().waiting_for_listeners)
        await anyio.sleep(0.3)
        packet = 24000 * 2 // 10  # 100 ms at the GA default 24 kHz
        assert limit <= handle.unsent_audio_bytes < limit + packet, "the allowance, not the whole answer"
        assert server.runtime.engine.statistics().in_flight == 1

        async with connect(f"{server.url}?session_id={sid}", max_size=None) as ws2:
            await ws2.send(resume_frame(session_id=sid, generation=0, resume_token=token, last_seq=last_seq))
            events = await recv_until(ws2, "response.done", timeout=10)
        seqs = [e["server_event_seq"] for e in events]  # session.resumed among them, numbered too
        assert seqs == list(range(last_seq + 1, last_seq + 1 + len(seqs))), "every event once, in order"
        audio = [e for e in events if e["type"] == "response.output_audio.delta"]
        assert len(audio) == 200 and all(len(base64.b64decode(e["delta"])) == packet for e in audio)
        assert events[-1]["response"]["status"] == "completed"
