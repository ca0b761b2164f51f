"""What server VAD costs a server with many live sessions, one window at a time or in batches.

``python -m duplex_actors.bench.vad_bench [--sessions 40 80] [--rounds 3] [--seconds 6]`` runs
``serve``'s assembly in this process (scripted engine, ``open_server``) and, in a second
process, the live real-time load of ``workers_bench --realtime``: each session streams 20 ms of
quiet noise every 20 ms at the GA wire's 24 kHz through the default server VAD (Silero) and
sends one ``input_audio_buffer.clear`` a second, whose ``cleared`` round trip shows whether the
server keeps up. Three arms, in an order that alternates by round:

* ``batched``: what ``serve`` runs (``vad_batch_window_s`` 10 ms);
* ``one_by_one``: every window scored on its own as its frame is handled (``None``);
* ``no_vad``: sessions without server VAD, the bare baseline: the server's cost of the same
  audio when no VAD runs at all.

Reported per arm: the server's event-loop thread CPU per session-second (ms), the ratio to the
baseline, the probe round trip's p50/p99, and the batcher's windows per batch. Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

from . import workers_bench

ARMS = {"batched": 0.01, "one_by_one": None, "no_vad": "off"}


async def _arm(sessions: int, seconds: float, setting: Any) -> dict[str, Any]:
    from ..server.app import ServerConfig
    from ..server.cli_commands import open_server

    ctx = mp.get_context("spawn")
    vad = setting != "off"
    config = ServerConfig(port=0, server_vad_by_default=vad, vad_batch_window_s=setting if vad else None)
    async with open_server(workers_bench.unpaced_engine(), config) as server:
        url = f"ws://127.0.0.1:{server.port}/v1/realtime"
        recv, send = ctx.Pipe(duplex=False)
        warmup = 2.0
        load = ctx.Process(
            target=workers_bench._realtime_client_main, args=([url] * sessions, warmup, seconds, send)
        )
        load.start()
        try:
            await asyncio.sleep(warmup + 0.5)  # sessions open, then the load's warm-up
            cpu0, wall0 = time.thread_time(), time.perf_counter()
            await asyncio.sleep(seconds - 1.0)  # inside the load's measured window
            cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
            while not recv.poll():
                await asyncio.sleep(0.05)
            result = recv.recv()
        finally:
            load.join(timeout=10)
        rtts = sorted(result["rtts"])
        batcher = server.vad_batcher
        return {
            "loop_cpu_ms_per_session_s": cpu / wall / sessions * 1e3,
            "loop_cores": cpu / wall,
            "probe_p50_ms": rtts[len(rtts) // 2] * 1e3 if rtts else None,
            "probe_p99_ms": rtts[min(len(rtts) - 1, int(len(rtts) * 0.99))] * 1e3 if rtts else None,
            "probes_lost": result["lost"],
            "errors": result["errors"],
            "windows_per_batch": (batcher.windows / batcher.flushes)
            if vad and batcher and batcher.flushes
            else None,
        }


def run(sizes: tuple[int, ...] = (40, 80), rounds: int = 3, seconds: float = 6.0) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": "vad",
        "params": {"sizes": list(sizes), "rounds": rounds, "seconds": seconds},
    }
    for n in sizes:
        runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
        for r in range(rounds):
            order = list(ARMS) if r % 2 == 0 else list(reversed(ARMS))
            for arm in order:
                runs[arm].append(asyncio.run(_arm(n, seconds, ARMS[arm])))
        bare = statistics.median(x["loop_cpu_ms_per_session_s"] for x in runs["no_vad"])
        out[str(n)] = {
            arm: {
                "loop_cpu_ms_per_session_s": [round(x["loop_cpu_ms_per_session_s"], 2) for x in got],
                "ratio_to_no_vad (median)": round(
                    statistics.median(x["loop_cpu_ms_per_session_s"] for x in got) / bare, 2
                ),
                "loop_cores": [round(x["loop_cores"], 2) for x in got],
                "probe_p50_ms": [
                    None if x["probe_p50_ms"] is None else round(x["probe_p50_ms"], 1) for x in got
                ],
                "probe_p99_ms": [
                    None if x["probe_p99_ms"] is None else round(x["probe_p99_ms"], 1) for x in got
                ],
                "probes_lost": [x["probes_lost"] for x in got],
                "errors": [x["errors"] for x in got],
                "windows_per_batch": [
                    None if x["windows_per_batch"] is None else round(x["windows_per_batch"], 1) for x in got
                ],
            }
            for arm, got in runs.items()
        }
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m duplex_actors.bench.vad_bench")
    parser.add_argument("--sessions", type=int, nargs="+", default=[40, 80])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args(argv)
    print(json.dumps(run(tuple(args.sessions), args.rounds, args.seconds), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
