"""Sessions over processes: ``serve --workers N`` against a plain single-process server.

Every arm serves the same unpaced ScriptedEngine (no sleeps: the work per turn is the
runtime's, the JSON and the websocket framing, which is exactly what ``--workers`` spreads
over cores) on a loopback port, in its own processes, and the same load runs against it:

* ``bare``: ``serve`` as one process (runtime, server and engine on one event loop). This is
  the baseline every ratio divides by.
* ``workers=1``: the front, one worker and the engine process (what the front and the engine
  channel cost).
* ``workers=2``: the front, two workers sharing the engine process.

The load is ``sessions`` websocket sessions kept busy for ``duration_s``: each sends 100 ms of
audio, commits, sends ``response.create`` (manual turns, as a GA client without server VAD) and
reads until its ``response.done``, then again. It runs in ``clients`` separate processes on raw
sockets: frames are masked once ahead of time and what comes back is scanned for the bytes
``"response.done"`` with no frame or JSON parsing, so the load takes as little of the machine's
two cores as it can (far less CPU per turn than the websockets library client it
replaced). Two load processes by default: with one, its
single loop was what limited the two-worker arm. Turns per second is counted across all of
them. Arms run back to back in each round, in alternating order, and the ratio reported is the median over rounds of the per-round
ratio (machine speed drifts between rounds on a shared machine; a ratio within one round does
not).

A second mode, ``--realtime``, measures what ``--workers`` is for: how many *live* sessions
a server keeps in real time. Each session streams 20 ms of audio every 20 ms at the GA wire's
24 kHz, as a microphone does, with the server's default turn detection on: every chunk is
decoded, resampled to 16 kHz and heard by the Silero VAD in the worker that owns the session
(low-level noise, so no turn starts and the engine is idle). Once a second each session sends
``input_audio_buffer.clear`` and times the ``input_audio_buffer.cleared`` reply: it queues
behind every chunk sent before it, so its round trip is the server's backlog. A server keeps
up with N sessions when that round trip's p99 stays under ``REALTIME_RTT_P99_S`` with no probe
lost and no error. The bench raises N by ``REALTIME_STEP``x from ``realtime_start`` on a fresh
server per step until it fails, then halves the gap twice; an arm's capacity is the largest N
that kept up. Here the
load costs a small fraction of what the server spends per session (one pre-masked write per
chunk against decode, resample and VAD), so the two workers get most of the two cores.

A third mode, ``--front``, measures the front's own CPU with many live sessions on it:
``front_sessions`` (500) websocket sessions handed off by the front of ``--workers 2``, all open
for the whole window, each sending a 20 ms chunk every ``FRONT_CHUNK_EVERY_S`` and a turn
(commit, ``response.create``) every ``FRONT_TURN_EVERY_S``. The front never reads a frame: what
it does is per connection (accept, peek, hand-off) and per response (two reports from the
worker), so the chunk rate is a tenth of real time, which keeps 500 sessions live in two
workers on a 2-core host (500 real-time sessions need several cores of workers). The front's
CPU seconds per wall second (``/proc/PID/stat``, its process alone) is reported for the
connect phase and for the live window.

``--pair`` adds to the turn form a ``bare x2`` arm: two independent single-process servers,
the sessions split between them. Its turns per server core-second over the bare arm's is what
two processes that share nothing keep on this host, the reference for two workers' ratio.

``python -m duplex_actors.bench.workers_bench [--quick] [--pair] [--realtime] [--front]``
prints the result as JSON.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import multiprocessing
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import TYPE_CHECKING, Any, cast

from ..engines.scripted import Script, ScriptedEngine

if TYPE_CHECKING:
    from ..testing.raw_websocket import RawWebSocket

#: 12 tokens and 4 audio packets, no pacing: ~50 server events per turn.
SCRIPT = Script(
    tokens=tuple(f" w{i}" for i in range(12)),
    audio_packets=4,
    first_latency_s=0.0,
    token_latency_s=0.0,
    packet_latency_s=0.0,
)
APPEND = json.dumps(
    {
        "type": "input_audio_buffer.append",  # 100 ms at the GA wire's 24 kHz
        "audio": base64.b64encode(b"\x01\x00" * 2400).decode(),
    }
)
COMMIT = json.dumps({"type": "input_audio_buffer.commit"})
# A GA server's commit only adds the audio to the conversation; the client asks for the reply.
RESPOND = json.dumps({"type": "response.create"})
# Manual turns: the load commits itself, so server VAD (on by default when its model loads)
# would only add per-chunk work that no arm is meant to measure.
MANUAL_TURNS = json.dumps(
    {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}}
)


#: The real-time mode (see the module docstring).
REALTIME_CHUNK_S = 0.02
REALTIME_PROBE_EVERY = 50  # chunks: one clear probe per session per second
REALTIME_RTT_P99_S = 0.02
REALTIME_STEP = 1.2
REALTIME_PHASES = 10  # sessions send in 10 groups 2 ms apart, not all on one tick


def _noise_chunk() -> str:
    """20 ms at 24 kHz of quiet noise (about -60 dBFS): what an open microphone in a quiet room
    sends. Deterministic, and not digital silence, which a VAD could shortcut."""
    import random

    rng = random.Random(20261201)
    samples = [rng.randint(-30, 30) for _ in range(480)]
    return base64.b64encode(b"".join(v.to_bytes(2, "little", signed=True) for v in samples)).decode()


#: The --front mode (see the module docstring).
FRONT_SESSIONS = 500
FRONT_CHUNK_EVERY_S = 0.2
FRONT_TURN_EVERY_S = 5.0


STREAM = json.dumps({"type": "input_audio_buffer.append", "audio": _noise_chunk()})
CLEAR = json.dumps({"type": "input_audio_buffer.clear"})


def unpaced_engine() -> ScriptedEngine:  # module level: picklable into the engine process
    return ScriptedEngine(SCRIPT, record=False)


# --------------------------------------------------------------------------- the servers


def _bare_main(ready: Connection[int, Any]) -> None:
    """``serve`` in one process: the same assembly (open_server, GcPolicy included)."""

    async def main() -> None:
        from ..server.app import ServerConfig
        from ..server.cli_commands import open_server

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        async with open_server(unpaced_engine(), ServerConfig(port=0)) as server:
            ready.send(server.port)
            await stop.wait()

    asyncio.run(main())


def _bare_pair_main(ready: Connection[str, Any]) -> None:
    """Two independent ``serve`` processes (the ``bare x2`` arm): what two processes on this
    host keep per core when nothing joins them, the reference for two workers' per-core ratio."""
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    children = [ctx.Process(target=_bare_main, args=(send,)) for _, send in pipes]
    for child in children:
        child.start()
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    try:
        # one string: _served makes one URL of it, _measure spreads sessions over the two
        ports = [receive.recv() for receive, _ in pipes]
        ready.send(f"{ports[0]}/v1/realtime ws://127.0.0.1:{ports[1]}")
        while not stop[0]:
            time.sleep(0.1)
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.join(30)


