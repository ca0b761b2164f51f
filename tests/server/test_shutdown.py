"""`duplex-actors serve` as a real process under SIGTERM, and its always-on supervision."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import time

import anyio
import pytest
from typer.testing import CliRunner
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from duplex_actors import Script
from duplex_actors.server.app import CLOSE_GOING_AWAY

from .conftest import CHUNK_100MS, recv_json, recv_until, running_server, serve_app
from .test_cli import LAUNCH

pytestmark = [pytest.mark.timeout(60)]


async def _read_to_close(ws, limit: int = 2000) -> list[dict]:
    events = []
    try:
        with anyio.fail_after(20):
            for _ in range(limit):
                events.append(json.loads(await ws.recv()))
    except ConnectionClosed:
        return events
    raise AssertionError("the server never closed the connection")


@pytest.mark.anyio
async def test_sigterm_drains_every_response_closes_every_session_then_closes_1001():
    command = [
        sys.executable,
        "-c",
        LAUNCH,
        "serve",
        "--engine",
        "scripted",
        "--port",
        "0",
        "--drain-timeout-s",
        "0.3",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with anyio.fail_after(30):
            line = await anyio.to_thread.run_sync(proc.stdout.readline)
        url = line.split()[2]
        talking, idle = [], []
        for _i in range(3):
            ws = await connect(url)
            await recv_json(ws)
            talking.append(ws)
            await ws.send(
                json.dumps(
                    {"type": "input_audio_buffer.append", "audio": base64.b64encode(CHUNK_100MS).decode()}
                )
            )
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "response.create"}))  # GA: a commit alone creates none
            await recv_until(ws, "response.created", timeout=10)
        ws = await connect(url)
        await recv_json(ws)
        idle.append(ws)
        # The scripted engine of `serve` speaks for ~0.8 s: a 0.3 s drain cuts these short.
        proc.send_signal(signal.SIGTERM)
        for ws in talking + idle:
            events = await _read_to_close(ws)
            types = [e["type"] for e in events]
            assert types[-1] == "session.closed" and events[-1]["reason"] == "runtime_shutdown", types
            assert types.count("session.closed") == 1
            assert types.count("response.done") == (1 if ws in talking else 0), types
            assert ws.close_code == CLOSE_GOING_AWAY
        code = await anyio.to_thread.run_sync(lambda: proc.wait(timeout=15))
        assert code == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_supervises_by_default():
    app = serve_app()
    assert CliRunner().invoke(app, ["serve", "--help"]).exit_code == 0
    serve = next(c for c in app.registered_commands if c.name in (None, "serve")).callback
    import inspect

    options = inspect.signature(serve).parameters
    for name in (
        "stall_timeout_s",
        "write_timeout_s",
        "max_sessions_per_key",
        "max_sessions_per_address",
        "max_detached_sessions",
        "drain_timeout_s",
    ):
        assert name in options
    assert options["stall_timeout_s"].default.default == 15.0  # the watchdog is on unless asked off


@pytest.mark.anyio
async def test_a_hung_engine_ends_the_turn_failed_over_the_wire_and_the_lease_can_expire():
    hung = Script(token_latency_s=0.005, hang_after=3)
    async with running_server(
        hung, runtime_kw={"stall_timeout_s": 0.5}, session_overrides={"disconnect_grace_s": 0.3}
    ) as server:
        ws = await connect(server.url)
        created = await recv_json(ws)
        sid = created["session"]["id"]
        began = time.perf_counter()
        await ws.send(
            json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(CHUNK_100MS).decode()})
        )
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))  # GA: a commit alone creates none
        events = await recv_until(ws, "response.done", timeout=10)
        assert events[-1]["response"]["status"] == "failed"
        assert time.perf_counter() - began < 5
        handle = server.runtime.get(sid)
        assert handle.core.lease.in_flight == 0
        ws.transport.abort()  # and, dropped, the session expires after its grace
        with anyio.fail_after(5):
            while handle.state != "closed":
                await anyio.sleep(0.01)
        assert handle.core.close_reason == "disconnect_grace_expired"


@pytest.mark.anyio
async def test_lease_expiry_is_late_by_at_most_one_second_with_the_default_reaper():
    grace = 0.2
    async with running_server(session_overrides={"disconnect_grace_s": grace}) as server:
        lateness = []
        for _ in range(3):
            ws = await connect(server.url)
            sid = (await recv_json(ws))["session"]["id"]
            handle = server.runtime.get(sid)
            ws.transport.abort()
            with anyio.fail_after(5):
                while not handle.core.lease.detached:
                    await anyio.sleep(0.002)
            detached_at = time.perf_counter()
            with anyio.fail_after(10):
                while handle.state != "closed":
                    await anyio.sleep(0.005)
            lateness.append(time.perf_counter() - detached_at - grace)
        # The reaper runs every 0.5 s (it ran every 5 s): late by half a second, and the
        # rest is room for a pause of this process (a full collection late in a CI run).
        assert max(lateness) <= 1.5, lateness
