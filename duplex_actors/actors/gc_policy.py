"""How the runtime keeps CPython's cyclic garbage collector off the hot path.

Why: a session's long-lived data (its core, mailbox and, above all, its replay journal of
server events) is made of GC-tracked objects. They survive into the oldest generation, and a
full collection walks every one of them with the event loop stopped: with many real-time
sessions, and a journal that keeps growing, that pause outlasts a 20 ms audio chunk several
times over (docs/benchmarks.md).

What the policy does, only when a :class:`Runtime` is given one (never on import):

* at start-up it collects once, then ``gc.freeze()``\\ s what exists (modules, the compiled chart,
  the engine): those objects are never scanned again;
* every ``freeze_interval_s`` it runs a young collection (generations 0 and 1: only what was
  allocated since the last freeze, a small fraction of a full one) and freezes the
  survivors. What a session keeps for a while (journaled events, its core) therefore moves out
  of the collector's sight instead of piling up in generation 2, so full collections stay small;
* it lowers the generation-0 threshold, so each young collection has less to walk.

The price: an object frozen while alive that later becomes *cyclic* garbage is not reclaimed
while frozen (plain reference counting still frees everything acyclic). The runtime's own
long-lived objects are acyclic: a closed session is freed by reference counting alone
(tests/runtime/test_gc_policy.py checks this). What does form such cycles is a long-lived task
that gets cancelled (its CancelledError, traceback and frames): the barge-in bench (engine
streams cancelled at a high rate) found none under steady load, while the tasks cancelled at
shutdown left many such objects. Those are taken
back when the policy stops (it unfreezes and collects), and a periodic reclaim runs the same
full collection, so a server whose connections come and go stays bounded.

That reclaim walks every object, frozen ones included, with the loop stopped, for a time that
grows with every session held. Run on a clock it froze every stream of a server that was only
holding idle sessions, for nothing: with no churn there is no frozen garbage to find. So it runs
only once the process's resident memory grew by ``reclaim_growth`` (and ``reclaim_min_growth_mb``)
since the last one, checked every ``reclaim_interval_s``: frozen garbage is never freed, so it
shows up as growth; a steady server never pays, a growing one pays as CPython amortises its own
full collections (one per quarter of growth of the heap). Growth is only a proxy, though:
after a resume storm memory has grown with live connections and a reclaim finds next to
nothing. Where the owner can estimate the garbage itself (``garbage_estimate``: serve counts
closed connections not yet freed), that estimate decides instead.

The collector is process-wide: the policy is reference-counted so that two runtimes in one
process share it and the last one to stop restores the settings it found.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable

import anyio
import attrs


@attrs.frozen(slots=True, kw_only=True)
class GcPolicy:
    """How the runtime keeps CPython's cyclic collector off the hot path: young collections and a
    freeze of what survives, on a schedule, and a full reclaim of frozen garbage only once memory
    has grown (module docstring). Process-wide, so opt-in.
    """

    #: Young collection + freeze this often (s); None freezes only once, at start-up. The
    #: more often, the less each collection finds, so the shorter its pause.
    freeze_interval_s: float | None = 0.1
    #: Generation-0 threshold while the policy is active; None keeps CPython's (700). Young
    #: collections are what is left to pause for, and their size is what they cost: a lower
    #: threshold shortens the longest pause, until too low a one sets off more gen-2 passes.
    gen0_threshold: int | None = 300
    #: Consider a reclaim (unfreeze, collect everything, freeze again) this often (s); None:
    #: only at ``stop``. The safety net for cyclic garbage that was frozen while alive (see the
    #: module doc): a server with connection churn freezes dropped connections' cycles, and a
    #: long interval lets them pile up (docs/benchmarks.md, wire soak).
    reclaim_interval_s: float | None = 30.0
    #: ...and run it only if resident memory grew by this fraction of what it was after the
    #: last reclaim, and by at least ``reclaim_min_growth_mb``. It is one full collection, the
    #: very pause the policy avoids, which grows with the heap: 0 and 0 run it at every
    #: interval, as before.
    reclaim_growth: float = attrs.field(default=0.25, validator=attrs.validators.ge(0))
    reclaim_min_growth_mb: float = attrs.field(default=32.0, validator=attrs.validators.ge(0))
    #: Where the owner can tell how much frozen garbage there is (bytes; serve counts the
    #: closed connections not yet freed: server/lingering.py), growth alone no longer buys a
    #: reclaim: memory that grew with live sessions (a resume storm) has nothing to free. The
    #: reclaim then runs once that estimate reaches ``reclaim_min_garbage_mb`` and
    #: ``reclaim_growth`` of resident memory, or, for garbage the estimate cannot see, once
    #: memory grew by ``unseen_growth_mb`` since the last one.
    garbage_estimate: Callable[[], int] | None = attrs.field(default=None, eq=False)
    reclaim_min_garbage_mb: float = attrs.field(default=32.0, validator=attrs.validators.ge(0))
    unseen_growth_mb: float = attrs.field(default=1024.0, validator=attrs.validators.ge(0))


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
        gc.collect()  # what was frozen while alive and died in a cycle (cancelled tasks)


def freeze_young() -> None:
    """Collect the young generations, then move the survivors out of the collector's sight."""
    gc.collect(1)
    gc.freeze()


def reclaim() -> int:
    """A full collection of everything, frozen objects included; returns what it found."""
    gc.unfreeze()
    found = gc.collect()
    gc.freeze()
    return found


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux), or None where it cannot be read cheaply."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def reclaim_due(
    policy: GcPolicy, resident: int | None, after_last: int | None, garbage: int | None = None
) -> bool:
    """Whether a reclaim is worth its pause. Without an estimate of the garbage: memory grew
    enough since the last one (always, where memory cannot be read). With one (``garbage``,
    bytes): that garbage is enough, or memory grew by ``unseen_growth_mb``."""
    if resident is None or after_last is None:
        return True
    if garbage is not None:
        if garbage >= max(policy.reclaim_min_garbage_mb * _MIB, policy.reclaim_growth * resident):
            return True
        return resident - after_last >= policy.unseen_growth_mb * _MIB
    floor = policy.reclaim_min_growth_mb * _MIB
    return resident - after_last >= max(floor, policy.reclaim_growth * after_last)


_MIB = 1 << 20


async def maintain(policy: GcPolicy) -> None:
    """The runtime's task while the policy is active."""
    interval = policy.freeze_interval_s
    if interval is None and policy.reclaim_interval_s is None:
        return
    step = min(x for x in (interval, policy.reclaim_interval_s) if x is not None)
    next_reclaim = anyio.current_time() + (policy.reclaim_interval_s or math.inf)
    after_last = resident_bytes()
    while True:
        await anyio.sleep(step)
        if anyio.current_time() >= next_reclaim:
            garbage = policy.garbage_estimate() if policy.garbage_estimate is not None else None
            if reclaim_due(policy, resident_bytes(), after_last, garbage):
                reclaim()
                after_last = resident_bytes()
            elif interval is not None:
                freeze_young()
            next_reclaim = anyio.current_time() + (policy.reclaim_interval_s or math.inf)
        elif interval is not None:
            freeze_young()
