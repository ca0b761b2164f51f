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
two cores as it can (0.57 ms of CPU per turn against 1.4 ms with the websockets library client
it replaced, measured side by side at load 4). Two load processes by default: with one, its
single loop was what limited the two-worker arm. Turns per second is counted across all of
them. Arms run back to back in each round, in alternating order, and the ratio reported is the median over rounds of the per-round
ratio (machine speed drifts between rounds on a shared machine; a ratio within one round does
not).

``python -m duplex_actors.bench.workers_bench [--quick]`` prints the result as JSON.
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
from typing import Any

from ..engines.scripted import Script, ScriptedEngine

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


def unpaced_engine() -> ScriptedEngine:  # module level: picklable into the engine process
    return ScriptedEngine(SCRIPT, record=False)


# --------------------------------------------------------------------------- the servers


def _bare_main(ready) -> None:
    async def main() -> None:
        from ..actors.runtime import Runtime
        from ..server.app import RealtimeServer, ServerConfig

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        async with Runtime(unpaced_engine()) as runtime:
            async with RealtimeServer(runtime, ServerConfig(port=0)) as server:
                ready.send(server.port)
                await stop.wait()

    asyncio.run(main())


def _workers_main(workers: int, ready) -> None:
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


async def _read_until(ws, marker: bytes, tail: bytes) -> bytes:
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


def _client_main(urls: list[str], warmup_s: float, duration_s: float, result) -> None:
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


def _measure(ctx, target, args, *, sessions: int, clients: int, warmup_s: float, duration_s: float) -> float:
    ready_recv, ready_send = ctx.Pipe(duplex=False)
    server = ctx.Process(target=target, args=(*args, ready_send))
    server.start()
    try:
        if not ready_recv.poll(120):
            raise RuntimeError(f"{target.__name__} did not start")
        url = f"ws://127.0.0.1:{ready_recv.recv()}/v1/realtime"
        roles0: dict[str, float] = {}

        def cpu_of() -> float:  # the first call is the start of the window
            roles = _tree_cpu_by_name(server.pid)
            if not roles0:
                roles0.update(roles)
            roles1.update(roles)
            return sum(roles.values())

        roles1: dict[str, float] = {}
        load = run_load(
            ctx, [url] * sessions, clients=clients, warmup_s=warmup_s, duration_s=duration_s, cpu_of=cpu_of
        )
        turns = load["turns_per_s"] * load["seconds"]
        per_turn = {
            role: round(1000 * (roles1[role] - roles0.get(role, 0.0)) / turns, 3) for role in roles1 if turns
        }
        return {
            "turns_per_s": load["turns_per_s"],
            "server_cores": load["server_cores"],
            "client_cores": load["client_cores"],
            "cpu_ms_per_turn_by_process": per_turn,
        }
    finally:
        os.kill(server.pid, signal.SIGTERM)
        server.join(30)
        if server.is_alive():
            server.kill()
            server.join(5)


def run_load(
    ctx, urls: list[str], *, clients: int, warmup_s: float, duration_s: float, cpu_of
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
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    rounds = rounds or (2 if quick else 3)
    duration_s = duration_s or (3.0 if quick else 6.0)
    arms = {"bare": (_bare_main, ()), "workers=1": (_workers_main, (1,)), "workers=2": (_workers_main, (2,))}
    per_round: list[dict[str, float]] = []
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
        return statistics.median(f[arm]["turns_per_s"] / f[base]["turns_per_s"] for f in per_round)

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
        "ratio_vs_bare": {arm: round(median_ratio(arm, "bare"), 3) for arm in arms if arm != "bare"},
        "ratio_2_vs_1_workers": round(median_ratio("workers=2", "workers=1"), 3),
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    options: dict[str, Any] = {"quick": "--quick" in args}
    for flag, key, kind in (
        ("--sessions", "sessions", int),
        ("--clients", "clients", int),
        ("--rounds", "rounds", int),
        ("--duration", "duration_s", float),
    ):
        if flag in args:
            options[key] = kind(args[args.index(flag) + 1])
    print(json.dumps(run(**options), indent=2))
