"""What a relayed connection costs under ``serve --workers 2 --tls-cert ... --tls-key ...``.

``python -m duplex_actors.bench.tls_relay_bench [--frames 1500] [--rounds 6]``

Under TLS the front hands each connection to the next worker, and a worker that gets a resume of
the other worker's session relays it there (server/tls_relay.py): the relaying worker then
decrypts, copies and re-encrypts every frame of that connection. This bench measures it with
real processes (the front, two workers, the engine process) and a real TLS client. One session
is opened (on worker 0); each round resumes it on a new connection, which the front hands to
the workers in turn, so the rounds alternate between reaching the owner directly (the baseline,
same run) and being relayed by worker 1. Each round sends ``--frames`` 20 ms appends of 24 kHz
audio (server VAD off, the buffer cleared every 500: the wire path alone), then a heartbeat,
and waits for its ack. Reported: the server's CPU per frame (both workers, from
``/proc/PID/stat``), direct and relayed, the ratio, and the relaying worker's share.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import multiprocessing
import os
import shutil
import signal
import ssl
import statistics
import subprocess
import tempfile
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from .report import print_and_save
from .workers_bench import CLEAR, STREAM, _tree_cpu_by_name, unpaced_engine

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

#: Appends between two clears: the input buffer's byte limit is never met.
CLEAR_EVERY = 500
METRICS_MAX_AGE_S = 1.0  # ServerConfig's default


def _certificate(folder: str) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (the openssl CLI)."""
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl CLI is needed to make the bench's certificate")
    cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def _served_main(cert: str, key: str, ready: Connection[tuple[int, str], Any]) -> None:
    from ..server.workers import WorkerSettings, serve_workers

    banner = io.StringIO()
    with contextlib.redirect_stdout(banner):  # the banner lines are not bench output
        serve_workers(
            2,
            "127.0.0.1",
            0,
            WorkerSettings(
                engine="scripted-unpaced",
                engine_factory=unpaced_engine,
                server_options={"tls_cert": cert, "tls_key": key},
            ),
            # the port, and the banner: it names each worker's own port
            on_ready=lambda port: ready.send((port, banner.getvalue())),
        )


class _Session:
    """The one session the rounds resume, and what resuming it needs."""

    def __init__(self, created: dict[str, Any]) -> None:
        self.id = created["session"]["id"]
        self.token = created["resume_token"]
        self.generation = created.get("generation", 0)
        self.last_seq = created.get("server_event_seq", 0)

    def saw(self, event: dict[str, Any]) -> None:
        seq = event.get("server_event_seq")
        if isinstance(seq, int):
            self.last_seq = max(self.last_seq, seq)
        if event.get("type") == "session.resumed":  # a resume hands out the next generation's token
            self.generation = event.get("generation", self.generation)
            self.token = event.get("resume_token", self.token)


async def _until(ws: ClientConnection, kind: str, session: _Session) -> dict[str, Any]:
    while True:
        event: dict[str, Any] = json.loads(await ws.recv())
        session.saw(event)
        if event["type"] == kind:
            return event
        if event["type"] == "error":
            raise RuntimeError(f"the server refused: {event['error']}")