def _workers_main(workers: int, ready: Connection[int, Any]) -> None:
    import contextlib
    import io

    from ..server.workers import WorkerSettings, serve_workers

    with contextlib.redirect_stdout(io.StringIO()):  # the banner lines are not bench output
        serve_workers(
            workers,
            "127.0.0.1",
            0,
            WorkerSettings(engine="scripted-unpaced", engine_factory=unpaced_engine),
            on_ready=ready.send,
        )


# --------------------------------------------------------------------------- the load


def _masked_frame(text: str) -> bytes:
    """A client text frame, masked once ahead of time: the load then writes bytes and nothing
    else (the server unmasks whatever key it gets; a fixed key is fine for a load generator)."""
    import struct

    payload = text.encode()
    mask = os.urandom(4)
    n = len(payload)
    if n < 126:
        header = struct.pack("!BB", 0x81, 0x80 | n)
    elif n < 1 << 16:
        header = struct.pack("!BBH", 0x81, 0x80 | 126, n)
    else:
        header = struct.pack("!BBQ", 0x81, 0x80 | 127, n)
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def _read_until(ws: RawWebSocket, marker: bytes, tail: bytes) -> bytes:
    """Read raw bytes until ``marker`` appears; returns what followed it (the next search's
    start). No frame parsing: the server's frames are unmasked text, so a substring test over
    the byte stream finds an event type; ``tail`` carries a marker split across two reads."""
    buffer = tail
    while True:
        found = buffer.find(marker)
        if found >= 0:
            return buffer[found + len(marker) :]
        buffer = buffer[-len(marker) :] + await ws.reader.read(1 << 16)


