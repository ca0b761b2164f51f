"""A bench's server in a child process, so that the server's CPU and the load's are apart."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

SERVER_START_TIMEOUT_S = 120.0


@contextlib.contextmanager
def served_in_child(
    target: Callable[..., None],
    *args: Any,
    name: str,
    daemon: bool = True,
    timeout_s: float = SERVER_START_TIMEOUT_S,
) -> Iterator[str]:
    """Run ``target(ready, *args)`` in a spawned process until the block ends; ``target`` sends
    its port on ``ready`` once it listens. Yields the server's websocket URL; stops the child
    with SIGTERM (then SIGKILL) on the way out. ``daemon=False`` for a server that starts
    processes of its own."""
    ctx = multiprocessing.get_context("spawn")
    ready_recv, ready_send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=target, args=(ready_send, *args), name=name, daemon=daemon)
    child.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not ready_recv.poll(0.1):
            if not child.is_alive():
                raise RuntimeError(f"the {name} server exited with code {child.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {name} server did not start within {timeout_s:g}s")
        yield f"ws://127.0.0.1:{ready_recv.recv()}/v1/realtime"
    finally:
        if child.pid is not None and child.is_alive():
            os.kill(child.pid, signal.SIGTERM)
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join(5)


__all__ = ["SERVER_START_TIMEOUT_S", "served_in_child"]
