"""One client floods the server: what it costs a neighbour (and, for invalid frames, memory).

``python -m duplex_actors.bench.flood_bench [--frames 100000] [--policy on|off]`` runs an
in-process server (scripted engine paced like ``serve``'s), times a neighbour's turn with no
flood (the baseline, same run), starts a raw-socket client that sends ``--frames`` invalid
text frames with a 4 KiB receive buffer it never reads, times the neighbour's turn again
during the flood, and reports the server process's RSS before and after. ``--policy off``
sets a flood budget no client reaches, to measure the error bounds on their own.

``--audio [--seconds 6] [--policy on|off]`` floods *valid* audio instead: 100 ms frames of
24 kHz noise, sent as fast as the socket takes them, through the default server VAD (Silero).
The neighbour's turns before the flood are the baseline; its turns during the flood are
compared with them (median and worst), and the flooder's accepted audio is reported as a
multiple of real time. ``--policy off`` turns audio pacing off (``audio_intake_rate=None``).

``--audio --sessions N [--seconds 6]`` floods valid audio from N sessions of one API key at
once, each as fast as its own pacers allow (the per-session budgets multiply with sessions);
the neighbour has another key. ``--policy off`` turns off the loop's sharing by client
(``loop_share_s_per_s=None``) and nothing else.

``--updates`` floods valid ~1 MB ``session.update`` frames the same way. Three floods ask for
large replies with small frames: ``--echoes`` (a 40-byte ``session.update`` after ~1 MB of tools
were declared: each echoes them all), ``--retrieves`` (a ``conversation.item.retrieve`` of an
item of 65,536 emoji, 256 KB) and ``--resumes`` (a reconnect and ``session.resume`` naming an
old ``last_seq``, which replays ~3 MB of journal, in a loop). ``--policy off`` turns frame pacing
off too.

``--pings`` sends 125-byte pings as fast as the socket takes them and never reads the pongs
(websockets answers pings itself, outside the frame budget); ``--fragments`` sends 10 ms appends
cut into 1-byte fragments (parsing costs per frame, which the byte and audio budgets do not see).
``--policy off`` turns the connection's frame-count and control-frame pacing off. The server's peak RSS during the flood is reported with every valid flood.

``--held-text N [--addresses 8] [--text-budget-mb 1024] [--item-parts K]`` is about memory too: N
sessions from that many client addresses each set the most text a session keeps (instructions,
tools, a full conversation of emoji, each item in K parts), every message compressed to a few
hundred bytes; it reports what the
sessions and their journals hold and the server's RSS. ``--policy off`` runs without the
runtime's text budget.

``--held-audio N [--addresses 8] [--audio-budget-mb 1024] [--transcribed] [--responding]
[--model-native]`` fills every session's input audio with G.711 (``--transcribed``: loud noise
with transcription on; ``--responding``: each session also asks for a response, whose engine
request carries the committed turn; ``--model-native``: each second leaves as a unit the engine
holds undecided); ``--held-responses N`` asks for responses with large texts of their own;
``--large-messages N [--messages K]`` sends refused messages of ~1 MB compressed to ~1 KB;
``--unread-audio N`` asks for a minute of speech and drops the connection. Each reports what the
server holds (``--policy off``: without the budget, or the allowance, in question).

``--journals N [--journal-budget-mb 1024]`` is about memory, not a neighbour: one client opens N
sessions and fills each one's replay journal with distinct long items; it reports what the
journals hold and the server's RSS. ``--policy off`` runs without the runtime's journal budget.

``--churn [--connections 8]`` opens and closes sessions as fast as it can from that many
connections at once, with its own API key (the neighbour has another). ``--policy on`` sets a
connect rate on the flooder's key (``--connect-rate``, 20 a second after a burst of 20), so its
handshakes past it are answered 429; ``off`` sets none (the server's default).

``--commits`` appends 1 s of audio and commits it, again and again, never asking for a response
(a GA commit starts none, so the committed audio waits for one: ``max_committed_bytes``).

``--transcripts`` commits 1 s turns of loud noise with input transcription on, as fast as audio
pacing lets it; the neighbour's figure is then the time from its own transcribed commit to its
transcript (the server runs the real recogniser, PocketSphinx).

``--responses N [--seconds 6]`` runs ``serve``'s engine (the embedded thinker and Piper): one
client with its own API key opens N sessions, each asking for a response (text in, speech out)
again as soon as the last is done; the neighbour, with another key, times its first audio and
its whole response, alone and during the flood. The synthesiser's threads and the thinker's
slots are what they compete for. ``--engine scripted`` answers with the scripted engine
instead: what is left to compete for is the event loop (the runtime's and the server's own work
for each response); ``--policy off`` turns the loop's sharing by client off. ``--cancel-after
SECONDS`` has the flooder cancel each response that long after asking for it (create-and-cancel
churn: each response's start, then its end, over and over). ``--how`` says how the flooder
asks: ``items`` (the default: a user item and a response.create on open sessions),
``one-frame`` (the response.create alone), ``reconnect`` (a connection for each response, read
to its end, then closed) or ``drop`` (a connection for each response, dropped as soon as it
has asked: the session detaches and its response goes on).

``--long-turn SECONDS`` commits one turn of that many seconds of loud noise with transcription
on (uploaded with pacing off: what is measured is the recogniser's sharing), then measures the
neighbour's 1 s transcribed turns, one after another, until the long turn's transcript is in.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, TypeVar

from ..server import event_loop
from ..server.event_loop import EventLoopChoice
from .soak import rss_mb

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

    from ..actors.runtime import Runtime
    from ..engines.base import EngineBackend
    from ..engines.scripted import Script

    #: A valid flooder's reports: its session's id once connected, then (sent, bytes received).
    _FloodReport = Connection[str | tuple[int, int], Any]

_T = TypeVar("_T")


async def _turn(url: str, headers: dict[str, str] | None = None, source: str | None = None) -> float:
    """One GA turn on a new connection (``source``: the local address to connect from)."""
    from websockets.asyncio.client import connect

    async with connect(url, additional_headers=headers, local_addr=(source, 0) if source else None) as ws:
        await ws.recv()
        began = time.perf_counter()
        # A GA turn: 100 ms at the 24 kHz wire rate, commit, then ask for the response (a
        # commit alone creates none, and quiet audio never makes server VAD create one).
        await ws.send(
            json.dumps(
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x01\x00" * 2400).decode()}
            )
        )
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))
        while json.loads(await ws.recv())["type"] != "response.done":
            pass
        return time.perf_counter() - began


TRANSCRIBED = json.dumps(
    {
        "type": "session.update",
        "session": {
            "type": "realtime",
            "audio": {"input": {"turn_detection": None, "transcription": {"model": "whisper-1"}}},
        },
    }
)


def _loud_noise(seconds: float) -> str:
    """An append of loud 24 kHz gaussian noise: the costliest input for the recogniser we
    found (it decodes longer than full-scale uniform noise or silence)."""
    import numpy as np

    noise = np.random.default_rng().normal(0.0, 3000.0, int(24000 * seconds)).astype("<i2").tobytes()
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(noise).decode()})


async def _transcribed_turn(url: str) -> float:
    """One second of noise, committed with input transcription on: seconds to its transcript."""
    from websockets.asyncio.client import connect

    async with connect(url) as ws:
        await ws.recv()
        await ws.send(TRANSCRIBED)
        while json.loads(await ws.recv())["type"] != "session.updated":
            pass
        began = time.perf_counter()
        await ws.send(_loud_noise(1.0))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        while True:
            event = json.loads(await ws.recv())
            if event["type"] == "conversation.item.input_audio_transcription.completed":
                return time.perf_counter() - began
            if event["type"] == "conversation.item.input_audio_transcription.failed":
                raise RuntimeError(f"the neighbour's transcription failed: {event['error']['message']}")


async def _run(frames: int, policy: bool) -> dict[str, Any]:
    from ..actors.runtime import Runtime
    from ..engines.scripted import Script, ScriptedEngine
    from ..server.app import RealtimeServer, ServerConfig
    from ..testing.raw_websocket import RawWebSocket

    budget: dict[str, Any] = (
        {} if policy else {"invalid_frames_per_s": 1e9, "invalid_frames_burst": 10**9, "frames_per_s": None}
    )
    script = Script(
        tokens=tuple(f" w{i}" for i in range(24)),
        audio_packets=12,
        token_latency_s=0.02,
        packet_latency_s=0.02,
    )
    async with Runtime(ScriptedEngine(script, record=False)) as rt:
        async with RealtimeServer(rt, ServerConfig(port=0, **budget)) as server:
            baseline = await _turn(server.url)
            rss_before = rss_mb()
            flooder = await RawWebSocket.connect(server.url, rcvbuf=4096)

            async def flood() -> None:
                try:
                    for i in range(frames):
                        flooder.send_text("x" * 200)
                        if i % 200 == 0:
                            await flooder.drain()
                except OSError:
                    pass  # the flood policy closed it

            task = asyncio.create_task(flood())
            await asyncio.sleep(0.5)
            during = await _turn(server.url)
            await asyncio.wait_for(task, 300)
            await asyncio.sleep(2)
            report = {
                "frames": frames,
                "policy": policy,
                "neighbour_turn_s": baseline,
                "neighbour_turn_during_flood_s": during,
                "rss_before_mb": rss_before,
                "rss_after_mb": rss_mb(),
            }
            flooder.abort()
            return report


CLEAR = json.dumps({"type": "input_audio_buffer.clear"})
CREATE = json.dumps({"type": "response.create"})


def _update_frame() -> str:
    """A valid session.update of ~0.96 MB: 15 function tools with long descriptions and long
    instructions (each string within the wire's 65,536-character limit)."""
    tools = [
        {
            "type": "function",
            "name": f"tool_{i}",
            "description": "d" * 60_000,
            "parameters": {"type": "object"},
        }
        for i in range(15)
    ]
    return json.dumps(
        {
            "type": "session.update",
            "session": {"type": "realtime", "tools": tools, "instructions": "i" * 60_000},
        }
    )


def _audio_frame(frame_ms: int) -> str:
    """``frame_ms`` of low-level 24 kHz noise: the VAD hears every window of it, and no turn
    starts."""
    noise = bytes(b & 0x0F if i % 2 == 0 else 0 for i, b in enumerate(os.urandom(2 * 24 * frame_ms)))
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(noise).decode()})


