"""duplex_actors/orphan_guard.py in real processes: owners killed by pid with SIGKILL.

The processes guarded here stand in for vLLM's engine core: a process the owner started and
cannot give a parent-death signal, with a child of its own. tests/vllm/test_vllm_orphans.py
kills an app that runs the real one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from duplex_actors.orphan_guard import _WATCHER, OrphanGuard

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfd and /proc are Linux's")

#: A guarded process with a child of its own. ``ignore``: it notes SIGTERM in a file and goes
#: on, as a process stuck in its shutdown would.
CORE = """
import pathlib, signal, subprocess, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, lambda *_: pathlib.Path(sys.argv[2]).write_text("SIGTERM"))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
print(child.pid, flush=True)
while True:
    time.sleep(1)
"""

#: The owner: starts the core, guards it, says the pids, then waits to be killed. ``stop``: it
#: stops its guard first, as an owner that shut the core down itself does.
OWNER = """
import subprocess, sys, time
from duplex_actors.orphan_guard import OrphanGuard
mode, note, grace, then = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
core = subprocess.Popen([sys.executable, "-c", sys.argv[5], mode, note], stdout=subprocess.PIPE, text=True)
child = int(core.stdout.readline())
guard = OrphanGuard.start([core.pid], label="the test's core", grace_s=grace)
if then == "stop":
    guard.stop()
print("pids", guard.watcher_pid, core.pid, child, flush=True)
time.sleep(3600)
"""


def _running(*pids: int) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(*pids: int, timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _running(*pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _lines(stderr) -> tuple[str, str]:
    """The watcher's two lines: what it stopped, and what it had to kill ("" if nothing)."""
    stderr.seek(0)
    said = [line for line in stderr.read().splitlines() if line.startswith("duplex_actors orphan guard:")]
    stopping = next((line for line in said if "is gone; stopping" in line), "")
    killed = next((line for line in said if ": killed " in line), "")
    return stopping, killed


def _kill_owner(tmp_path: Path, mode: str, grace_s: float, then: str = "wait"):
    """Start an owner, SIGKILL it once its guard runs; (watcher, core, child) pids, its stderr."""
    note = tmp_path / "note"
    stderr = (tmp_path / "stderr").open("w+")
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, mode, str(note), str(grace_s), then, CORE],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    try:
        said = next(line.split() for line in owner.stdout if line.startswith("pids "))
        watcher, core, child = map(int, said[1:])
        if then == "wait":
            assert psutil.Process(watcher).ppid() == owner.pid
    finally:
        owner.kill()
        owner.wait()
    return (watcher, core, child), note, stderr


def test_a_killed_owners_guarded_process_and_its_children_end(tmp_path):
    (watcher, core, child), note, stderr = _kill_owner(tmp_path, "stop-on-term", grace_s=1.0)
    # The core stops on SIGTERM; its child, which no one asked, is killed after the grace.
    assert _wait_gone(core, child, watcher) == []
    stopping, killed = _lines(stderr)
    assert f"({core})" in stopping and f"({child})" in stopping, stopping
    assert f"({child})" in killed and f"({core})" not in killed, killed
    assert not note.exists()


def test_a_guarded_process_that_ignores_sigterm_is_asked_first_then_killed(tmp_path):
    (watcher, core, child), note, stderr = _kill_owner(tmp_path, "ignore", grace_s=0.5)
    assert _wait_gone(core, child, watcher) == []
    assert note.read_text() == "SIGTERM"  # asked before it was killed
    _, killed = _lines(stderr)
    assert f"({core})" in killed and f"({child})" in killed, killed


def test_a_guard_its_owner_stopped_leaves_the_processes_to_the_owner(tmp_path):
    (watcher, core, child), note, stderr = _kill_owner(tmp_path, "stop-on-term", grace_s=0.1, then="stop")
    try:
        assert _running(watcher) == []  # stopped before the owner was killed
        time.sleep(0.5)  # the grace the stopped watcher would have waited, and more
        assert _running(core, child) == [core, child]
        assert not note.exists()
    finally:
        for pid in (core, child):
            os.kill(pid, 9)


def test_a_watcher_whose_owner_is_gone_before_it_looks_stops_its_processes_at_once():
    # Its owner is the process that started it: told another pid, it takes the owner as gone
    # already (reparented), as it would if the owner had died before it looked.
    if os.getpid() == 1:
        pytest.skip("this test process is pid 1, the pid that stands for the gone owner")
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        done = subprocess.run(
            [sys.executable, "-I", _WATCHER, "--owner", "1", "--grace", "1", str(core.pid)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        assert core.wait(timeout=10) == -15  # SIGTERM, its default action
        assert f"({core.pid})" in done.stderr and "killed" not in done.stderr, done.stderr
    finally:
        core.kill()
        core.wait()


def test_nothing_to_guard_starts_no_watcher():
    assert OrphanGuard.start([], label="nothing") is None


def test_without_psutil_no_watcher_is_started(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil raises ImportError
    assert OrphanGuard.start([os.getpid()], label="no psutil") is None
