"""duplex_actors/parent_death.py: the requests it makes of the kernel, in real processes. Its
callers' tests kill real parents: tests/server/test_transcription.py (a recogniser's process)
and tests/server/test_workers.py (serve's front)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

PROGRAM = """
import os, signal, sys
from duplex_actors.parent_death import end_with_parent
print(end_with_parent(signal.SIGUSR1, int(sys.argv[1])), flush=True)
"""


def test_a_child_whose_parent_is_already_gone_exits_at_once():
    # The request covers deaths after it only: a parent that died before is seen by its pid.
    if os.getpid() == 1:
        pytest.skip("this test process is pid 1, the pid that stands for the gone parent")
    done = subprocess.run([sys.executable, "-c", PROGRAM, "1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == "", (done.returncode, done.stdout, done.stderr[-500:])


def test_a_child_whose_parent_lives_is_asked_for_and_goes_on():
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(os.getpid())], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "True", (done.returncode, done.stdout, done.stderr)