async def _session(url: str, stop_at: float, counts: list[int], frames: dict[str, bytes]) -> None:
    """One session of the load on a raw socket: pre-masked frames out, a byte scan in. The
    websockets library cost the load about as much CPU per turn as the server's framing."""
    from ..testing.raw_websocket import RawWebSocket

    ws = await RawWebSocket.connect(url)
    try:
        rest = await _read_until(ws, b'"session.created"', b"")
        ws.writer.write(frames["manual"])
        rest = await _read_until(ws, b'"session.updated"', rest)
        turn = frames["append"] + frames["commit"] + frames["respond"]
        while time.perf_counter() < stop_at:
            ws.writer.write(turn)
            rest = await _read_until(ws, b'"response.done"', rest)
            counts[0] += 1
    finally:
        ws.abort()


def _client_main(
    urls: list[str], warmup_s: float, duration_s: float, result: Connection[tuple[int, float, float], Any]
) -> None:
    """One load process: a session per URL in ``urls``."""

    async def main() -> None:
        counts = [0]
        start = time.perf_counter()
        stop_at = start + warmup_s + duration_s
        frames = {
            "manual": _masked_frame(MANUAL_TURNS),
            "append": _masked_frame(APPEND),
            "commit": _masked_frame(COMMIT),
            "respond": _masked_frame(RESPOND),
        }
        tasks = [asyncio.create_task(_session(url, stop_at, counts, frames)) for url in urls]
        await asyncio.sleep(warmup_s)
        base = counts[0]
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        await asyncio.gather(*tasks)
        # turns that finished after stop_at still count, over the time they took
        result.send((counts[0] - base, time.perf_counter() - t0, time.process_time() - cpu0))

    asyncio.run(main())


class _LiveSession:
    """One real-time session of the load: its socket, and its probes in flight."""

    __slots__ = ("ws", "probes", "rtts", "errors", "turns", "tail")

    def __init__(self, ws: RawWebSocket) -> None:
        self.ws = ws
        self.probes: list[float] = []  # send times of clears not yet answered, oldest first
        self.rtts: list[float] = []
        self.errors = 0
        self.turns = 0
        self.tail = b""


_CLEARED = b'"input_audio_buffer.cleared"'
_ERROR = b'"type":"error"'
_SPEECH = b'"input_audio_buffer.speech_started"'
_LONGEST_MARKER = max(len(_CLEARED), len(_ERROR), len(_SPEECH))


async def _listen(live: _LiveSession, counting_from: list[float]) -> None:
    """Read the session's events as raw bytes: each ``cleared`` answers the oldest probe."""
    reader = live.ws.reader
    while True:
        data = await reader.read(1 << 16)
        if not data:
            return
        now = time.perf_counter()
        # Each marker is searched in the bytes read plus the previous read's last len-1 bytes:
        # a marker split across two reads is found, and none is counted twice (it cannot fit
        # in the carried part alone).
        before = live.tail
        live.tail = (before + data)[-(_LONGEST_MARKER - 1) :]

        def count(marker: bytes, before: bytes = before, data: bytes = data) -> int:
            return (before[-(len(marker) - 1) :] + data).count(marker)

        for _ in range(count(_CLEARED)):
            if live.probes:
                sent = live.probes.pop(0)
                if sent >= counting_from[0]:
                    live.rtts.append(now - sent)
        live.errors += count(_ERROR)
        live.turns += count(_SPEECH)