#: The valid floods, by option: what each one sends.
VALID_FLOODS = {
    "audio": "valid audio",
    "updates": "valid ~1 MB session.update frames",
    "echoes": "40-byte session.updates, each echoing ~1 MB of tools",
    "retrieves": "retrieves of a 65,536-emoji item",
    "resumes": "resumes replaying ~3 MB of journal",
    "transcripts": "commits of loud noise with input transcription on",
    "commits": "1 s appends, each committed, never asking for a response",
    "pings": "125-byte pings, never reading the pongs",
    "fragments": "10 ms appends cut into 1-byte fragments (~690 frames each)",
    "values": "heartbeats padded with 9,990 empty JSON arrays (~40 KB, 19,983 values: under max_json_values)",
}

LONG_ITEM = json.dumps(
    {
        "type": "conversation.item.create",
        "item": {
            "id": "long",
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "\U0001f600" * 65_536}],
        },
    }
)


#: A flood asking for replies keeps this many unanswered: a careful flooder, which never
#: fills its session's mailbox (the flood policy would close it for the refusals).
REPLY_WINDOW = 8


def _setup_and_frames(kind: str, frame_ms: int) -> tuple[list[str], tuple[str, ...], str | None]:
    """What the flooder sends once, the frames it repeats, and the reply each round gets
    (None: it sends without waiting for any)."""
    if kind == "audio":
        return [], (_audio_frame(frame_ms),), None
    if kind == "updates":
        return [], (_update_frame(),), None
    if kind == "echoes":
        small = json.dumps({"type": "session.update", "session": {"type": "realtime"}})
        return [_update_frame()], (small,), "session.updated"
    if kind == "retrieves":
        retrieve = json.dumps({"type": "conversation.item.retrieve", "item_id": "long"})
        return [LONG_ITEM], (retrieve,), "conversation.item.retrieved"
    if kind == "values":  # costs the server per value, not per byte
        return [], (json.dumps({"type": "heartbeat", "pad": [[]] * 9_990}),), "heartbeat.ack"
    commit = json.dumps({"type": "input_audio_buffer.commit"})
    if kind == "transcripts":
        return [TRANSCRIBED], (_loud_noise(frame_ms / 1000), commit), None
    if kind == "commits":  # a GA commit starts no response: the committed audio waits
        manual = {
            "type": "session.update",
            "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}},
        }
        return [json.dumps(manual)], (_audio_frame(frame_ms), commit), None
    raise ValueError(kind)


def _valid_flooder(url: str, seconds: float, kind: str, frame_ms: int, report: _FloodReport) -> None:
    """The flooding client (``kind``: one of VALID_FLOODS),
    in its own process as a hostile client would be: in the server's process its sends would
    take that loop itself (a websocket send only yields once the socket's buffers are full, and
    loopback's hold megabytes)."""

    async def main() -> int:
        from websockets.asyncio.client import connect

        if kind == "resumes":
            return await _resume_in_a_loop(url, seconds, report)
        if kind == "pings":
            return await _ping_flat_out(url, seconds, report)
        if kind == "fragments":
            return await _fragments_flat_out(url, seconds, report)
        audio = kind == "audio"
        setup, frames, reply = _setup_and_frames(kind, frame_ms)
        unanswered = asyncio.Semaphore(REPLY_WINDOW)
        clear_every = max(1, 5000 // frame_ms)  # 5 s of audio: within the input buffer's limit
        sent = received = 0
        ws = await connect(url, max_size=None)
        session_id = json.loads(await ws.recv())["session"]["id"]
        for first in setup:
            await ws.send(first)
        if reply == "session.updated":  # the setup's own echo is not one of the flood's
            while json.loads(await ws.recv())["type"] != reply:
                pass

        async def drain() -> None:
            nonlocal received
            async for message in ws:
                received += len(message)
                if reply is not None and json.loads(message)["type"] == reply:
                    unanswered.release()

        reader = asyncio.create_task(drain())
        report.send(session_id)
        until = time.perf_counter() + seconds
        try:
            while time.perf_counter() < until:
                # A send blocks while the server holds its reads back: the flood ends on time
                # all the same (the send cut short is never counted; the socket is aborted).
                if reply is not None:
                    await asyncio.wait_for(unanswered.acquire(), max(0.0, until - time.perf_counter()))
                for frame in frames:
                    await asyncio.wait_for(ws.send(frame), max(0.0, until - time.perf_counter()))
                sent += 1
                if audio and sent % clear_every == 0:
                    await asyncio.wait_for(ws.send(CLEAR), max(0.0, until - time.perf_counter()))
        except TimeoutError:
            pass
        report.send((sent, received))
        # Gone without a close handshake: a close frame would wait behind everything the
        # server has not read yet (with pacing on, that is minutes of audio).
        reader.cancel()
        ws.transport.abort()
        return sent

    asyncio.run(main())


async def _resume_in_a_loop(url: str, seconds: float, report: _FloodReport) -> int:
    """Fill the replay journal with long items, then reconnect and resume naming an early
    ``last_seq`` in a loop: each resume replays every event after it (~3 MB here)."""
    from websockets.asyncio.client import connect

    ws = await connect(url, max_size=None)
    created = json.loads(await ws.recv())
    session_id, token, generation = created["session"]["id"], created["resume_token"], 0
    for _ in range(8):
        await ws.send(LONG_ITEM.replace('"long"', "null"))  # a fresh id each
    seqs: list[int] = []
    while len(seqs) < 16:  # each item's added and done
        event = json.loads(await ws.recv())
        if event["type"].startswith("conversation.item."):
            seqs.append(event["server_event_seq"])
    ws.transport.abort()
    last_seq = seqs[4] - 1  # replay the last 6 items
    report.send(session_id)
    resumes = received = 0
    until = time.perf_counter() + seconds
    try:
        while time.perf_counter() < until:
            await asyncio.sleep(0.05)  # the server sees the drop and detaches the session
            async with asyncio.timeout(max(0.01, until - time.perf_counter())):
                ws = await connect(f"{url}?session_id={session_id}", max_size=None)
                resume = {
                    "type": "session.resume",
                    "session_id": session_id,
                    "generation": generation,
                    "resume_token": token,
                    "last_seq": last_seq,
                    "control_id": f"resume_{resumes}",
                }
                await ws.send(json.dumps(resume))
                while True:  # replayed session.resumed events have older generations
                    message = await ws.recv()
                    received += len(message)
                    event = json.loads(message)
                    if event["type"] == "session.resumed" and event["generation"] > generation:
                        generation, token = event["generation"], event["resume_token"]
                        break
                ws.transport.abort()
            resumes += 1
    except TimeoutError:
        pass
    report.send((resumes, received))
    return resumes


async def _ping_flat_out(url: str, seconds: float, report: _FloodReport) -> int:
    """Send pings as fast as the socket takes them, on a 4 KiB receive buffer never read: each
    one the server reads, it answers with a pong that waits in its write buffer."""
    from ..testing.raw_websocket import RawWebSocket

    ws = await RawWebSocket.connect(url, rcvbuf=4096)
    _, created = await ws.read_frame()
    report.send(json.loads(created)["session"]["id"])
    sent = 0
    until = time.perf_counter() + seconds
    try:
        while time.perf_counter() < until:
            for _ in range(200):
                ws.send_frame(b"p" * 125, opcode=0x9)
            sent += 200
            async with asyncio.timeout(max(0.01, until - time.perf_counter())):
                await ws.drain()  # blocks once the server stops reading
    except (TimeoutError, OSError):
        pass
    report.send((sent, 0))
    ws.abort()
    return sent


async def _fragments_flat_out(url: str, seconds: float, report: _FloodReport) -> int:
    """Send 10 ms appends of silence, each cut into 1-byte fragments, as fast as the socket
    takes them (a clear after every 5 s of audio, within the input buffer's limit)."""
    from ..testing.raw_websocket import RawWebSocket, fragmented

    append = json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(480)).decode()})
    batch = fragmented(append) * 100
    ws = await RawWebSocket.connect(url)
    _, created = await ws.read_frame()
    report.send(json.loads(created)["session"]["id"])

    async def discard_replies() -> None:
        with contextlib.suppress(Exception):
            while True:
                await ws.read_frame(timeout=3600)

    reader = asyncio.create_task(discard_replies())
    sent = 0
    until = time.perf_counter() + seconds
    try:
        while time.perf_counter() < until:
            ws.writer.write(batch)
            sent += 100
            if sent % 500 == 0:
                ws.writer.write(fragmented(CLEAR))
            async with asyncio.timeout(max(0.01, until - time.perf_counter())):
                await ws.drain()
    except (TimeoutError, OSError):
        pass
    report.send((sent, 0))
    reader.cancel()
    ws.abort()
    return sent


