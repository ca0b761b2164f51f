"""The stop signals' rule (stop_requests.py): the first asks for a drain, each later one to cut
it short. Over real processes: tests/server/test_drain.py."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from duplex_actors.server.stop_requests import StopRequests


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


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_real_signals_to_this_process_are_counted_not_left_to_their_default(signum):
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
            for s in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().remove_signal_handler(s)

    assert asyncio.run(main()) == ["hurry"]
