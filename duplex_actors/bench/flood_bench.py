"""One client floods invalid frames and never reads: what it costs the server and a neighbour.

``python -m duplex_actors.bench.flood_bench [--frames 100000] [--policy on|off]`` runs an
in-process server (scripted engine paced like ``serve``'s), times a neighbour's turn with no
flood (the baseline, same run), starts a raw-socket client that sends ``--frames`` invalid
text frames with a 4 KiB receive buffer it never reads, times the neighbour's turn again
during the flood, and reports the server process's RSS before and after. ``--policy off``
sets a flood budget no client reaches, to measure the error bounds on their own.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import time

from .soak import rss_mb


async def _turn(url: str) -> float:
    from websockets.asyncio.client import connect

    async with connect(url) as ws:
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


async def _run(frames: int, policy: bool) -> dict:
    from ..actors.runtime import Runtime
    from ..engines.scripted import Script, ScriptedEngine
    from ..server.app import RealtimeServer, ServerConfig
    from ..testing.raw_websocket import RawWebSocket

    budget = {} if policy else {"invalid_frames_per_s": 1e9, "invalid_frames_burst": 10**9}
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m duplex_actors.bench.flood_bench", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--frames", type=int, default=100_000)
    ap.add_argument("--policy", choices=("on", "off"), default="on")
    args = ap.parse_args(argv)
    r = asyncio.run(_run(args.frames, args.policy == "on"))
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