async def _flooder_says(pipe: Connection[Any, Any], flooder: BaseProcess) -> None:
    """Wait for the flooder's next report; a flooder that died without one (the server closed
    it, say 1009 for a frame over its cap) fails the run instead of hanging it."""
    while not pipe.poll():
        if not flooder.is_alive() and not pipe.poll():
            raise RuntimeError(
                f"the flooder exited ({flooder.exitcode}) without reporting: see its traceback above"
            )
        await asyncio.sleep(0.01)


async def _run_valid(
    kind: str, seconds: float, policy: bool, frame_ms: int = 100, turns: int = 5
) -> dict[str, Any]:
    import multiprocessing
    import statistics

    from ..actors.runtime import Runtime
    from ..engines.scripted import ScriptedEngine
    from ..server.app import RealtimeServer, ServerConfig

    pacing: dict[str, Any] = (
        {}
        if policy
        else {
            "audio_intake_rate": None,
            "frame_intake_bytes_per_s": None,
            "frames_per_s": None,
            "control_frames_per_s": None,
            "frame_handling_s_per_s": None,
        }
    )
    script = _flood_script()
    transcriber = None
    turn: Callable[[str], Awaitable[float]] = _turn
    if kind == "transcripts":
        from ..audio.transcription import default_transcriber

        transcriber, turn = default_transcriber(), _transcribed_turn
    async with Runtime(ScriptedEngine(script, record=False), transcriber=transcriber) as rt:
        async with RealtimeServer(rt, ServerConfig(port=0, **pacing)) as server:
            await turn(server.url)  # warm-up (VAD model, first response, the recogniser's model)
            baseline = [await turn(server.url) for _ in range(turns)]
            rss_before = rss_mb()
            ctx = multiprocessing.get_context("spawn")
            ours, theirs = ctx.Pipe()
            flooder = ctx.Process(
                target=_valid_flooder, args=(server.url, seconds, kind, frame_ms, theirs), daemon=True
            )
            flooder.start()
            await _flooder_says(ours, flooder)
            flooding = server.runtime.get(ours.recv())  # connected: the flood starts now
            began = time.perf_counter()
            during = []
            rss_peak = rss_before
            while flooder.is_alive() and not ours.poll():
                during.append(await turn(server.url))
                rss_peak = max(rss_peak, rss_mb())
            await _flooder_says(ours, flooder)
            sent, received = ours.recv()
            elapsed = time.perf_counter() - began
            accepted_s = flooding.core.received_audio_ms / 1000
            rss_flooded = rss_mb()  # the flooder's unread frames are still queued here
            flooder.join(10)
            frames = server.metrics.frames
            return {
                "policy": policy,
                "seconds": elapsed,
                "rejected_frames": frames.labels("rejected")._value.get(),
                "paced_s": sum(
                    server.metrics.paced.labels(w)._value.get()
                    for w in ("audio", "frames", "frame_count", "control")
                ),
                "flooder_sent_x_real_time": sent * frame_ms / 1000 / elapsed,
                "frames_sent": sent,
                "received_mb_per_s": received / 1e6 / elapsed,
                "accepted_x_real_time": accepted_s / elapsed,
                "neighbour_turn_s": statistics.median(baseline),
                "neighbour_turn_worst_s": max(baseline),
                "during_turn_s": statistics.median(during),
                "during_turn_worst_s": max(during),
                "during_turns": len(during),
                "rss_before_mb": rss_before,
                "rss_flooded_mb": rss_flooded,
                "rss_peak_mb": rss_peak,
            }


async def _run_long_turn(turn_s: float, turns: int = 3) -> dict[str, Any]:
    import statistics

    from websockets.asyncio.client import connect

    from ..actors.runtime import Runtime
    from ..audio.transcription import default_transcriber
    from ..engines.scripted import ScriptedEngine
    from ..server.app import RealtimeServer, ServerConfig

    transcriber = default_transcriber()
    if transcriber is None:
        raise SystemExit("--long-turn needs the recogniser (extra 'transcription')")
    unpaced: dict[str, Any] = {
        "audio_intake_rate": None,
        "frame_handling_s_per_s": None,
        "frame_intake_bytes_per_s": None,
    }
    async with Runtime(ScriptedEngine(record=False), transcriber=transcriber) as rt:
        async with RealtimeServer(rt, ServerConfig(port=0, **unpaced)) as server:
            await _transcribed_turn(server.url)  # warm-up: the recogniser's worker and model
            baseline = [await _transcribed_turn(server.url) for _ in range(turns)]
            async with connect(server.url, max_size=None) as talker:
                await talker.recv()
                await talker.send(TRANSCRIBED)
                while json.loads(await talker.recv())["type"] != "session.updated":
                    pass
                for _ in range(int(turn_s / 2)):
                    await talker.send(_loud_noise(2.0))
                await talker.send(json.dumps({"type": "input_audio_buffer.commit"}))
                began = time.perf_counter()
                heard = asyncio.Event()

                async def wait_for_transcript() -> None:
                    async for message in talker:
                        kind = json.loads(message)["type"]
                        if kind.startswith("conversation.item.input_audio_transcription.") and kind.endswith(
                            ("completed", "failed")
                        ):
                            heard.set()
                            return

                waiter = asyncio.create_task(wait_for_transcript())
                during = []
                while not heard.is_set():
                    during.append(await _transcribed_turn(server.url))
                long_turn_took = time.perf_counter() - began
                await waiter
    return {
        "turn_s": 2 * int(turn_s / 2),
        "neighbour_alone_s": statistics.median(baseline),
        "during_median_s": statistics.median(during),
        "during_worst_s": max(during),
        "during_turns": len(during),
        "long_turn_took_s": long_turn_took,
    }


CHURN_KEYS = ("flood-key", "neighbour-key")


def _flood_script() -> Script:
    """The scripted engine's response in the floods: 24 tokens 2 ms apart, 12 audio packets."""
    from ..engines.scripted import Script

    return Script(tokens=tuple(f" w{i}" for i in range(24)), audio_packets=12, token_latency_s=0.002)


ASK_FOR_SPEECH = (
    json.dumps(
        {
            "type": "conversation.item.create",
            "item": {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Tell me about the mountains today."}],
            },
        }
    ),
    json.dumps({"type": "response.create"}),
)


async def _spoken_response(url: str, headers: dict[str, str]) -> tuple[float, float]:
    """A text turn answered with speech: seconds to its first audio and to response.done."""
    from websockets.asyncio.client import connect

    async with connect(url, additional_headers=headers, max_size=None) as ws:
        await ws.recv()
        began = time.perf_counter()
        first = None
        for frame in ASK_FOR_SPEECH:
            await ws.send(frame)
        while True:
            kind = json.loads(await ws.recv())["type"]
            if kind == "response.output_audio.delta" and first is None:
                first = time.perf_counter() - began
            elif kind == "response.done":
                done = time.perf_counter() - began
                return (done if first is None else first), done


#: How the response flooder asks (``--how``): on ``sessions`` open sessions, with an item and a
#: response.create, or with the response.create alone; or ``sessions`` loops each opening a
#: connection for every response, reading it to its end and closing (``reconnect``), or
#: dropping the connection as soon as it has asked (``drop``: the session detaches and its
#: response goes on for a resume nobody makes).
FLOOD_HOW = ("items", "one-frame", "reconnect", "drop")


def _response_flooder(
    url: str,
    sessions: int,
    seconds: float,
    cancel_after: float | None,
    how: str,
    report: Connection[int, Any],
) -> None:
    """``sessions`` sessions of one key, each asking for the next response as soon as the last
    is done, for ``seconds``, as ``how`` says (FLOOD_HOW); reports how many responses were
    asked for. With ``cancel_after``, each response is cancelled that many seconds after it was
    asked for."""

    async def main() -> None:
        from websockets.asyncio.client import connect

        headers = {"Authorization": f"Bearer {CHURN_KEYS[0]}"}
        until = time.perf_counter() + seconds
        done = 0

        async def one() -> None:
            nonlocal done
            if how in ("reconnect", "drop"):
                while time.perf_counter() < until:
                    ws = await connect(url, additional_headers=headers, max_size=None)
                    await ws.recv()
                    await ws.send(CREATE)
                    done += 1
                    if how == "drop":
                        ws.transport.close()  # FIN after the frame, no close handshake
                        continue
                    while json.loads(await ws.recv())["type"] != "response.done":
                        pass
                    await ws.close()
                return
            async with connect(url, additional_headers=headers, max_size=None) as ws:
                await ws.recv()
                while time.perf_counter() < until:
                    for frame in ASK_FOR_SPEECH if how == "items" else (CREATE,):
                        await ws.send(frame)
                    if cancel_after is None:
                        while json.loads(await ws.recv())["type"] != "response.done":
                            pass
                    else:
                        await _cancel_after(ws, cancel_after)
                    done += 1

        await asyncio.gather(*(one() for _ in range(sessions)))
        report.send(done)

    asyncio.run(main())


async def _cancel_after(ws: ClientConnection, seconds: float) -> None:
    """Read a response's events; ``seconds`` after it was asked for, cancel it (unless it was
    done by then); return at its response.done."""
    deadline = time.perf_counter() + seconds
    while True:
        try:
            frame = await asyncio.wait_for(ws.recv(), max(0.0, deadline - time.perf_counter()))
        except TimeoutError:
            await ws.send(json.dumps({"type": "response.cancel"}))
            deadline = math.inf
            continue
        if json.loads(frame)["type"] == "response.done":
            return


