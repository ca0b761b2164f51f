"""SIGINT, SIGTERM and SIGHUP as an operator means them: the first asks for a drain, the next to
cut it short.

A drain lets responses in flight finish (``--drain-timeout-s``), and an operator who pressed
Ctrl-C may not want to wait for that: pressing it again should end the wait, yet still end
every response with its ``response.done`` and every session with ``session.closed``. Left to
Python's defaults, the second signal raised ``KeyboardInterrupt`` in the middle of the drain
(or, for SIGTERM, ended the process at once): clients got close code 1011 and no terminal event.

SIGHUP is a terminal's hang-up (an ssh connection dropped under a ``serve`` started from it):
left to its default, it ended every process at once, mid-sentence, with no terminal event. It
drains instead, unless the process started with it ignored (``nohup``), which is then kept.

Every ``serve`` process keeps these handlers until it exits: the single process, the front and
each worker of ``--workers`` (the engine process has its own rule: it stays while a worker is
connected, see workers.py).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable


def _stop_signals() -> tuple[signal.Signals, ...]:
    hang_up = getattr(signal, "SIGHUP", None)  # not on Windows
    # Read once, at import, before any handler of ours is installed: an ignored SIGHUP is the
    # disposition the process was started with (nohup), and a child started from it inherits
    # it, so every process of the server decides alike.
    if hang_up is None or signal.getsignal(hang_up) == signal.SIG_IGN:
        return (signal.SIGINT, signal.SIGTERM)
    return (signal.SIGINT, signal.SIGTERM, hang_up)


STOP_SIGNALS = _stop_signals()


class StopRequests:
    """Counts stop signals: :attr:`stop` is set by the first; each later one calls the
    callbacks given to :meth:`on_hurry` (one given after the second is called at once)."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.count = 0
        self._hurry: list[Callable[[], None]] = []

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, self.signalled)

    def on_hurry(self, callback: Callable[[], None]) -> None:
        self._hurry.append(callback)
        if self.count >= 2:
            callback()

    def signalled(self) -> None:
        self.count += 1
        if self.count == 1:
            self.stop.set()
            return
        for callback in self._hurry:
            callback()


__all__ = ["STOP_SIGNALS", "StopRequests"]
