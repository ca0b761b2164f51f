"""What handling one client frame cost the server, as that client's bill.

The handling pacer (``ServerConfig.frame_handling_s_per_s``) bills each session for the
event-loop time its frames take. The wall clock around a frame also bills it for work that is
not its own:

* a garbage collection that happens to start during the frame walks every tracked object in
  the process. Late in a long-lived process a full one takes hundreds of milliseconds: in CI a
  session that sent eight audio appends and one heartbeat was billed ~0.47 s, over its 0.25 s
  burst, and its reads were held back 4.4 s;
* the reading thread waiting for the GIL while another thread holds it (an in-process engine's
  step), or the OS running another process on the core.

A frame is therefore billed the CPU time of the thread that handled it (``time.thread_time``),
less the full collections that ran on that thread meanwhile (timed by a ``gc`` callback). A full
collection's time is the process's to pace (:mod:`duplex_actors.actors.gc_policy`), not one
client's; the young collections a frame's own allocations set off are its own (every pause over
50 ms in the test suite was a full one).

``thread_time`` costs ~0.6 us a call here against ~0.05 us for ``perf_counter``: two calls a
frame (1.8 us with the bookkeeping), under 1 % of what an audio append costs to handle, and two
a collection.
"""

from __future__ import annotations

import gc
import threading
import time


class _CollectorTime(threading.local):
    """Seconds of garbage collection run on the current thread, in all."""

    began = 0.0
    total = 0.0


_collector = _CollectorTime()
_users = 0  # install() calls not yet undone: the callback is process-wide


def _on_collection(phase: str, info: dict[str, int]) -> None:
    # Only full collections: a young one walks what was allocated lately, mostly by the frame
    # that sets it off, and stays on its bill (frames of ~10,000 tiny JSON values: 10-16 % of
    # their wall time went unbilled when young ones were left out too, 1-2 % now). A full one
    # walks the whole heap. Under serve's GcPolicy most of it is frozen and the pause is short;
    # an embedder without one, holding 1.1 M objects not frozen, bills such frames 32-40 % of
    # their wall time, the rest being full collections they set off: the price of never billing
    # a client for the size of the heap (the 4.4 s above).
    if info["generation"] != 2:
        return
    # In CPU time too: a collection's wall time also holds what the thread waited, and taking
    # that off would take some of the frame's own work off its bill.
    if phase == "start":
        _collector.began = time.thread_time()
    else:
        _collector.total += time.thread_time() - _collector.began


def install() -> None:
    """Start timing collections (pair with :func:`uninstall`); servers in one process share it."""
    global _users
    if _users == 0:
        gc.callbacks.append(_on_collection)
    _users += 1


def uninstall() -> None:
    global _users
    if _users == 0:
        return
    _users -= 1
    if _users == 0:
        gc.callbacks.remove(_on_collection)


Mark = tuple[float, float]


def mark() -> Mark:
    """Where the current thread stands, before a frame is handled."""
    return time.thread_time(), _collector.total


def billed_since(start: Mark) -> float:
    """Seconds to bill for what the current thread did since ``start``: its CPU time less the
    collections that ran on it."""
    cpu, collected = start
    return time.thread_time() - cpu - (_collector.total - collected)


def billable_clock() -> float:
    """The current thread's CPU seconds less its full collections: differences of two readings
    are what :func:`billed_since` would bill."""
    return time.thread_time() - _collector.total