def _audio_sessions_flooder(url: str, sessions: int, seconds: float, report: Connection[int, Any]) -> None:
    """``sessions`` sessions of one key, each sending 100 ms appends as fast as the server
    reads them, for ``seconds``; reports the frames sent."""

    async def main() -> None:
        from websockets.asyncio.client import connect

        frame = _audio_frame(100)
        until = time.perf_counter() + seconds
        sent = 0

        async def one() -> None:
            nonlocal sent
            ws = await connect(url, additional_headers={"Authorization": f"Bearer {CHURN_KEYS[0]}"})
            await ws.recv()

            async def drain() -> None:
                async for _ in ws:
                    pass

            reader = asyncio.create_task(drain())
            try:
                while time.perf_counter() < until:
                    await asyncio.wait_for(ws.send(frame), max(0.0, until - time.perf_counter()))
                    sent += 1
                    if sent % 50 == 0:  # 5 s of audio: within the input buffer's limit
                        await asyncio.wait_for(ws.send(CLEAR), max(0.0, until - time.perf_counter()))
            except TimeoutError:
                pass
            reader.cancel()
            ws.transport.abort()  # what the server has not read is dropped with the socket

        await asyncio.gather(*(one() for _ in range(sessions)))
        report.send(sent)

    asyncio.run(main())


async def _during_flood(
    rt: Runtime,
    target: Callable[..., None],
    args: tuple[object, ...],
    sessions: int,
    measure: Callable[[], Awaitable[_T]],
    on_start: Callable[[], Any] | None = None,
) -> tuple[list[_T], Any, Any, float]:
    """Run the flooder ``target(*args, pipe)`` in its own process; once its ``sessions`` are
    open, call ``on_start()`` (if given), then ``measure()`` again and again until the flooder
    reports. Returns the measurements, its report, ``on_start``'s result and the seconds from
    the start to the report."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    flooder = ctx.Process(target=target, args=(*args, theirs), daemon=True)
    flooder.start()
    while rt.session_count < sessions and flooder.is_alive():
        await asyncio.sleep(0.01)
    began = time.perf_counter()
    started = on_start() if on_start is not None else None
    during = []
    while flooder.is_alive() and not ours.poll():
        during.append(await measure())
    report = ours.recv()
    elapsed = time.perf_counter() - began
    flooder.join(10)
    return during, report, started, elapsed


async def _run_audio_sessions(sessions: int, seconds: float, shared: bool, turns: int = 5) -> dict[str, Any]:
    import statistics

    from ..actors.runtime import Runtime
    from ..engines.scripted import ScriptedEngine
    from ..server.app import RealtimeServer, ServerConfig

    neighbour = {"Authorization": f"Bearer {CHURN_KEYS[1]}"}
    unshared: dict[str, Any] = {} if shared else {"loop_share_s_per_s": None}
    config = ServerConfig(port=0, api_keys=CHURN_KEYS, **unshared)
    async with Runtime(ScriptedEngine(_flood_script(), record=False)) as rt:
        async with RealtimeServer(rt, config) as server:
            await _turn(server.url, neighbour)  # warm-up (VAD model, first response)
            alone = [await _turn(server.url, neighbour) for _ in range(turns)]

            def heard_ms() -> float:
                return sum(h.core.received_audio_ms for h in rt.sessions())

            during, _, heard_before, elapsed = await _during_flood(
                rt,
                _audio_sessions_flooder,
                (server.url, sessions, seconds),
                sessions,
                lambda: _turn(server.url, neighbour),
                heard_ms,
            )
            heard = heard_ms() - heard_before
            during.sort()
            return {
                "sessions": sessions,
                "shared": shared,
                "alone_s": statistics.median(alone),
                "during_s": statistics.median(during),
                "during_p90_s": during[math.ceil(0.9 * len(during)) - 1],
                "during_worst_s": during[-1],
                "during_turns": len(during),
                "accepted_x_real_time": heard / 1000 / elapsed,
                "held_s": server.metrics.paced.labels("client_share")._value.get(),
            }


async def _run_responses(
    sessions: int,
    seconds: float,
    engine: str = "embedded",
    shared: bool = True,
    turns: int = 5,
    cancel_after: float | None = None,
    how: str = "items",
) -> dict[str, Any]:
    import statistics

    from ..actors.runtime import Runtime
    from ..server.app import RealtimeServer, ServerConfig

    neighbour = {"Authorization": f"Bearer {CHURN_KEYS[1]}"}
    if engine == "embedded":
        from ..engines.embedded import make_embedded_engine

        made: EngineBackend = make_embedded_engine()
    else:  # the runtime's and the server's own work per response, with no model in the way
        from ..engines.scripted import ScriptedEngine

        made = ScriptedEngine(_flood_script(), record=False)
    unshared: dict[str, Any] = {} if shared else {"loop_share_s_per_s": None}
    config = ServerConfig(port=0, api_keys=CHURN_KEYS, **unshared)
    async with Runtime(made) as rt:
        async with RealtimeServer(rt, config) as server:
            await _spoken_response(server.url, neighbour)  # warm-up
            alone = [await _spoken_response(server.url, neighbour) for _ in range(turns)]
            during, flooded, _, _ = await _during_flood(
                rt,
                _response_flooder,
                (server.url, sessions, seconds, cancel_after, how),
                # A connection for each response: sessions come and go, measure from the first.
                sessions if how in ("items", "one-frame") else 1,
                lambda: _spoken_response(server.url, neighbour),
            )

    def figures(turns: list[tuple[float, float]], i: int) -> tuple[float, float]:
        return statistics.median(t[i] for t in turns), max(t[i] for t in turns)

    return {
        "sessions": sessions,
        "seconds": seconds,
        "engine": engine,
        "shared": shared,
        "cancel_after": cancel_after,
        "how": how,
        "held_s": server.metrics.paced.labels("client_share")._value.get(),
        "first_alone": figures(alone, 0),
        "done_alone": figures(alone, 1),
        "first_during": figures(during, 0),
        "done_during": figures(during, 1),
        "during_turns": len(during),
        "flooder_responses": flooded,
    }


def _churn_flooder(
    url: str, seconds: float, connections: int, report: Connection[tuple[int, int], Any]
) -> None:
    """Open a session, read its session.created, close it; again, from ``connections``
    connections at once, for ``seconds``. A 429 is retried at once (a hostile client)."""

    async def main() -> None:
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidStatus

        headers = {"Authorization": f"Bearer {CHURN_KEYS[0]}"}
        until = time.perf_counter() + seconds
        opened = refused = 0

        async def one() -> None:
            nonlocal opened, refused
            while time.perf_counter() < until:
                try:
                    async with connect(url, additional_headers=headers) as ws:
                        await ws.recv()
                    opened += 1
                except InvalidStatus:
                    refused += 1

        await asyncio.gather(*(one() for _ in range(connections)))
        report.send((opened, refused))

    asyncio.run(main())


async def _run_churn(
    seconds: float, connections: int, connect_rate: float | None, turns: int = 5
) -> dict[str, Any]:
    import multiprocessing
    import statistics

    from ..actors.runtime import Runtime
    from ..engines.scripted import ScriptedEngine
    from ..server.app import RealtimeServer, ServerConfig

    script = _flood_script()
    # The neighbour's key has the same connect rate: a connection per turn, and a turn takes
    # at least its 24 paced tokens (48 ms), so it opens fewer than 21 a second.
    neighbour = {"Authorization": f"Bearer {CHURN_KEYS[1]}"}
    config = ServerConfig(port=0, api_keys=CHURN_KEYS, connect_rate_per_key=connect_rate)
    async with Runtime(ScriptedEngine(script, record=False)) as rt:
        async with RealtimeServer(rt, config) as server:
            await _turn(server.url, neighbour)  # warm-up (VAD model, first response)
            baseline = [await _turn(server.url, neighbour) for _ in range(turns)]
            rss_before = rss_mb()
            ctx = multiprocessing.get_context("spawn")
            ours, theirs = ctx.Pipe()
            flooder = ctx.Process(
                target=_churn_flooder, args=(server.url, seconds, connections, theirs), daemon=True
            )
            flooder.start()
            during = []
            while flooder.is_alive() and not ours.poll():
                during.append(await _turn(server.url, neighbour))
            opened, refused = ours.recv()
            flooder.join(10)
            await asyncio.sleep(0.5)  # the last closes reach the server
            return {
                "seconds": seconds,
                "opened": opened,
                "refused": refused,
                "neighbour_turn_s": statistics.median(baseline),
                "during_turn_s": statistics.median(during) if during else float("nan"),
                "during_turn_worst_s": max(during, default=float("nan")),
                "during_turns": len(during),
                "sessions_left": rt.session_count,
                "rss_before_mb": rss_before,
                "rss_after_mb": rss_mb(),
            }


async def _run_journals(sessions: int, budget_mb: int | None) -> dict[str, Any]:
    """One client opens ``sessions`` sessions and fills each one's replay journal: 30 distinct
    items of 60,000 characters (the conversation keeps the last few, the journal all of their
    added/done events, ~3.6 MB counted a session)."""
    from websockets.asyncio.client import connect

    from ..actors.runtime import Runtime
    from ..engines.scripted import ScriptedEngine
    from ..server.app import RealtimeServer, ServerConfig

    budget = None if budget_mb is None else budget_mb << 20
    async with Runtime(ScriptedEngine(record=False), journal_budget_bytes=budget) as rt:
        config = ServerConfig(port=0, frame_intake_bytes_per_s=None, server_vad_by_default=False)
        async with RealtimeServer(rt, config) as server:
            rss_before = rss_mb()
            began = time.perf_counter()
            clients = []
            for s in range(sessions):
                ws = await connect(server.url, max_size=None)
                await ws.recv()
                for i in range(30):
                    text = f"{s:06d}{i:04d}" + "x" * 59_990  # distinct: each is held on its own
                    item = {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": text}],
                    }
                    await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
                done = 0
                while done < 30:
                    done += json.loads(await ws.recv())["type"] == "conversation.item.done"
                clients.append(ws)
            rt.reap_now()
            import gc

            gc.collect()
            report = {
                "sessions": sessions,
                "budget_mb": budget_mb,
                "seconds": time.perf_counter() - began,
                "journal_mb": sum(h.core.journaled_bytes for h in rt.sessions()) / 2**20,
                "rss_before_mb": rss_before,
                "rss_after_mb": rss_mb(),
            }
            for ws in clients:
                ws.transport.abort()
            return report


def _forwarded_for(i: int, addresses: int) -> dict[str, str]:
    """Client ``i``'s headers: one of ``addresses`` client addresses, as a trusted proxy names
    it (the per-address limits then count each client as the server would behind one)."""
    return {"X-Forwarded-For": f"10.1.{i % addresses // 250}.{i % addresses % 250 + 1}"}


async def _proxied_session(url: str, i: int, addresses: int) -> Any:
    """Client ``i``'s connection, one of ``addresses`` behind a trusted proxy, once its
    session.created has come."""
    from websockets.asyncio.client import connect

    ws = await connect(
        url,
        max_size=None,
        ping_interval=None,
        open_timeout=120,
        additional_headers=_forwarded_for(i, addresses),
    )
    await ws.recv()  # session.created
    return ws


async def _in_batches(one: Callable[[int], Awaitable[Any]], count: int, batch: int = 32) -> list[Any]:
    """``one(i)`` for every ``i`` below ``count``, ``batch`` at a time; what each returned."""
    results: list[Any] = []
    for start in range(0, count, batch):
        results += await asyncio.gather(*map(one, range(start, min(count, start + batch))))
    return results


def _behind_a_proxy(sessions: int, **options: Any) -> Any:
    """An in-process server's config that trusts the clients' proxy (loopback), exempts none of
    them from the per-address limits and lets an address hold ``sessions``."""
    from ..server.app import ServerConfig

    return ServerConfig(
        port=0,
        trusted_proxies=("127.0.0.1/32",),
        exempt_networks=("192.0.2.0/24",),  # none of the clients: every limit counts them
        max_sessions_per_address=sessions,
        **options,
    )


async def _run_held_audio(
    sessions: int,
    addresses: int,
    budget_mb: int | None,
    transcribed: bool = False,
    responding: bool = False,
    model_native: bool = False,
    pending_words: bool = False,
) -> dict[str, Any]:
    """``sessions`` sessions from ``addresses`` client addresses (named by a trusted proxy's
    X-Forwarded-For) each fill their input audio with G.711 mu-law (1 s frames until refused),
    commit it, and fill it again: what sessions hold when clients never ask for a response.
    The audio pacing is off, so the fill takes seconds, not minutes; what is held is the same.

    ``transcribed``: the sessions ask for input transcription and the audio is loud noise, so
    each commit also queues its turn for the real recogniser, which lags far behind: what the
    turns waiting for it hold counts too.

    ``responding``: after the first commit each session asks for a response, which takes the
    committed audio with it to the engine; the engine holds every request for two minutes, as a
    busy one keeps requests waiting. Then the session fills, commits and fills again.

    ``model_native``: the sessions are model-native, so every second buffered leaves as a unit
    for the model to decide on, and the engine holds each for two minutes, as one that decides
    slower than the client streams: the sessions only fill (a commit would abort the units).
    ``pending_words``: each session first creates four items of 65,000 emoji (sent compressed),
    whose words every unit's request carries."""

    from ..actors.runtime import Runtime
    from ..engines.scripted import Script, ScriptedEngine
    from ..server.app import RealtimeServer

    budget = None if budget_mb is None else budget_mb << 20
    if transcribed:
        from ..audio.transcription import default_transcriber

        transcriber = default_transcriber()
        if transcriber is None:
            raise SystemExit("--transcribed needs the recogniser (extra 'transcription')")
        # Loud noise: the recogniser decodes it slowly (quiet it would skip at once).
        second = base64.b64encode(random.Random(7).randbytes(8000)).decode()
    else:
        transcriber = None
        second = base64.b64encode(b"\xff" * 8000).decode()  # 1 s of mu-law quiet
    append = json.dumps({"type": "input_audio_buffer.append", "audio": second})
    options: dict[str, Any] = {"input_audio_format": "g711_ulaw", "turn_detection": None}
    if model_native:
        options["duplex"] = {"model_native": True}
    if transcribed:
        options["input_audio_transcription"] = {"model": "whisper-1"}
    update = json.dumps({"type": "session.update", "session": options})
    sent = 0

    async def fill(ws: ClientConnection) -> None:
        # Frames until the first refusal: each is answered by an error only when refused. A
        # model-native session's buffer never fills (its units leave it), so without a budget
        # counting them nothing refuses: it stops at two minutes of audio.
        nonlocal sent
        for _ in range(120 if model_native else sys.maxsize):
            await ws.send(append)
            sent += len(append)
            with contextlib.suppress(TimeoutError):
                event = json.loads(await asyncio.wait_for(ws.recv(), 0.002))
                if event["type"] == "error":
                    while True:  # the refusals of the frames still in flight
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(ws.recv(), 0.05)
                            continue
                        return

    async def open_one(i: int) -> Any:
        ws = await _proxied_session(server.url, i, addresses)
        await ws.send(update)
        while json.loads(await ws.recv())["type"] != "session.updated":
            pass
        for k in range(4 if pending_words else 0):
            text = chr(0x1F600 + k) * 65_000
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            while json.loads(await ws.recv())["type"] not in ("conversation.item.added", "error"):
                pass
        return ws

    async def commit(ws: ClientConnection) -> None:
        # Answered by an error when nothing was buffered (every append refused).
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        while json.loads(await ws.recv())["type"] not in ("input_audio_buffer.committed", "error"):
            pass

    async def client(ws: ClientConnection) -> Any:
        await fill(ws)
        if model_native:
            return ws
        await commit(ws)
        if responding:
            await ws.send(json.dumps({"type": "response.create"}))
            while json.loads(await ws.recv())["type"] != "response.created":
                pass
            await fill(ws)
            await commit(ws)
        await fill(ws)
        return ws

    held = responding or model_native
    engine = ScriptedEngine(Script(first_latency_s=120, speak=False) if held else Script(), record=False)
    async with Runtime(engine, audio_budget_bytes=budget, transcriber=transcriber) as rt:
        config = _behind_a_proxy(sessions, audio_intake_rate=None)
        async with RealtimeServer(rt, config) as server:
            rss_before = rss_mb()
            began = time.perf_counter()
            opened = [await open_one(i) for i in range(sessions)]  # all open before any fills
            clients = await asyncio.gather(*map(client, opened))
            import gc

            gc.collect()
            flights = list(rt.engine._flights.values())
            report = {
                "sessions": sessions,
                "addresses": addresses,
                "budget_mb": budget_mb,
                "seconds": time.perf_counter() - began,
                "sent_mb": sent / 2**20,
                "held_mb": sum(h.core._input.nbytes + h.core._committed.nbytes for h in rt.sessions())
                / 2**20,
                # The requests in flight carry their turn's (or unit's) audio (len(bytes): no copy).
                "requests_mb": sum(len(f.request.audio) for f in rt.engine._flights.values()) / 2**20,
                "queued_mb": sum(
                    rt._transcripts.backlog_s(h.id) * 2 * h.core.config.sample_rate for h in rt.sessions()
                )
                / 2**20,
                "counted_mb": None if rt.audio_budget is None else rt.audio_budget.total / 2**20,
                # The words the requests in flight carry, each string once however many carry it.
                "words_mb": sum(
                    sys.getsizeof(words)
                    for words in {id(f.request.input_text): f.request.input_text for f in flights}.values()
                )
                / 2**20,
                "text_counted_mb": None if rt.text_budget is None else rt.text_budget.total / 2**20,
                "rss_before_mb": rss_before,
                "rss_after_mb": rss_mb(),
            }
            for ws in clients:
                ws.transport.abort()
            return report


