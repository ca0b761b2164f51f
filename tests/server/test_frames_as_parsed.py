"""Appends handled as websockets' parser hands them over (session_reader.py, "Frames
handled as they are parsed"), through a real server and socket: the session gets the client's
frames in the order they were sent and loses none, whichever path each frame took, and the
path is really taken."""

from __future__ import annotations

import base64
import contextlib
import json
import random

import anyio
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from duplex_actors.core import commands as cmd
from duplex_actors.core.session import SessionCore
from duplex_actors.server.config import CLOSE_POLICY_VIOLATION
from duplex_actors.server.session_reader import SessionReader

from .conftest import count_offers, recv_json, recv_until, running_server

pytestmark = pytest.mark.anyio

# 16 kHz pcm and no server VAD: each append reaches the session as the client sent it.
AS_SENT = {
    "type": "session.update",
    "session": {
        "type": "realtime",
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": None}},
    },
}


def _script(seed: int, length: int) -> list[tuple[str, int]]:
    """Appends (each with its own audio), clears, commits of at least 100 ms and frames the
    wire refuses, in a random order."""
    rng = random.Random(seed)
    ops: list[tuple[str, int]] = []
    since_commit = refused = 0
    for k in range(length):
        roll = rng.random()
        if roll < 0.08:
            ops.append(("clear", k))
            since_commit = 0
        elif roll < 0.16 and since_commit >= 5:
            ops.append(("commit", k))
            since_commit = 0
        elif roll < 0.19 and refused < 3:  # within the flood budget
            ops.append(("refused", k))
            refused += 1
        else:
            ops.append(("append", k))
            since_commit += 1
    return ops


