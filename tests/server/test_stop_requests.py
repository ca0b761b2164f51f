"""The stop signals' rule (stop_requests.py): the first asks for a drain, each later one to cut
it short. Over real processes: tests/server/test_drain.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from duplex_actors.server.stop_requests import STOP_SIGNALS, StopRequests


def test_the_first_signal_stops_and_the_next_ones_hurry():
    requests = StopRequests()
    hurried: list[str] = []
    requests.on_hurry(lambda: hurried.append("server"))
    requests.signalled()
    assert requests.stop.is_set() and hurried == []
    requests.signalled()
    requests.signalled()
    assert hurried == ["server", "server"]  # hurrying twice is the caller's no-op
    # Given after the second signal (the server was built late): called at once.
    requests.on_hurry(lambda: hurried.append("late"))
    assert hurried[-1] == "late"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_real_signals_to_this_process_are_counted_not_left_to_their_default(signum):
    if signum not in STOP_SIGNALS:
        pytest.skip("this test process started with SIGHUP ignored (nohup), which is then kept")

    async def main() -> list[str]:
        requests = StopRequests()
        requests.install(asyncio.get_running_loop())
        hurried: list[str] = []
        requests.on_hurry(lambda: hurried.append("hurry"))
        try:
            os.kill(os.getpid(), signum)
            await asyncio.wait_for(requests.stop.wait(), 5)
            os.kill(os.getpid(), signum)  # by default: KeyboardInterrupt, or the process ends
            for _ in range(100):
                if hurried:
                    break
                await asyncio.sleep(0.01)
            return hurried
        finally:
            for s in STOP_SIGNALS:
                asyncio.get_running_loop().remove_signal_handler(s)

    assert asyncio.run(main()) == ["hurry"]


def _hang_up_as_by_default() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def test_a_hang_up_ignored_at_start_nohup_stays_ignored_and_otherwise_is_a_stop_signal():
    program = "from duplex_actors.server.stop_requests import STOP_SIGNALS; print(sorted(STOP_SIGNALS))"
    # Both children start with a hang-up as it is by default, then nohup ignores it for its own:
    # a test run that was itself started under nohup would otherwise pass its ignore on to both.
    started = {
        how: subprocess.run(
            [*prefix, sys.executable, "-c", program],
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=_hang_up_as_by_default,
        ).stdout.strip()
        for how, prefix in (("plain", []), ("nohup", ["nohup"]))
    }
    assert started == {
        "plain": str(sorted([signal.SIGINT, signal.SIGTERM, signal.SIGHUP])),
        "nohup": str(sorted([signal.SIGINT, signal.SIGTERM])),
    }
