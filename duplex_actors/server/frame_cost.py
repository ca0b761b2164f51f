"""What handling one client frame cost the server, as that client's bill.

The handling pacer (``ServerConfig.frame_handling_s_per_s``) bills each session for the
event-loop time its frames take. The wall clock around a frame also bills it for work that is
not its own:

* a garbage collection that happens to start during the frame walks every tracked object in
  the process. Late in a long-lived process a full one is long enough to bill a session that
  sent a few audio appends past its burst, and to hold its reads back for seconds;
* the reading thread waiting for the GIL while another thread holds it (an in-process engine's
  step), or the OS running another process on the core.

A frame is therefore billed the CPU time of the thread that handled it (``time.thread_time``),
less the full collections that ran on that thread meanwhile (timed by a ``gc`` callback). A full
collection's time is the process's to pace (:mod:`duplex_actors.actors.gc_policy`), not one
client's; the young collections a frame's own allocations set off are its own (the long pauses
are the full ones).

``thread_time`` costs more a call than ``perf_counter``, but two calls a frame (and two a
collection) are a small part of what an audio append costs to handle.
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
    # that sets it off, and stays on its bill (leaving young ones out too let much of a JSON-heavy
    # frame's time go unbilled). A full one walks the whole heap. Under serve's GcPolicy most of
    # it is frozen and the pause is short; an embedder without one, with a large heap not
    # frozen, bills such frames only part of their wall time, the rest being full collections
    # they set off: the price of never billing a client for the size of the heap (see above).
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