def _frame(op: str, k: int) -> str:
    if op == "append":
        audio = base64.b64encode(bytes([k % 251, k // 251]) * 320).decode()  # 20 ms, its own
        return json.dumps({"type": "input_audio_buffer.append", "audio": audio, "event_id": f"a{k}"})
    if op == "clear":
        return json.dumps({"type": "input_audio_buffer.clear"})
    if op == "commit":
        return json.dumps({"type": "input_audio_buffer.commit"})
    return '{"type": "input_audio_buffer.append", "audio": '  # not JSON: refused at the wire


def _as_handled(command: cmd.Command) -> tuple[str, int] | None:
    if isinstance(command, cmd.AppendAudio):
        return ("append", command.pcm[0] + 251 * command.pcm[1])
    if isinstance(command, cmd.ClearInput):
        return ("clear", -1)
    if isinstance(command, cmd.CommitInput):
        return ("commit", -1)
    return None


def _record_handled(monkeypatch) -> list[tuple[str, int]]:
    """What the session cores handle, in order, from now on (appends, clears, commits)."""
    handled: list[tuple[str, int]] = []
    handle = SessionCore.handle

    def recording(self, command, *args, **kwargs):
        seen = _as_handled(command)
        if seen is not None:
            handled.append(seen)
        return handle(self, command, *args, **kwargs)

    monkeypatch.setattr(SessionCore, "handle", recording)
    return handled


async def _until_closed(ws):
    with contextlib.suppress(ConnectionClosed):
        async for text in ws:
            yield text


async def _read_all(ws) -> None:
    async for _ in ws:
        pass


@pytest.mark.parametrize("as_parsed", [True, False])
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("paced", [False, True])
async def test_the_session_gets_every_frame_in_the_order_sent_whichever_path_it_took(
    monkeypatch, as_parsed, seed, paced
):
    handled = _record_handled(monkeypatch)
    offers = count_offers(monkeypatch)
    ops = _script(seed, 160)
    rng = random.Random(seed)
    # Paced: the audio budget runs out early, so the reader waits with a frame in hand.
    pacing = {"audio_intake_rate": 4.0, "audio_intake_burst_s": 0.05} if paced else {}
    async with running_server(handle_frames_as_parsed=as_parsed, **pacing) as server:
        async with connect(server.url) as ws:
            await recv_json(ws)
            await ws.send(json.dumps(AS_SENT))
            await recv_until(ws, "session.updated")
            async with anyio.create_task_group() as tg:
                tg.start_soon(_read_all, ws)  # the server's replies, so that the close is quick
                # In bursts: some frames arrive with the reader waiting, some in one read with
                # others, behind a frame left to the reader.
                i = 0
                while i < len(ops):
                    burst = rng.choice([1, 1, 1, 2, 3, 8, 24])
                    for op, k in ops[i : i + burst]:
                        await ws.send(_frame(op, k))
                    i += burst
                    await anyio.sleep(rng.choice([0.0, 0.002, 0.02]))
                want = [(op, k if op == "append" else -1) for op, k in ops if op != "refused"]
                with anyio.fail_after(10):
                    while len(handled) < len(want):
                        await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
            assert handled == want
            if paced:
                assert server.metrics.paced.labels("audio")._value.get() > 0.0
            refused = sum(op == "refused" for op, _ in ops)
            assert server.metrics.frames.labels("rejected")._value.get() == refused
    appends = sum(op == "append" for op, _ in ops)
    if as_parsed:
        # Both paths were taken: appends as parsed, and frames behind one left to the reader.
        assert 0 < offers.taken < appends and offers.left > 0, (offers.taken, offers.left, appends)
    else:
        assert offers.taken == offers.left == 0


async def test_a_microphones_appends_are_handled_as_parsed(monkeypatch):
    # A frame every few ms, each read on its own with the reader waiting: none goes through
    # the read queue but the first, which builds nothing here (no server VAD).
    offers = count_offers(monkeypatch)
    async with running_server() as server:
        async with connect(server.url) as ws:
            created = await recv_json(ws)
            handle = server.runtime.get(created["session"]["id"])
            await ws.send(json.dumps(AS_SENT))
            await recv_until(ws, "session.updated")
            for k in range(40):
                await ws.send(_frame("append", k))
                await anyio.sleep(0.005)
            with anyio.fail_after(5):
                while handle.core.buffered_input_bytes < 40 * 640:
                    await anyio.sleep(0.01)
            assert handle.core.buffered_input_bytes == 40 * 640
    assert offers.taken >= 36, offers.taken  # a busy host may leave the odd one to the reader


@pytest.mark.parametrize("gap_s", [0.002, 0.004])
async def test_appends_a_paced_reader_holds_keep_their_place(monkeypatch, gap_s):
    # Each append owes 5 ms at 4x real time and comes 2-4 ms after the last: the reader often
    # waits out a pace with a frame in hand and the read queue empty, and a frame parsed then
    # must not be handled before the one in hand. The sends keep to a schedule from the first
    # (not a sleep after each), so a slow host's late wake-ups do not add up to more than the
    # 5 ms each frame owes, which would leave the reader never paced.
    handled = _record_handled(monkeypatch)
    async with running_server(audio_intake_rate=4.0, audio_intake_burst_s=0.05) as server:
        async with connect(server.url) as ws:
            await recv_json(ws)
            await ws.send(json.dumps(AS_SENT))
            await recv_until(ws, "session.updated")
            start = anyio.current_time()
            for k in range(60):
                await ws.send(_frame("append", k))
                await anyio.sleep(max(0.0, start + (k + 1) * gap_s - anyio.current_time()))
            with anyio.fail_after(10):
                while len(handled) < 60:
                    await anyio.sleep(0.01)
            assert handled == [("append", k) for k in range(60)]
            assert server.metrics.paced.labels("audio")._value.get() > 0.0


async def test_appends_refused_as_parsed_count_toward_the_flood_budget_and_close_the_connection():
    # Under server VAD the chart's checks run before the VAD hears an append, so an append
    # into a full input buffer is refused as it is parsed. A client streaming speech that never
    # ends into a 1 s buffer has every append refused past it: the budget (5 at once) runs out
    # on the path that cannot close a connection, and the reader then closes it.
    from .test_server_vad import LoudnessVad, tone

    refused_as_parsed = 0
    offer = SessionReader.offer

    def counted(self, frame):
        nonlocal refused_as_parsed
        rejected = self.server.metrics.frames.labels("rejected")._value.get
        before = rejected()
        took = offer(self, frame)
        refused_as_parsed += took and rejected() > before
        return took

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(SessionReader, "offer", counted)
        async with running_server(
            vad_factory=LoudnessVad,
            session_overrides={"max_input_bytes": 16000 * 2},
            invalid_frames_burst=5,
            invalid_frames_per_s=0.5,
        ) as server:
            async with connect(server.url) as ws:
                await recv_json(ws)
                detection = {"type": "server_vad", "create_response": False}
                format_16k = {"type": "audio/pcm", "rate": 16000}
                update = {"audio": {"input": {"format": format_16k, "turn_detection": detection}}}
                await ws.send(json.dumps({"type": "session.update", "session": update}))
                await recv_until(ws, "session.updated")
                loud = base64.b64encode(tone(20, 8000)).decode()
                with anyio.fail_after(10):
                    with contextlib.suppress(ConnectionClosed):  # the server closes midway
                        for _ in range(150):  # 3 s of speech in 20 ms appends
                            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": loud}))
                            await anyio.sleep(0.012)  # the last one's VAD batch is scored
                    # what the server sent before it closed is still there to read
                    events = [json.loads(text) async for text in _until_closed(ws)]
                errors = [e for e in events if e["type"] == "error"]
                closed = next((e for e in events if e["type"] == "session.closed"), None)
                assert ws.close_code == CLOSE_POLICY_VIOLATION
                # Valid appends, refused for room: the client streamed on through its
                # input_backpressure errors, which the reason says (invalid_frame_flood before).
                assert closed is not None and closed["reason"] == "backpressure_flood"
                assert ws.close_reason == "too many frames sent after input_backpressure"
                assert all(e["error"]["code"] == "input_backpressure" for e in errors), errors
                # Five refusals within the budget, the sixth put it over and no frame after it
                # was read (its error may be overtaken by the close).
                assert server.metrics.frames.labels("rejected")._value.get() == 6
                assert 5 <= len(errors) <= 6, len(errors)
            assert server.metrics.disconnects.labels("flood")._value.get() == 1
    assert refused_as_parsed >= 1