def _realtime_client_main(
    urls: list[str], warmup_s: float, duration_s: float, result: Connection[dict[str, Any], Any]
) -> None:
    """One load process: a real-time session per URL (see the module docstring)."""

    async def main() -> None:
        from ..testing.raw_websocket import RawWebSocket

        append, clear = _masked_frame(STREAM), _masked_frame(CLEAR)
        gate = asyncio.Semaphore(16)

        async def open_one(url: str) -> _LiveSession:
            async with gate:
                ws = await RawWebSocket.connect(url)
                await _read_until(ws, b'"session.created"', b"")
                return _LiveSession(ws)

        sessions = await asyncio.gather(*(open_one(url) for url in urls))
        counting_from = [float("inf")]
        listeners = [asyncio.create_task(_listen(live, counting_from)) for live in sessions]
        groups = [sessions[i::REALTIME_PHASES] for i in range(REALTIME_PHASES)]
        tick_s = REALTIME_CHUNK_S / REALTIME_PHASES
        start = time.perf_counter()
        counting_from[0] = start + warmup_s
        end = counting_from[0] + duration_s
        lateness: list[float] = []
        cpu0 = None
        tick = 0
        while True:
            due = start + tick * tick_s
            if due >= end:
                break
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.perf_counter()
            if due >= counting_from[0]:
                if cpu0 is None:
                    cpu0 = time.process_time()
                lateness.append(now - due)
            chunk_index = tick // REALTIME_PHASES
            for j, live in enumerate(groups[tick % REALTIME_PHASES]):
                writer = live.ws.writer
                writer.write(append)
                # one probe per session per second, spread over the second
                if (chunk_index + j) % REALTIME_PROBE_EVERY == 0:
                    writer.write(clear)
                    live.probes.append(time.perf_counter())
            tick += 1
        cpu = time.process_time() - (cpu0 if cpu0 is not None else time.process_time())
        # Answers still on their way get a grace period; what is missing after it was lost.
        grace_end = time.perf_counter() + 2.0
        while time.perf_counter() < grace_end and any(live.probes for live in sessions):
            await asyncio.sleep(0.05)
        lost = sum(1 for live in sessions for sent in live.probes if sent >= counting_from[0])
        for task in listeners:
            task.cancel()
        for live in sessions:
            live.ws.abort()
        result.send(
            {
                "rtts": [rtt for live in sessions for rtt in live.rtts],
                "lost": lost,
                "errors": sum(live.errors for live in sessions),
                "turns": sum(live.turns for live in sessions),
                "lateness": lateness,
                "client_cpu_s": cpu,
            }
        )

    asyncio.run(main())