async def _run_held_text(
    sessions: int, addresses: int, budget_mb: int | None, parts: int = 1
) -> dict[str, Any]:
    """``sessions`` sessions from ``addresses`` client addresses (named by a trusted proxy's
    X-Forwarded-For) each set the most text a session keeps: instructions of 65,536 emoji, 128
    tools of 1,900 emoji each, and four items of 65,536 emoji (the conversation's 262,144
    characters), each item cut into ``parts`` content parts. Every message is sent with
    permessage-deflate, in a few hundred bytes; what the server holds is four bytes a character."""
    import zlib

    from ..actors.runtime import Runtime
    from ..engines.scripted import ScriptedEngine
    from ..server.app import RealtimeServer

    def as_json(event: dict[str, Any]) -> str:
        return json.dumps(event, ensure_ascii=False)  # emoji as themselves: 4 bytes each

    emoji = "\U0001f600"
    tools = [
        {"type": "function", "name": f"tool{i}", "description": emoji * 1_900, "parameters": {}}
        for i in range(128)
    ]
    messages = [
        as_json({"type": "session.update", "session": {"instructions": emoji * 65_536}}),
        as_json({"type": "session.update", "session": {"tools": tools}}),
        *(
            as_json(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": chr(0x1F600 + n) * (65_536 // parts)}]
                        * parts,
                    },
                }
            )
            for n in range(4)
        ),
    ]

    def deflated(text: str) -> int:
        zipper = zlib.compressobj(6, zlib.DEFLATED, -15)
        return len(zipper.compress(text.encode()) + zipper.flush(zlib.Z_SYNC_FLUSH))

    wire = sum(map(deflated, messages))  # what a session's messages take compressed, about
    refused: dict[str, int] = {}

    async def one(i: int) -> Any:
        ws = await _proxied_session(server.url, i, addresses)
        for message in messages:
            await ws.send(message)
        answered = 0  # each message is answered by its event, or by an error
        while answered < len(messages):
            event = json.loads(await ws.recv())
            kind = event["type"]
            if kind == "error":
                code = event["error"].get("code") or "?"
                refused[code] = refused.get(code, 0) + 1
            if kind in ("error", "session.updated", "conversation.item.done"):
                answered += 1
        return ws

    budget = None if budget_mb is None else budget_mb << 20
    async with Runtime(ScriptedEngine(record=False), text_budget_bytes=budget) as rt:
        config = _behind_a_proxy(sessions)
        async with RealtimeServer(rt, config) as server:
            rss_before = rss_mb()
            began = time.perf_counter()
            clients = await _in_batches(one, sessions)
            import gc

            gc.collect()
            held = sum(h.core._conversation.held_bytes + h.core._settings_bytes for h in rt.sessions())
            report = {
                "sessions": sessions,
                "addresses": addresses,
                "budget_mb": budget_mb,
                "seconds": time.perf_counter() - began,
                "wire_mb": wire * sessions / 2**20,
                "inflated_mb": sum(len(m.encode()) for m in messages) * sessions / 2**20,
                "refused": refused,
                "text_mb": held / 2**20,
                "journal_mb": None if rt.journal_budget is None else rt.journal_budget.total / 2**20,
                "rss_before_mb": rss_before,
                "rss_after_mb": rss_mb(),
            }
            for ws in clients:
                ws.transport.abort()
            return report


