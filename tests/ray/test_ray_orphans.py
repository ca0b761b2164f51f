"""A local Ray cluster that RayEngine started ends with the process that started it.

Ray ends most of its processes with the process that called ``ray.init``, but not all: after
a SIGKILL of that process, ``ray::DashboardAgent`` (~124 MB) and ``ray::RuntimeEnvAgent``
(~84 MB) were still running 40 s later. RayEngine guards the cluster it started
(``duplex_actors/orphan_guard.py``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time

import pytest

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(120)]

_APP = """
import asyncio, sys
from duplex_actors.engines.ray_engine import RayEngine
from duplex_actors.engines.scripted import ScriptedEngine

async def main():
    options = {"num_cpus": 1, "include_dashboard": False, "_temp_dir": sys.argv[1]}
    engine = RayEngine(ScriptedEngine, actor_options={"num_cpus": 0}, init_options=options)
    await engine.start()
    print("ready", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def _state(pid: int) -> str | None:
    """The process's state letter from /proc (None: gone), read independently of the guard."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_an_app_killed_by_sigkill_takes_the_ray_cluster_it_started_with_it():
    temp = tempfile.mkdtemp(prefix="dxray")  # Ray's socket paths must stay short
    app = subprocess.Popen([sys.executable, "-c", _APP, temp], stdout=subprocess.PIPE, text=True)
    try:
        assert any(line.strip() == "ready" for line in app.stdout), "the app did not start"
        time.sleep(1.0)  # the cluster's agents start beside the actor
        tree = psutil.Process(app.pid).children(recursive=True)
        names = {p.name() for p in tree}
        assert "raylet" in names and "gcs_server" in names, names
    finally:
        app.kill()
        app.wait()
    deadline = time.monotonic() + 40
    left = [p for p in tree if _state(p.pid) not in (None, "Z")]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if _state(p.pid) not in (None, "Z")]
    try:
        assert not left, f"outlived their killed owner by 40 s: {[(p.pid, p.name()) for p in left]}"
    finally:
        for p in left:
            p.kill()
        shutil.rmtree(temp, ignore_errors=True)