def _front_client_main(
    urls: list[str],
    chunk_every_s: float,
    turn_every_s: float,
    duration_s: float,
    link: Connection[str | dict[str, Any], str],
) -> None:
    """One load process of the --front mode: opens a session per URL, says so on ``link``,
    waits for the go, then keeps them live for ``duration_s`` (see the module docstring)."""

    async def main() -> None:
        from ..testing.raw_websocket import RawWebSocket

        manual, append = _masked_frame(MANUAL_TURNS), _masked_frame(STREAM)
        turn = _masked_frame(COMMIT) + _masked_frame(RESPOND)
        gate = asyncio.Semaphore(16)
        done = [0]

        async def open_one(url: str) -> RawWebSocket:
            async with gate:
                ws = await RawWebSocket.connect(url)
                rest = await _read_until(ws, b'"session.created"', b"")
                ws.writer.write(manual)
                await _read_until(ws, b'"session.updated"', rest)
                return ws

        async def listen(ws: RawWebSocket) -> None:
            tail = b""
            marker = b'"response.done"'
            while data := await ws.reader.read(1 << 16):
                done[0] += (tail + data).count(marker)
                tail = data[-(len(marker) - 1) :]

        sockets = await asyncio.gather(*(open_one(url) for url in urls))
        listeners = [asyncio.create_task(listen(ws)) for ws in sockets]
        link.send("open")
        await asyncio.to_thread(link.recv)  # the go
        phases = max(1, round(chunk_every_s / 0.002))  # sessions spread over the period
        groups = [sockets[i::phases] for i in range(phases)]
        turn_every = max(1, round(turn_every_s / chunk_every_s))  # in chunks
        tick_s = chunk_every_s / phases
        start = time.perf_counter()
        cpu0 = time.process_time()
        tick = 0
        while (due := start + tick * tick_s) < start + duration_s:
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            chunk = tick // phases
            for j, ws in enumerate(groups[tick % phases]):
                ws.writer.write(append)
                if (chunk + j) % turn_every == 0:
                    ws.writer.write(turn)
            tick += 1
        cpu = time.process_time() - cpu0
        await asyncio.sleep(0.5)  # the last turns' answers
        for task in listeners:
            task.cancel()
        for ws in sockets:
            ws.abort()
        link.send({"responses_done": done[0], "client_cpu_s": cpu})

    asyncio.run(main())


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by the process ``pid`` alone."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_front(
    *,
    sessions: int = FRONT_SESSIONS,
    workers: int = 2,
    clients: int = 2,
    duration_s: float = 10.0,
    chunk_every_s: float = FRONT_CHUNK_EVERY_S,
    turn_every_s: float = FRONT_TURN_EVERY_S,
) -> dict[str, Any]:
    """The front's CPU with ``sessions`` live sessions on ``--workers`` (module docstring)."""
    ctx = multiprocessing.get_context("spawn")
    with _served(ctx, _workers_main, (workers,)) as (server, url):
        assert server.pid is not None  # started by _served
        time.sleep(1.0)  # the pool's start-up is not the front's steady cost
        links, procs = [], []
        roles0 = _tree_cpu_by_name(server.pid)
        front0, t0 = _proc_cpu_s(server.pid), time.perf_counter()
        for i in range(clients):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_front_client_main,
                args=(
                    [url] * len(range(i, sessions, clients)),
                    chunk_every_s,
                    turn_every_s,
                    duration_s,
                    theirs,
                ),
            )
            proc.start()
            links.append(mine)
            procs.append(proc)
        for link in links:
            if not link.poll(180):
                raise RuntimeError("a load client did not open its sessions")
            link.recv()
        front1, t1 = _proc_cpu_s(server.pid), time.perf_counter()
        roles1 = _tree_cpu_by_name(server.pid)
        for link in links:
            link.send("go")
        parts = []
        for link, proc in zip(links, procs):
            if not link.poll(duration_s + 120):
                raise RuntimeError("a load client did not finish")
            parts.append(link.recv())
            if len(parts) == 1:
                front2, t2 = _proc_cpu_s(server.pid), time.perf_counter()
                roles2 = _tree_cpu_by_name(server.pid)
            proc.join(10)
    live_s = t2 - t1
    responses = sum(part["responses_done"] for part in parts)
    expected = sessions * duration_s / turn_every_s
    return {
        "name": "workers_front",
        "params": {
            "sessions": sessions,
            "workers": workers,
            "clients": clients,
            "duration_s": duration_s,
            "chunk_every_ms": 1000 * chunk_every_s,
            "turn_every_s": turn_every_s,
            "cpus": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(),
        },
        "connect_s": round(t1 - t0, 2),
        # the front's CPU seconds per wall second, its process alone
        "front_cores_connecting": round((front1 - front0) / (t1 - t0), 4),
        "front_cores_live": round((front2 - front1) / live_s, 4),
        "front_ms_per_session_opened": round(1000 * (front1 - front0) / sessions, 3),
        "responses_done": responses,
        "responses_expected": round(expected),
        "front_ms_per_response": round(1000 * (front2 - front1) / responses, 4) if responses else None,
        "cores_live_by_process": {
            role: round((roles2[role] - roles1.get(role, 0.0)) / live_s, 3) for role in roles2
        },
        "cores_connecting_by_process": {
            role: round((roles1[role] - roles0.get(role, 0.0)) / (t1 - t0), 3) for role in roles1
        },
        "client_cores": round(sum(part["client_cpu_s"] for part in parts) / duration_s, 3),
    }


@contextlib.contextmanager
def _served(
    ctx: SpawnContext, target: Callable[..., None], args: tuple[object, ...]
) -> Iterator[tuple[SpawnProcess, str]]:
    """A fresh server (``target(*args, ready)``) in its own process: yields (process, URL),
    and SIGTERMs it (then kills it) on the way out."""
    ready_recv, ready_send = ctx.Pipe(duplex=False)
    server = ctx.Process(target=target, args=(*args, ready_send))
    server.start()
    assert server.pid is not None  # set by start()
    try:
        if not ready_recv.poll(120):
            raise RuntimeError(f"{target.__name__} did not start")
        yield server, f"ws://127.0.0.1:{ready_recv.recv()}/v1/realtime"
    finally:
        os.kill(server.pid, signal.SIGTERM)
        server.join(30)
        if server.is_alive():
            server.kill()
            server.join(5)