async def _run_held_responses(sessions: int, addresses: int, budget_mb: int | None) -> dict[str, Any]:
    """``sessions`` sessions from ``addresses`` client addresses (named by a trusted proxy's
    X-Forwarded-For) each ask for one out-of-band response with its own instructions (60,000
    emoji) and its own input (three items of 60,000 emoji): a frame of ~960 KB, sent compressed.
    The engine holds every response for two minutes, as a busy one keeps requests waiting, so
    what a running response holds of its own is held by all of them at once."""

    from ..actors.runtime import Runtime
    from ..engines.scripted import Script, ScriptedEngine
    from ..server.app import RealtimeServer

    def item(n: int) -> dict[str, Any]:
        return {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": chr(0x1F600 + n) * 60_000}],
        }

    request = {
        "conversation": "none",
        "instructions": "\U0001f600" * 60_000,
        "input": [item(1), item(2), item(3)],
    }
    message = json.dumps({"type": "response.create", "response": request}, ensure_ascii=False)
    answers: dict[str, int] = {}

    async def one(i: int) -> Any:
        ws = await _proxied_session(server.url, i, addresses)
        await ws.send(message)
        while True:
            event = json.loads(await ws.recv())
            if event["type"] in ("response.created", "error"):
                answer = event["type"] if event["type"] != "error" else event["error"].get("code") or "?"
                answers[answer] = answers.get(answer, 0) + 1
                return ws

    budget = None if budget_mb is None else budget_mb << 20
    engine = ScriptedEngine(Script(first_latency_s=120), record=False)
    async with Runtime(engine, text_budget_bytes=budget) as rt:
        async with RealtimeServer(rt, _behind_a_proxy(sessions)) as server:
            rss_before = rss_mb()
            began = time.perf_counter()
            clients = await _in_batches(one, sessions)
            import gc

            gc.collect()
            report = {
                "sessions": sessions,
                "addresses": addresses,
                "budget_mb": budget_mb,
                "frame_kb": len(message.encode()) / 1000,
                "answers": answers,
                "seconds": time.perf_counter() - began,
                "counted_mb": None if rt.text_budget is None else rt.text_budget.total / 2**20,
                "rss_before_mb": rss_before,
                "rss_after_mb": rss_mb(),
            }
            for ws in clients:
                ws.transport.abort()
            return report


def _scripted_server(
    ready: Connection[int, Any],
    sessions: int,
    loop: str,
    long_answer: bool = False,
    overrides: dict[str, Any] | None = None,
) -> None:
    """Child process: ``serve``'s assembly (GC policy and trimming included) with a scripted
    engine (speaking ``_long_spoken_answer()`` if ``long_answer``), on ``loop``, behind a trusted
    proxy, letting an address hold ``sessions``; ``overrides``: the sessions' settings."""

    async def main() -> None:
        import signal

        import anyio

        from ..engines.scripted import ScriptedEngine
        from ..server.cli_commands import open_server

        engine = (
            ScriptedEngine(_long_spoken_answer(), record=False)
            if long_answer
            else ScriptedEngine(record=False)
        )
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async with open_server(engine, _behind_a_proxy(sessions), overrides) as server:
                ready.send(server.port)
                async for _ in signals:
                    break

    event_loop.run(main(), loop)


async def _run_large_messages(sessions: int, messages: int, addresses: int, loop: str) -> dict[str, Any]:
    """``sessions`` sessions from ``addresses`` client addresses each send ``messages`` messages
    of about 1 MB (ASCII and one emoji, so CPython holds them in four bytes a character) at once,
    compressed by permessage-deflate to about a kilobyte each, of a type the server refuses; then
    they stay, sending nothing. Past the frame pacer's burst (8 MiB) a session's reader takes
    about one a second: what waits meanwhile (the peak), and what stays once all are answered,
    is what the server keeps of messages it has not read yet or has read. The server runs in a
    process of its own, so its RSS is its own."""
    import multiprocessing
    import zlib

    from websockets.exceptions import ConnectionClosed

    from .child_server import served_in_child
    from .wire_soak import server_rss_mb

    def large(n: int) -> str:
        padding = chr(ord("a") + n % 26) * 999_000 + "\U0001f600"
        return json.dumps({"type": "x.padding", "pad": padding}, ensure_ascii=False)

    sample = large(0)
    zipper = zlib.compressobj(6, zlib.DEFLATED, -12)
    wire = len(zipper.compress(sample.encode()) + zipper.flush(zlib.Z_SYNC_FLUSH))

    with served_in_child(_scripted_server, sessions, loop, name="large-messages") as url:
        (child,) = [p for p in multiprocessing.active_children() if p.name == "large-messages"]
        pid = child.pid
        assert pid is not None
        clients = [await _proxied_session(url, i, addresses) for i in range(sessions)]
        await asyncio.sleep(0.5)
        rss_before = peak = server_rss_mb(pid)
        began = time.perf_counter()

        dropped = 0

        async def one(i: int, ws: ClientConnection) -> int:
            nonlocal dropped
            refused = 0
            try:
                for k in range(messages):
                    await ws.send(large(i + k))
                for _ in range(messages):
                    event = json.loads(await asyncio.wait_for(ws.recv(), 300))
                    refused += event["type"] == "error"
            except ConnectionClosed:  # held back past the keepalive's ping timeout, say
                dropped += 1
            return refused

        async def sample_peak() -> None:
            nonlocal peak
            while True:
                peak = max(peak, server_rss_mb(pid))
                await asyncio.sleep(0.1)

        sampler = asyncio.get_running_loop().create_task(sample_peak())
        try:
            refused = sum(await asyncio.gather(*(one(i, ws) for i, ws in enumerate(clients))))
        finally:
            sampler.cancel()
        answered = time.perf_counter() - began
        await asyncio.sleep(1.0)
        report = {
            "sessions": sessions,
            "messages": messages,
            "addresses": addresses,
            "wire_mb": wire * sessions * messages / 2**20,
            "inflated_mb": len(sample.encode()) * sessions * messages / 2**20,
            "refused": refused,
            "dropped": dropped,
            "answered_s": answered,
            "rss_before_mb": rss_before,
            "rss_peak_mb": peak,
            "rss_after_mb": server_rss_mb(pid),
        }
        for ws in clients:
            ws.transport.abort()
        return report


def _long_spoken_answer() -> Script:
    """``--unread-audio``'s answer: a minute of speech, produced ten times faster than real
    time (as a GPU engine would), each packet its own bytes."""
    from ..engines.scripted import Script

    words = tuple(f" word{i}" for i in range(60))
    return Script(tokens=words, audio_packets=375, packet_ms=160, packet_latency_s=0.016, fresh_packets=True)


