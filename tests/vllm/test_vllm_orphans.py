"""vLLM's engine-core processes end with the process that runs them, however it ends.

vLLM starts its engine core (and the core its workers) as processes of their own. Killed by
SIGKILL, the process that ran ``AsyncLLM`` runs no shutdown, and before the orphan guard
(``duplex_actors/orphan_guard.py``) the engine core and its worker lived on: about 2.1 GB
here with the tiny test model, the whole GPU on a real deployment.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.vllm

_APP = """
import asyncio, sys
from duplex_actors.engines.vllm_engine import VllmEngine

async def main():
    engine = VllmEngine(sys.argv[1], max_model_len=256, max_num_seqs=4, kv_cache_space_gib=1)
    await engine.start()
    print("ready", engine.orphan_guard.watcher_pid, *engine.engine_process_ids(), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def _running(processes: list) -> list:
    """Those still running, read from /proc (not through psutil, which the guard uses): an
    ended process is gone, or a zombie (state Z) until its new parent reaps it."""
    alive = []
    for process in processes:
        try:
            with open(f"/proc/{process.pid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        if state != "Z":
            alive.append(process)
    return alive


def test_an_app_killed_by_sigkill_takes_vllms_engine_processes_with_it(tiny_model_path):
    app = subprocess.Popen(
        [sys.executable, "-c", _APP, str(tiny_model_path)], stdout=subprocess.PIPE, text=True
    )
    engine_tree: list = []
    watcher = None
    try:
        line: list[str] = []
        for text in app.stdout:  # vLLM logs to stdout too
            line = text.split()
            if line[:1] == ["ready"]:
                break
        assert line[:1] == ["ready"], "the app did not start its engine"
        watcher, *cores = (psutil.Process(int(pid)) for pid in line[1:])
        assert cores, "vLLM ran no engine-core process"
        engine_tree = [*cores, *(child for core in cores for child in core.children(recursive=True))]
        assert len(_running(engine_tree)) == len(engine_tree)
        assert watcher.ppid() == app.pid
    finally:
        app.kill()
        app.wait()
    deadline = time.monotonic() + 30
    assert watcher is not None
    while _running([*engine_tree, watcher]) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [f"{p.name()} ({p.pid})" for p in _running(engine_tree)]
    assert not left, f"outlived their killed owner by 30 s: {left}"
    assert not _running([watcher]), "the watcher stays after its work is done"