def _relayed_out(worker_url: str, trust: ssl.SSLContext) -> float:
    """How many connections a worker has relayed to their owner (its own /metrics)."""
    import urllib.request

    base = worker_url.replace("wss://", "https://").rsplit("/v1/realtime", 1)[0]
    with urllib.request.urlopen(base + "/metrics", context=trust, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith('duplex_tls_relays_total{direction="out"}'):
                return float(line.split()[-1])
    return 0.0


async def _relays_now(worker_url: str, trust: ssl.SSLContext) -> float:
    # A server renders /metrics at most once a second (ServerConfig.metrics_max_age_s): read
    # sooner, it would answer the count of the last read.
    await asyncio.sleep(METRICS_MAX_AGE_S + 0.1)
    return await asyncio.to_thread(_relayed_out, worker_url, trust)


async def _rounds(
    url: str, worker_urls: list[str], trust: ssl.SSLContext, pid: int, frames: int, rounds: int
) -> list[dict[str, Any]]:
    from websockets.asyncio.client import connect

    ws = await connect(url, ssl=trust, max_size=None)
    created = json.loads(await ws.recv())
    session = _Session(created)
    await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
    await _until(ws, "session.updated", session)
    relays_before = await _relays_now(worker_urls[1], trust)
    results = []
    for index in range(rounds):
        # A new connection resumes the session (the old one is pushed out): the front's turn
        # decides whether it reaches the owner (worker 0) or worker 1, which relays it.
        old = ws
        ws = await connect(f"{url}?session_id={session.id}", ssl=trust, max_size=None)
        await ws.send(
            json.dumps(
                {
                    "type": "session.resume",
                    "session_id": session.id,
                    "generation": session.generation,
                    "resume_token": session.token,
                    "last_seq": session.last_seq,
                }
            )
        )
        await _until(ws, "session.resumed", session)
        relays_after = await _relays_now(worker_urls[1], trust)
        relayed, relays_before = relays_after > relays_before, relays_after
        with contextlib.suppress(Exception):
            await old.close()
        await asyncio.sleep(0.2)  # the pushed-out connection's close is not this round's work
        before, began = _tree_cpu_by_name(pid), time.perf_counter()
        for sent in range(1, frames + 1):
            await ws.send(STREAM)
            if sent % CLEAR_EVERY == 0:
                await ws.send(CLEAR)
        await ws.send(json.dumps({"type": "heartbeat"}))
        await _until(ws, "heartbeat.ack", session)
        after, wall = _tree_cpu_by_name(pid), time.perf_counter() - began
        spent = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
        workers = {name: cpu for name, cpu in spent.items() if name.startswith("dx-worker")}
        results.append(
            {
                "round": index,
                "path": "relayed" if relayed else "direct",
                "frames": frames,
                "wall_s": round(wall, 3),
                "workers_cpu_us_per_frame": round(sum(workers.values()) / frames * 1e6, 1),
                "by_worker_us_per_frame": {k: round(v / frames * 1e6, 1) for k, v in sorted(workers.items())},
            }
        )
    await ws.close()
    return results


def run(frames: int = 1500, rounds: int = 6) -> dict[str, Any]:
    from websockets.asyncio.client import connect  # noqa: F401  (the server extra is needed)

    folder = tempfile.mkdtemp(prefix="tls-relay-bench-")
    ctx = multiprocessing.get_context("spawn")
    try:
        cert, key = _certificate(folder)
        ready_recv, ready_send = ctx.Pipe(duplex=False)
        server = ctx.Process(target=_served_main, args=(cert, key, ready_send))
        server.start()
        pid = server.pid
        assert pid is not None  # started
        try:
            if not ready_recv.poll(120):
                raise RuntimeError("serve --workers 2 with TLS did not start")
            port, banner = ready_recv.recv()
            url = f"wss://127.0.0.1:{port}/v1/realtime"
            # "worker 0 pid=123 wss://127.0.0.1:PORT/v1/realtime", in worker order
            worker_urls = [line.split()[3] for line in banner.splitlines() if line.startswith("worker ")]
            trust = ssl.create_default_context(cafile=cert)
            results = asyncio.run(_rounds(url, worker_urls, trust, pid, frames, rounds))
        finally:
            os.kill(pid, signal.SIGTERM)
            server.join(30)
            if server.is_alive():
                server.kill()
                server.join(5)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    by_path: dict[str, list[float]] = {"direct": [], "relayed": []}
    for result in results:
        by_path[result["path"]].append(result["workers_cpu_us_per_frame"])
    direct = statistics.median(by_path["direct"]) if by_path["direct"] else None
    relayed = statistics.median(by_path["relayed"]) if by_path["relayed"] else None
    return {
        "name": "tls_relay",
        "params": {"frames": frames, "rounds": rounds},
        "rounds": results,
        "direct_us_per_frame": direct,
        "relayed_us_per_frame": relayed,
        "relayed_over_direct": None if not (direct and relayed) else round(relayed / direct, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--frames", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    report = run(args.frames, args.rounds)
    print_and_save(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