async def _run_unread_audio(
    sessions: int, addresses: int, waits: bool, seconds: float, loop: str
) -> dict[str, Any]:
    """``sessions`` sessions from ``addresses`` client addresses each ask for a spoken response
    (a minute of 24 kHz speech, produced ten times faster than real time), then drop their
    connections: each session waits ``disconnect_grace_s`` for a resume, and its response goes
    on meanwhile. What the server holds for them, ``seconds`` after the last has dropped, is its
    RSS (it runs in a process of its own).

    (A client that stays and never reads is not this bench's: what it was sent waits in the
    kernel's socket buffers, and in the replay journal, which the journal budget bounds.)"""
    import multiprocessing

    from .child_server import served_in_child
    from .wire_soak import server_rss_mb

    update = json.dumps(
        {
            "type": "session.update",
            "session": {
                "type": "realtime",
                "output_modalities": ["audio"],
                "audio": {"output": {"format": {"type": "audio/pcm", "rate": 24000}}},
            },
        }
    )
    ask = json.dumps({"type": "response.create"})
    answer = _long_spoken_answer()

    # waits=False: the engine runs ahead of its listeners (no allowance).
    overrides = None if waits else {"unsent_audio_bytes": None}
    with served_in_child(_scripted_server, sessions, loop, True, overrides, name="unread-audio") as url:
        (child,) = [p for p in multiprocessing.active_children() if p.name == "unread-audio"]
        pid = child.pid
        assert pid is not None

        async def one(i: int) -> Any:
            ws = await _proxied_session(url, i, addresses)
            await ws.send(update)
            await ws.recv()  # session.updated
            await ws.send(ask)
            while json.loads(await ws.recv())["type"] != "response.created":
                pass
            ws.transport.abort()
            return ws

        rss_before = peak = server_rss_mb(pid)
        await _in_batches(one, sessions)
        began = time.perf_counter()
        while time.perf_counter() - began < seconds:
            await asyncio.sleep(0.25)
            peak = max(peak, server_rss_mb(pid))
        report = {
            "sessions": sessions,
            "addresses": addresses,
            "waits": waits,
            "seconds": seconds,
            "answer_mb": answer.audio_packets * answer.packet_ms * 48 / 2**20,  # 24 kHz pcm16
            "rss_before_mb": rss_before,
            "rss_peak_mb": peak,
            "rss_after_mb": server_rss_mb(pid),
        }
        return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m duplex_actors.bench.flood_bench", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--frames", type=int, default=100_000)
    ap.add_argument("--policy", choices=("on", "off"), default="on")
    ap.add_argument("--audio", action="store_true", help="flood valid audio instead of invalid frames")
    ap.add_argument("--updates", action="store_true", help="flood valid ~1 MB session.update frames")
    ap.add_argument("--echoes", action="store_true", help="small session.updates echoing ~1 MB of tools")
    ap.add_argument("--retrieves", action="store_true", help="retrieves of a 256 KB item")
    ap.add_argument("--resumes", action="store_true", help="resumes replaying ~3 MB, in a loop")
    ap.add_argument("--pings", action="store_true", help="pings flat out, the pongs never read")
    ap.add_argument("--fragments", action="store_true", help="10 ms appends cut into 1-byte fragments")
    ap.add_argument("--values", action="store_true", help="heartbeats padded with ~20,000 tiny JSON values")
    ap.add_argument(
        "--transcripts", action="store_true", help="commits of loud noise with input transcription on"
    )
    ap.add_argument("--commits", action="store_true", help="1 s appends, each committed, no response")
    ap.add_argument(
        "--long-turn",
        type=float,
        default=None,
        metavar="SECONDS",
        help="one transcribed turn this long; the neighbour's transcripts meanwhile",
    )
    ap.add_argument(
        "--sessions",
        type=int,
        default=1,
        metavar="N",
        help="--audio: N sessions of one key flood at once (--policy off: no loop sharing by client)",
    )
    ap.add_argument(
        "--responses",
        type=int,
        default=0,
        metavar="N",
        help="N sessions of one key asking for spoken responses back to back (serve's engine)",
    )
    ap.add_argument(
        "--engine",
        choices=("embedded", "scripted"),
        default="embedded",
        help="--responses: serve's engine, or the scripted one (the runtime's and server's own work)",
    )
    ap.add_argument(
        "--cancel-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="--responses: the flooder cancels each response this long after asking for it",
    )
    ap.add_argument(
        "--how",
        choices=FLOOD_HOW,
        default="items",
        help="--responses: how the flooder asks (an item and response.create on open sessions, "
        "response.create alone, a connection per response, or asking and dropping the connection)",
    )
    ap.add_argument("--seconds", type=float, default=6.0, help="valid floods: how long the flood lasts")
    ap.add_argument(
        "--frame-ms",
        type=int,
        default=None,
        help="--audio (100 ms by default; 2500: near the 256 KiB cap), --transcripts (1000): audio per frame",
    )
    ap.add_argument(
        "--journals",
        type=int,
        default=0,
        metavar="N",
        help="open N sessions and fill their replay journals (memory, against --journal-budget-mb)",
    )
    ap.add_argument("--journal-budget-mb", type=int, default=1024, help="--journals: the runtime's budget")
    ap.add_argument(
        "--held-audio",
        type=int,
        default=0,
        metavar="N",
        help="N sessions fill their input audio with G.711, commit, fill again (memory, against "
        "--audio-budget-mb; --policy off: no budget)",
    )
    ap.add_argument(
        "--held-text",
        type=int,
        default=0,
        metavar="N",
        help="N sessions set the most text a session keeps, sent compressed (memory, against "
        "--text-budget-mb; --policy off: no budget)",
    )
    ap.add_argument(
        "--item-parts", type=int, default=1, metavar="K", help="--held-text: content parts of each item"
    )
    ap.add_argument(
        "--held-responses",
        type=int,
        default=0,
        metavar="N",
        help="N sessions each ask for a response with ~960 KB of its own instructions and input, held "
        "by the engine (memory, against --text-budget-mb; --policy off: no budget)",
    )
    ap.add_argument(
        "--text-budget-mb", type=int, default=1024, help="--held-text, --held-responses: the runtime's budget"
    )
    ap.add_argument(
        "--large-messages",
        type=int,
        default=0,
        metavar="N",
        help="N sessions each send --messages refused messages of ~1 MB, compressed to ~1 KB, then stay "
        "(memory: while their readers are paced, and once all are answered)",
    )
    ap.add_argument("--messages", type=int, default=1, help="--large-messages: messages a session sends")
    ap.add_argument(
        "--unread-audio",
        type=int,
        default=0,
        metavar="N",
        help="N sessions each ask for a minute of speech (produced 10x faster than real time), then "
        "drop their connections (each waits for a resume); --policy off lets the engine run ahead of them",
    )

    ap.add_argument(
        "--addresses",
        type=int,
        default=8,
        help="--held-audio, --held-text, --held-responses, --large-messages: client addresses",
    )
    ap.add_argument(
        "--transcribed",
        action="store_true",
        help="--held-audio: loud noise with input transcription on (each commit waits for the recogniser)",
    )
    ap.add_argument(
        "--responding",
        action="store_true",
        help="--held-audio: each session also asks for a response after its first commit (the engine holds it)",
    )
    ap.add_argument(
        "--model-native",
        action="store_true",
        help="--held-audio: model-native sessions, each second a unit the engine holds undecided",
    )
    ap.add_argument(
        "--pending-words",
        action="store_true",
        help="--held-audio --model-native: each session first creates four items of 65,000 emoji",
    )
    ap.add_argument("--audio-budget-mb", type=int, default=1024, help="--held-audio: the runtime's budget")
    ap.add_argument("--churn", action="store_true", help="open and close sessions flat out (own key)")
    ap.add_argument("--connections", type=int, default=8, help="--churn: connections at once")
    ap.add_argument("--connect-rate", type=float, default=20.0, help="--churn: the flooder key's rate (on)")
    ap.add_argument(
        "--loop",
        choices=[c.value for c in EventLoopChoice],
        default="auto",
        help="the server's event loop, as serve --loop (the flooders run asyncio's own)",
    )
    args = ap.parse_args(argv)
    if args.long_turn:
        r = event_loop.run(_run_long_turn(args.long_turn), args.loop)
        print(
            f"one {r['turn_s']:.0f} s transcribed turn: the neighbour's 1 s turn got its transcript in "
            f"{r['neighbour_alone_s'] * 1e3:.0f} ms alone, {r['during_median_s'] * 1e3:.0f} ms at the median "
            f"while the long turn was decoded (worst {r['during_worst_s'] * 1e3:.0f} ms, "
            f"{r['during_turns']} turns): x{r['during_median_s'] / r['neighbour_alone_s']:.1f}; "
            f"the long turn's own transcript took {r['long_turn_took_s']:.1f} s",
            flush=True,
        )
        return 0
    if args.responses:
        r = event_loop.run(
            _run_responses(
                args.responses,
                args.seconds,
                args.engine,
                args.policy == "on",
                cancel_after=args.cancel_after,
                how=args.how,
            ),
            args.loop,
        )

        def ms(pair: tuple[float, float]) -> str:
            return f"{pair[0] * 1e3:.0f} ms (worst {pair[1] * 1e3:.0f})"

        cancelled = "" if r["cancel_after"] is None else f", each cancelled after {r['cancel_after']:g} s"
        if r["how"] != "items":
            cancelled += f", asking {r['how']}"
        print(
            f"{r['sessions']} sessions of one key asking for spoken responses for {r['seconds']:.0f} s"
            f"{cancelled} "
            f"({r['engine']} engine, loop share {'on' if r['shared'] else 'off'}, held "
            f"{r['held_s']:.1f} s; {r['flooder_responses']} done): the neighbour's first audio {ms(r['first_alone'])} alone, "
            f"{ms(r['first_during'])} during (x{r['first_during'][0] / r['first_alone'][0]:.2f}); its "
            f"response done {ms(r['done_alone'])} alone, {ms(r['done_during'])} during "
            f"(x{r['done_during'][0] / r['done_alone'][0]:.2f}; {r['during_turns']} turns)",
            flush=True,
        )
        return 0
    if args.churn:
        rate = args.connect_rate if args.policy == "on" else None
        c = event_loop.run(_run_churn(args.seconds, args.connections, rate), args.loop)
        print(
            f"churn from {args.connections} connections for {c['seconds']:.1f} s, connect rate "
            f"{'off' if rate is None else f'{rate:g}/s on its key'}: {c['opened']} sessions opened "
            f"({c['opened'] / c['seconds']:.0f}/s), {c['refused']} handshakes refused (429); neighbour "
            f"turn median {c['neighbour_turn_s'] * 1e3:.1f} ms alone, {c['during_turn_s'] * 1e3:.1f} ms "
            f"during (worst {c['during_turn_worst_s'] * 1e3:.1f}, {c['during_turns']} turns): "
            f"x{c['during_turn_s'] / c['neighbour_turn_s']:.2f} at the median; sessions left "
            f"{c['sessions_left']}; server RSS {c['rss_before_mb']:.1f} -> {c['rss_after_mb']:.1f} MiB",
            flush=True,
        )
        return 0
    if args.journals:
        budget_mb = args.journal_budget_mb if args.policy == "on" else None
        j = event_loop.run(_run_journals(args.journals, budget_mb), args.loop)
        print(
            f"{j['sessions']} sessions filling their journals, budget "
            f"{'off' if budget_mb is None else f'{budget_mb} MiB'}: journals hold {j['journal_mb']:.1f} MiB "
            f"(counted); server RSS {j['rss_before_mb']:.1f} -> {j['rss_after_mb']:.1f} MiB "
            f"(+{j['rss_after_mb'] - j['rss_before_mb']:.1f}) in {j['seconds']:.1f} s",
            flush=True,
        )
        return 0
    if args.unread_audio:
        u = event_loop.run(
            _run_unread_audio(
                args.unread_audio, args.addresses, args.policy == "on", args.seconds, args.loop
            ),
            "asyncio",
        )
        print(
            f"{u['sessions']} sessions from {u['addresses']} addresses each asking for "
            f"{u['answer_mb']:.1f} MiB of speech, then dropping their connections (the engine "
            f"{'waits for' if u['waits'] else 'runs ahead of'} its listeners): server RSS "
            f"{u['rss_before_mb']:.1f} MiB, peak +{u['rss_peak_mb'] - u['rss_before_mb']:.1f}, after "
            f"{u['seconds']:g} s +{u['rss_after_mb'] - u['rss_before_mb']:.1f}",
            flush=True,
        )
        return 0
    if args.large_messages:
        m = event_loop.run(
            _run_large_messages(args.large_messages, args.messages, args.addresses, args.loop), "asyncio"
        )
        print(
            f"{m['sessions']} sessions from {m['addresses']} addresses, {m['messages']} messages of ~1 MB "
            f"each: about {m['wire_mb']:.1f} MiB sent compressed ({m['inflated_mb']:.0f} MiB inflated), "
            f"{m['refused']} refused, {m['dropped']} connections dropped, done in {m['answered_s']:.1f} s; "
            f"server RSS "
            f"{m['rss_before_mb']:.1f} MiB, peak +{m['rss_peak_mb'] - m['rss_before_mb']:.1f}, after "
            f"+{m['rss_after_mb'] - m['rss_before_mb']:.1f}",
            flush=True,
        )
        return 0
    if args.held_responses:
        budget_mb = args.text_budget_mb if args.policy == "on" else None
        r = event_loop.run(_run_held_responses(args.held_responses, args.addresses, budget_mb), args.loop)
        counted = "uncounted" if r["counted_mb"] is None else f"{r['counted_mb']:.1f} MiB counted"
        print(
            f"{r['sessions']} sessions from {r['addresses']} addresses each asking for a response with "
            f"{r['frame_kb']:.0f} KB of its own text, budget {'off' if budget_mb is None else f'{budget_mb} MiB'}: "
            f"{r['answers']}; {counted}; process RSS {r['rss_before_mb']:.1f} -> {r['rss_after_mb']:.1f} MiB "
            f"(+{r['rss_after_mb'] - r['rss_before_mb']:.1f}) in {r['seconds']:.1f} s",
            flush=True,
        )
        return 0
    if args.held_text:
        budget_mb = args.text_budget_mb if args.policy == "on" else None
        t = event_loop.run(
            _run_held_text(args.held_text, args.addresses, budget_mb, args.item_parts), args.loop
        )
        print(
            f"{t['sessions']} sessions from {t['addresses']} addresses holding text, budget "
            f"{'off' if budget_mb is None else f'{budget_mb} MiB'}: about {t['wire_mb']:.1f} MiB sent "
            f"compressed ({t['inflated_mb']:.0f} MiB inflated), refused {t['refused'] or 'nothing'}; the "
            f"sessions hold {t['text_mb']:.1f} MiB of text, the journals {t['journal_mb'] or 0:.1f} MiB "
            f"(counted); process RSS {t['rss_before_mb']:.1f} -> {t['rss_after_mb']:.1f} MiB "
            f"(+{t['rss_after_mb'] - t['rss_before_mb']:.1f}) in {t['seconds']:.1f} s",
            flush=True,
        )
        return 0
    if args.held_audio:
        budget_mb = args.audio_budget_mb if args.policy == "on" else None
        h = event_loop.run(
            _run_held_audio(
                args.held_audio,
                args.addresses,
                budget_mb,
                args.transcribed,
                args.responding,
                args.model_native,
                args.pending_words,
            ),
            args.loop,
        )
        counted = "" if h["counted_mb"] is None else f", {h['counted_mb']:.1f} MiB counted by the budget"
        words = (
            f"; the requests carry {h['words_mb']:.1f} MiB of words, the text budget counts "
            f"{h['text_counted_mb']:.1f} MiB"
            if args.pending_words
            else ""
        )
        print(
            f"{h['sessions']} sessions from {h['addresses']} addresses holding G.711 input audio"
            f"{' (transcribed)' if args.transcribed else ''}{' and asking for responses' if args.responding else ''}"
            f"{' (model-native: units the engine holds)' if args.model_native else ''}"
            f", budget {'off' if budget_mb is None else f'{budget_mb} MiB'}: {h['sent_mb']:.0f} MiB sent, the "
            f"sessions hold {h['held_mb']:.1f} MiB of audio, their responses' requests "
            f"{h['requests_mb']:.1f} MiB, and {h['queued_mb']:.1f} MiB waits for the "
            f"recogniser{counted}{words}; process RSS {h['rss_before_mb']:.1f} -> "
            f"{h['rss_after_mb']:.1f} MiB (+{h['rss_after_mb'] - h['rss_before_mb']:.1f}) in {h['seconds']:.1f} s",
            flush=True,
        )
        return 0
    if args.audio and args.sessions > 1:
        a = event_loop.run(_run_audio_sessions(args.sessions, args.seconds, args.policy == "on"), args.loop)
        print(
            f"{a['sessions']} sessions of one key flooding audio for {args.seconds:.0f} s, loop shared by "
            f"client {'on' if a['shared'] else 'off'}: accepted {a['accepted_x_real_time']:.1f}x real time "
            f"in all; neighbour turn {a['alone_s'] * 1e3:.0f} ms alone, {a['during_s'] * 1e3:.0f} ms during "
            f"(p90 {a['during_p90_s'] * 1e3:.0f}, worst {a['during_worst_s'] * 1e3:.0f}, "
            f"{a['during_turns']} turns): x{a['during_s'] / a['alone_s']:.2f} at the median; reads held "
            f"back {a['held_s']:.1f} s by the client share",
            flush=True,
        )
        return 0
    kind = next((k for k in VALID_FLOODS if getattr(args, k)), None)
    if kind is not None:
        frame_ms = args.frame_ms or (1000 if kind in ("transcripts", "commits") else 100)
        a = event_loop.run(_run_valid(kind, args.seconds, args.policy == "on", frame_ms), args.loop)
        if kind in ("audio", "transcripts"):
            what = (
                f"{VALID_FLOODS[kind]} in {frame_ms} ms frames, sent at {a['flooder_sent_x_real_time']:.1f}x "
                f"real time, accepted at {a['accepted_x_real_time']:.1f}x,"
            )
        else:
            what = f"{VALID_FLOODS[kind]} ({a['frames_sent']} sent)"
        print(
            f"flood of {what} for {a['seconds']:.1f} s, pacing {args.policy}: neighbour turn median "
            f"{a['neighbour_turn_s'] * 1e3:.1f} ms alone (worst {a['neighbour_turn_worst_s'] * 1e3:.1f}), "
            f"{a['during_turn_s'] * 1e3:.1f} ms during (worst {a['during_turn_worst_s'] * 1e3:.1f}, "
            f"{a['during_turns']} turns): x{a['during_turn_s'] / a['neighbour_turn_s']:.2f} at the median; "
            f"the flooder was sent {a['received_mb_per_s']:.1f} MB/s; reads held back {a['paced_s']:.1f} s, "
            f"{a['rejected_frames']:.0f} frames refused; server RSS "
            f"{a['rss_before_mb']:.1f} -> {a['rss_flooded_mb']:.1f} MiB with the flood's frames queued "
            f"(peak {a['rss_peak_mb']:.1f} MiB during it)",
            flush=True,
        )
        return 0
    r = event_loop.run(_run(args.frames, args.policy == "on"), args.loop)
    print(
        f"flood of {r['frames']} invalid frames, policy {args.policy}: neighbour turn "
        f"{r['neighbour_turn_s']:.2f} s alone, {r['neighbour_turn_during_flood_s']:.2f} s during "
        f"(x{r['neighbour_turn_during_flood_s'] / r['neighbour_turn_s']:.1f}); server RSS "
        f"{r['rss_before_mb']:.1f} -> {r['rss_after_mb']:.1f} MiB "
        f"(+{r['rss_after_mb'] - r['rss_before_mb']:.1f})",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
