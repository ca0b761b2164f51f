"""``python -m duplex_actors.scaleout.ray_serve`` (the multi-node deploy command of
docs/scale-out.md) against the tests' running Ray cluster, from its own process: deploy, ask
``GET /route``, run a turn on the replica it names, then ``--shutdown``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request

import pytest

pytest.importorskip("ray.serve")

from duplex_actors.client import DuplexClient

pytestmark = [pytest.mark.ray, pytest.mark.anyio, pytest.mark.timeout(300)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _deploy_command(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "duplex_actors.scaleout.ray_serve", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow
async def test_deploy_route_turn_and_shutdown_from_the_command_line(ray_cluster):
    from ray import serve

    address = ray_cluster.get_runtime_context().gcs_address
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    try:
        deployed = _deploy_command(
            "--address",
            address,
            "--session-replicas",
            "1",
            "--engine-max-replicas",
            "1",
            "--http-port",
            str(port),
        )
        assert deployed.returncode == 0, deployed.stderr[-3000:]
        assert f"GET http://127.0.0.1:{port}/route" in deployed.stdout
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/route", timeout=30) as response:
            url = json.loads(response.read())["url"]
        async with await DuplexClient.connect(url) as client:
            await client.recv()
            await client.send_audio(b"\x01\x00" * 1600)
            await client.commit()
            await client.create_response()  # GA: a commit alone only adds the audio
            done, _ = await client.wait_for("response.done", timeout=60)
        assert done["response"]["status"] == "completed"
        removed = _deploy_command("--address", address, "--shutdown")
        assert removed.returncode == 0, removed.stderr[-3000:]
        assert "duplex" not in serve.status().applications
    finally:
        serve.shutdown()
