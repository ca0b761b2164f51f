"""How the runtime keeps CPython's cyclic garbage collector off the hot path.

Why: a session's long-lived data (its core, mailbox and, above all, its replay journal of
server events) is made of GC-tracked objects. They survive into the oldest generation, and a
full collection walks every one of them with the event loop stopped: with 1,000 real-time
sessions the longest pause was 62-87 ms after three seconds (~150 tracked objects per session,
growing with the journal), against a 20 ms audio chunk (docs/benchmarks.md).

What the policy does, only when a :class:`Runtime` is given one (never on import):

* at start-up it collects once, then ``gc.freeze()``\\ s what exists (modules, the compiled chart,
  the engine): those objects are never scanned again;
* every ``freeze_interval_s`` it runs a young collection (generations 0 and 1: only what was
  allocated since the last freeze, about a millisecond at 1,000 sessions) and freezes the
  survivors. What a session keeps for a
  while (journaled events, its core) therefore moves out of the collector's sight instead of
  piling up in generation 2, so full collections stay small;
* optionally, it sets the generation-0 threshold (measured: raising it made pauses longer).

The price: an object frozen while alive that later becomes *cyclic* garbage is not reclaimed
until the policy is released (plain reference counting still frees everything acyclic). The
runtime's long-lived objects are acyclic: a closed session is freed by reference counting alone
(tests/runtime/test_gc_policy.py checks this), so what can leak is bounded by the cycles that
happen to be alive at a freeze. ``stop`` unfreezes, restores the thresholds and lets a normal
full collection take back anything that was held.

The collector is process-wide: the policy is reference-counted so that two runtimes in one
process share it and the last one to stop restores the settings it found.
"""

from __future__ import annotations

import gc

import anyio
import attrs


@attrs.frozen(slots=True, kw_only=True)
class GcPolicy:
    #: Young collection + freeze this often (s); None freezes only once, at start-up. At
    #: 1,000 real-time sessions the longest collection took 1.3-1.4 ms of CPU at 0.1 s, 2.1-2.7
    #: ms at 0.25 s and 3.6-4.6 ms at 1 s (without the policy: 56-71 ms).
    freeze_interval_s: float | None = 0.1
    #: Generation-0 threshold while the policy is active; None keeps CPython's (700). Raising
    #: it made fewer but longer young collections: 2,000 and 5,000 gave 9-12 ms pauses at a
    #: 1 s interval, against 4 ms at 700, so the default leaves it alone.
    gen0_threshold: int | None = None


_active: list[tuple[int, int, int]] = []  # thresholds found by the first active policy


def start(policy: GcPolicy) -> None:
    """Apply ``policy`` to this process (pair with :func:`stop`)."""
    if not _active:
        found = gc.get_threshold()
        if policy.gen0_threshold is not None:
            gc.set_threshold(policy.gen0_threshold, found[1], found[2])
        gc.collect()
    else:
        found = _active[0]
    _active.append(found)
    gc.freeze()


def stop() -> None:
    """Release one policy; the last one out unfreezes and restores the thresholds."""
    if not _active:
        return
    found = _active.pop()
    if not _active:
        gc.set_threshold(*found)
        gc.unfreeze()


def freeze_young() -> None:
    """Collect the young generations, then move the survivors out of the collector's sight."""
    gc.collect(1)
    gc.freeze()


async def maintain(policy: GcPolicy) -> None:
    """The runtime's task while the policy is active."""
    if policy.freeze_interval_s is None:
        return
    while True:
        await anyio.sleep(policy.freeze_interval_s)
        freeze_young()