def _measure_realtime(
    ctx: SpawnContext,
    target: Callable[..., None],
    args: tuple[object, ...],
    *,
    sessions: int,
    clients: int,
    warmup_s: float,
    duration_s: float,
) -> dict[str, Any]:
    """N real-time sessions against a fresh server: did it keep up, and at what cost."""
    with _served(ctx, target, args) as (server, url):
        assert server.pid is not None  # started by _served
        pipes, procs = [], []
        urls = [url] * sessions
        for i in range(clients):
            receive, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_realtime_client_main, args=(urls[i::clients], warmup_s, duration_s, send)
            )
            proc.start()
            pipes.append(receive)
            procs.append(proc)
        # The server's CPU over the measured window: from when the warm-up should be over to
        # when the first load process reports (the others end within a tick of it).
        time.sleep(warmup_s + 1.0)
        server_cpu0 = _tree_cpu_s(server.pid)
        window0 = time.perf_counter()
        parts = []
        for receive, proc in zip(pipes, procs):
            if not receive.poll(warmup_s + duration_s + 180):
                raise RuntimeError("a load client did not finish")
            parts.append(receive.recv())
            if len(parts) == 1:
                server_cpu = _tree_cpu_s(server.pid) - server_cpu0
                window = time.perf_counter() - window0
            proc.join(10)
        rtts = sorted(rtt for part in parts for rtt in part["rtts"])
        lateness = sorted(x for part in parts for x in part["lateness"])
        p99 = rtts[int(0.99 * (len(rtts) - 1))] if rtts else float("inf")
        lost = sum(part["lost"] for part in parts)
        errors = sum(part["errors"] for part in parts)
        return {
            "sessions": sessions,
            "probe_rtt_p50_ms": round(1000 * rtts[len(rtts) // 2], 2) if rtts else None,
            "probe_rtt_p99_ms": round(1000 * p99, 2),
            "probes": len(rtts),
            "lost": lost,
            "errors": errors,
            "turns_started": sum(part["turns"] for part in parts),
            "load_lateness_p99_ms": round(1000 * lateness[int(0.99 * (len(lateness) - 1))], 2)
            if lateness
            else None,
            "server_cores": round(server_cpu / window, 2),
            "client_cores": round(sum(part["client_cpu_s"] for part in parts) / duration_s, 2),
            "kept_up": p99 <= REALTIME_RTT_P99_S and lost == 0 and errors == 0,
        }


def _measure(
    ctx: SpawnContext,
    target: Callable[..., None],
    args: tuple[object, ...],
    *,
    sessions: int,
    clients: int,
    warmup_s: float,
    duration_s: float,
) -> dict[str, Any]:
    with _served(ctx, target, args) as (server, url):
        roles0: dict[str, float] = {}

        def cpu_of() -> float:  # the first call is the start of the window
            roles = _tree_cpu_by_name(cast(int, server.pid))  # started by _served
            if not roles0:
                roles0.update(roles)
            roles1.update(roles)
            return sum(roles.values())

        roles1: dict[str, float] = {}
        load = run_load(
            ctx,
            [url.split()[i % len(url.split())] for i in range(sessions)],  # the pair arm has two
            clients=clients,
            warmup_s=warmup_s,
            duration_s=duration_s,
            cpu_of=cpu_of,
        )
        turns = load["turns_per_s"] * load["seconds"]
        per_turn = {
            role: round(1000 * (roles1[role] - roles0.get(role, 0.0)) / turns, 3) for role in roles1 if turns
        }
        front_cpu = roles1.get("front/server", 0.0) - roles0.get("front/server", 0.0)
        return {
            "turns_per_s": load["turns_per_s"],
            "server_cores": load["server_cores"],
            "client_cores": load["client_cores"],
            "cpu_ms_per_turn_by_process": per_turn,
            # the front's own process (the whole server in the bare arm)
            "front_cores": front_cpu / load["seconds"],
        }


def run_load(
    ctx: SpawnContext,
    urls: list[str],
    *,
    clients: int,
    warmup_s: float,
    duration_s: float,
    cpu_of: Callable[[], float],
) -> dict[str, float]:
    """Keep a session per URL busy from ``clients`` processes; turns/s and cores used
    (``cpu_of()`` reads the server side's CPU seconds so far)."""
    pipes, procs = [], []
    for i in range(clients):
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_client_main, args=(urls[i::clients], warmup_s, duration_s, send))
        proc.start()
        pipes.append(receive)
        procs.append(proc)
    time.sleep(warmup_s)
    server_cpu0 = cpu_of()
    turns, seconds, client_cpu = 0, 0.0, 0.0
    for receive, proc in zip(pipes, procs):
        if not receive.poll(duration_s + 120):
            raise RuntimeError("a load client did not finish")
        n, s, c = receive.recv()
        turns += n
        seconds = max(seconds, s)
        client_cpu += c
        proc.join(10)
    server_cpu = cpu_of() - server_cpu0
    return {
        "turns_per_s": turns / seconds,
        "server_cores": server_cpu / seconds,
        "client_cores": client_cpu / seconds,
        "seconds": seconds,
    }


def _tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) used so far by ``root`` and every process under it."""
    return sum(_tree_cpu_by_name(root).values())


def _tree_cpu_by_name(root: int) -> dict[str, float]:
    """CPU seconds so far of ``root`` and every process under it, summed by process name
    (``/proc/PID/comm``; the workers name themselves ``dx-worker<i>`` and ``dx-engine``)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            with contextlib.suppress(OSError), open(f"/proc/{entry}/comm") as f:
                name = f.read().strip()
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, name)
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, _) in stats.items():
            if ppid == parent and pid not in tree:
                tree.add(pid)
                frontier.append(pid)
    by_name: dict[str, float] = {}
    for pid in tree:
        if pid in stats:
            _, cpu, name = stats[pid]
            role = "front/server" if pid == root else name
            by_name[role] = by_name.get(role, 0.0) + cpu
    return by_name


def run(
    quick: bool = False,
    *,
    sessions: int = 64,
    clients: int = 2,
    rounds: int | None = None,
    duration_s: float | None = None,
    warmup_s: float = 1.0,
    pair: bool = False,
) -> dict[str, Any]:
    """The turn form; ``pair`` adds the ``bare x2`` arm (two independent servers)."""
    ctx = multiprocessing.get_context("spawn")
    rounds = rounds or (2 if quick else 3)
    duration_s = duration_s or (3.0 if quick else 6.0)
    arms: dict[str, tuple[Callable[..., None], tuple[object, ...]]] = {
        "bare": (_bare_main, ()),
        "workers=1": (_workers_main, (1,)),
        "workers=2": (_workers_main, (2,)),
    }
    if pair:
        arms["bare x2"] = (_bare_pair_main, ())
    per_round: list[dict[str, dict[str, Any]]] = []
    for r in range(rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        figures = {}
        for name in order:
            target, args = arms[name]
            figures[name] = _measure(
                ctx,
                target,
                args,
                sessions=sessions,
                clients=clients,
                warmup_s=warmup_s,
                duration_s=duration_s,
            )
        per_round.append(figures)

    def median_ratio(arm: str, base: str) -> float:
        return cast(
            float, statistics.median(f[arm]["turns_per_s"] / f[base]["turns_per_s"] for f in per_round)
        )

    def per_core_ratio(arm: str, base: str) -> float:
        return round(
            cast(
                float,
                statistics.median(
                    (f[arm]["turns_per_s"] / f[arm]["server_cores"])
                    / (f[base]["turns_per_s"] / f[base]["server_cores"])
                    for f in per_round
                ),
            ),
            3,
        )

    def per_arm(key: str, digits: int) -> dict[str, list[float]]:
        return {arm: [round(f[arm][key], digits) for f in per_round] for arm in arms}

    return {
        "name": "workers",
        "params": {
            "sessions": sessions,
            "clients": clients,
            "rounds": rounds,
            "duration_s": duration_s,
            "outputs_per_turn": 1 + len(SCRIPT.tokens) + SCRIPT.audio_packets + 1,
            "cpus": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(),
        },
        "turns_per_s": per_arm("turns_per_s", 1),
        # cores busy while measuring: the server's process tree, and the load clients
        "server_cores": per_arm("server_cores", 2),
        "client_cores": per_arm("client_cores", 2),
        # what one turn costs the server's processes, whatever share of the machine they got
        "server_cpu_ms_per_turn": {
            arm: [round(1000 * f[arm]["server_cores"] / f[arm]["turns_per_s"], 2) for f in per_round]
            for arm in arms
        },
        # where a turn's CPU goes: the front (or the whole bare server), each worker, the engine
        "cpu_ms_per_turn_by_process": {
            arm: [f[arm]["cpu_ms_per_turn_by_process"] for f in per_round] for arm in arms
        },
        # Turns per second per core the server side used: equal for one and two workers means
        # throughput grows linearly with the cores the workers get (what a 2-core machine that
        # also runs the load cannot show as raw turns/s).
        "turns_per_server_core_s": {
            arm: [round(f[arm]["turns_per_s"] / f[arm]["server_cores"], 1) for f in per_round] for arm in arms
        },
        # The goal of issue 32 item 3: two workers' turns per server core-second over one
        # worker's, median of the per-round ratios (>= 0.95).
        "per_core_ratio_2_vs_1_workers": per_core_ratio("workers=2", "workers=1"),
        # The same for two servers that share nothing: what the host itself allows two processes.
        **({"per_core_ratio_bare_x2_vs_bare": per_core_ratio("bare x2", "bare")} if pair else {}),
        "front_cores": {
            arm: [round(f[arm]["front_cores"], 4) for f in per_round]
            for arm in arms
            if arm.startswith("workers")
        },
        "ratio_vs_bare": {arm: round(median_ratio(arm, "bare"), 3) for arm in arms if arm != "bare"},
        "ratio_2_vs_1_workers": round(median_ratio("workers=2", "workers=1"), 3),
    }


def run_realtime(
    quick: bool = False,
    *,
    clients: int = 2,
    realtime_start: int = 40,
    duration_s: float | None = None,
    warmup_s: float = 2.0,
    max_sessions: int = 3000,
) -> dict[str, Any]:
    """Real-time capacity per arm (see the module docstring): N grows by REALTIME_STEP from
    ``realtime_start`` until the server falls behind."""
    ctx = multiprocessing.get_context("spawn")
    duration_s = duration_s or (3.0 if quick else 5.0)
    arms: dict[str, tuple[Callable[..., None], tuple[object, ...]]] = {
        "bare": (_bare_main, ()),
        "workers=1": (_workers_main, (1,)),
        "workers=2": (_workers_main, (2,)),
    }
    steps: dict[str, list[dict[str, Any]]] = {}
    capacity: dict[str, int] = {}
    for name, (target, args) in arms.items():
        steps[name] = []

        def kept_up(
            n: int, name: str = name, target: Callable[..., None] = target, args: tuple[object, ...] = args
        ) -> bool:
            step = _measure_realtime(
                ctx, target, args, sessions=n, clients=clients, warmup_s=warmup_s, duration_s=duration_s
            )
            steps[name].append(step)
            return cast(bool, step["kept_up"])

        # Down by halves while the start is too many, then up by REALTIME_STEP until a step
        # falls behind, then halve the gap twice: the capacity is known to within ~5%.
        ok, failed = 0, None
        n = realtime_start
        while n >= 2 and not kept_up(n):
            failed, n = n, n // 2
        if n >= 2:
            ok, n = n, int(n * REALTIME_STEP)
            while failed is None or n < failed:
                if n > max_sessions:
                    break
                if not kept_up(n):
                    failed = n
                    break
                ok, n = n, int(n * REALTIME_STEP)
        for _ in range(2 if failed is not None and ok else 0):
            assert failed is not None  # (the range is empty otherwise)
            middle = (ok + failed) // 2
            if middle in (ok, failed):
                break
            if kept_up(middle):
                ok = middle
            else:
                failed = middle
        capacity[name] = ok
    base = capacity["workers=1"]
    return {
        "name": "workers_realtime",
        "params": {
            "clients": clients,
            "duration_s": duration_s,
            "warmup_s": warmup_s,
            "chunk_ms": REALTIME_CHUNK_S * 1000,
            "probe_rtt_p99_limit_ms": REALTIME_RTT_P99_S * 1000,
            "step": REALTIME_STEP,
            "cpus": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(),
        },
        "capacity_sessions": capacity,
        # Each capacity is known to within ~5% (see above), so a ratio to within ~10%.
        "ratio_2_vs_1_workers": round(capacity["workers=2"] / base, 3) if base else None,
        "ratio_1_worker_vs_bare": round(base / capacity["bare"], 3) if capacity["bare"] else None,
        "steps": steps,
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--realtime" in args:
        print(json.dumps(run_realtime(quick="--quick" in args), indent=2))
        sys.exit(0)
    if "--front" in args:
        front_options: dict[str, Any] = {}
        for flag, key, kind in (("--sessions", "sessions", int), ("--duration", "duration_s", float)):
            if flag in args:
                front_options[key] = kind(args[args.index(flag) + 1])
        print(json.dumps(run_front(**front_options), indent=2))
        sys.exit(0)
    options: dict[str, Any] = {"quick": "--quick" in args, "pair": "--pair" in args}
    for flag, key, kind in (
        ("--sessions", "sessions", int),
        ("--clients", "clients", int),
        ("--rounds", "rounds", int),
        ("--duration", "duration_s", float),
    ):
        if flag in args:
            options[key] = kind(args[args.index(flag) + 1])
    print(json.dumps(run(**options), indent=2))
