"""Runtime benchmarks: throughput, session scale, real-time load, barge-in stop latency.

Every figure is printed next to a *bare* baseline measured in the same run, on the same loop,
and the ratio between them (``ratio = runtime / bare``). These machines are shared and noisy:
absolute microseconds drift from run to run, ratios much less. Nothing here is a pass/fail
test; a target that is missed is reported as missed.

Each ``bench_*`` function returns a plain dict (JSON-able)::

    {"name": ..., "params": {...}, "figures": [Figure, ...], "series": {...for plots}}

The engines used here are scripted (no model): the point is the runtime's own share.
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import json
import math
import os
import random
import subprocess
import sys
import time
import tracemalloc
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any, cast

import anyio
import anyio.abc
import anyio.lowlevel

from ..core import commands as cmd
from ..core.engine_io import AudioPacket, Decision, EngineOutput, ModelTurnRequest, TextDelta, TurnDone
from ..core.events import AudioDeltaEvent, ResponseDone, TextDeltaEvent
from ..core.session import SessionCore
from ..engines.base import EngineCapabilities
from ..engines.scripted import Script, ScriptedEngine

if TYPE_CHECKING:
    from ..actors.session_handle import SessionHandle

CHUNK_MS = 20
CHUNK = b"\0\0" * (16000 * CHUNK_MS // 1000)  # 20 ms of pcm16 at 16 kHz: 640 bytes
now = time.perf_counter


# --------------------------------------------------------------------------- figures


def figure(
    metric: str,
    value: float | None,
    unit: str,
    baseline: float | None = None,
    baseline_label: str = "",
    *,
    target: str | None = None,
    met: bool | None = None,
    higher_is_better: bool = False,
) -> dict[str, Any]:
    """One printed line: runtime value, bare baseline, ratio = value / baseline."""
    ratio = None
    if value is not None and baseline:
        ratio = value / baseline
    return {
        "metric": metric,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "baseline_label": baseline_label,
        "ratio": ratio,
        "target": target,
        "met": met,
        "higher_is_better": higher_is_better,
    }


def percentiles(samples: list[float]) -> dict[str, float | None]:
    """p50/p90/p99/max of samples (in the samples' unit); None when empty."""
    if not samples:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    s = sorted(samples)
    n = len(s)

    def q(p: float) -> float:
        return s[min(n - 1, int(p * n))]

    return {"n": n, "p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "max": s[-1]}


def cdf_points(samples: list[float], points: int = 200) -> list[tuple[float, float]]:
    """A down-sampled empirical CDF [(value, fraction)], small enough for the JSON file."""
    if not samples:
        return []
    s = sorted(samples)
    n = len(s)
    idx = sorted({min(n - 1, int(i * n / points)) for i in range(points)} | {n - 1})
    return [(s[i], (i + 1) / n) for i in idx]


# --------------------------------------------------------------------------- bare baselines


async def _bare_put_get(n: int) -> float:
    """asyncio.Queue put_nowait + get with one consumer task: messages per second."""
    q: asyncio.Queue[int] = asyncio.Queue()
    done = asyncio.Event()

    async def consumer() -> None:
        for _ in range(n):
            await q.get()
        done.set()

    task = asyncio.create_task(consumer())
    t0 = now()
    for i in range(n):
        q.put_nowait(i)
    await done.wait()
    dt = now() - t0
    await task
    return n / dt


async def _bare_ping_pong(n: int) -> float:
    """Request + reply through two asyncio queues: seconds per round trip."""
    req: asyncio.Queue[int | None] = asyncio.Queue()
    rep: asyncio.Queue[int] = asyncio.Queue()

    async def server() -> None:
        while True:
            item = await req.get()
            if item is None:
                return
            rep.put_nowait(item)

    task = asyncio.create_task(server())
    t0 = now()
    for i in range(n):
        req.put_nowait(i)
        await rep.get()
    dt = now() - t0
    req.put_nowait(None)
    await task
    return dt / n


#: Events the runtime sends a client for one turn of the throughput bench (committed, the user
#: item's added + done, response.created, the output item's and content part's added, one text
#: delta, text done, content part done, output item done, and the assistant item's added + done
#: around the response's end, response.done): the bare pipeline sends as many, split the same way.
_TURN_EVENTS = {"commit": 3, "decision": 4, "text": 1, "done": 5}


async def _bare_turns(engine: Any, sessions: int, appends: int, turns: int) -> float:
    """The turn of the throughput bench done by plain asyncio, nothing of ours in the way:
    messages per second, counted as the runtime's are (appends, commit, engine outputs).

    Per session an inbox queue and a task. The driver puts the appends and the commit in; on
    the commit the session task starts a task for the request, which runs the same engine's
    ``generate`` and puts its outputs back into the inbox; the session task puts the turn's
    events (as many as the runtime sends, as tuples) on a queue its consumer task reads. What
    it leaves out is the runtime's own work: the chart, the session's state, the events'
    contents, the journal, the mailbox's lanes and bounds, the engine actor's routing."""
    from ..core.engine_io import ModelTurnRequest, TurnKind
    from ..core.fence import Fence

    loop = asyncio.get_running_loop()
    done_count = 0
    round_done = asyncio.Event()

    async def pump(request: ModelTurnRequest, inbox: asyncio.Queue[Any]) -> None:
        async for output in engine.generate(request):
            inbox.put_nowait(output)

    async def session(i: int, inbox: asyncio.Queue[Any], outbox: asyncio.Queue[tuple[str, Any]]) -> None:
        turn = 0
        audio: list[bytes] = []
        while True:
            message = await inbox.get()
            if type(message) is bytes:
                audio.append(message)
            elif message == "commit":
                turn += 1
                fence = Fence(f"sess_bare{i:016d}", 0, turn)
                request = ModelTurnRequest(fence.request_id(), fence, TurnKind.RESPONSE, b"".join(audio))
                audio.clear()
                loop.create_task(pump(request, inbox))
                kind = "commit"
            else:
                kind = type(message).__name__
                kind = {"Decision": "decision", "TextDelta": "text", "TurnDone": "done"}[kind]
            if type(message) is not bytes:
                for _ in range(_TURN_EVENTS[kind] - 1):
                    outbox.put_nowait((kind, message))
                outbox.put_nowait(("response.done" if kind == "done" else kind, message))

    async def consume(outbox: asyncio.Queue[tuple[str, Any]]) -> None:
        nonlocal done_count
        while True:
            kind, _ = await outbox.get()
            if kind == "response.done":
                done_count += 1
                if done_count == sessions:
                    round_done.set()

    # An inbox holds audio chunks, "commit" and the engine's outputs, as they come.
    inboxes: list[asyncio.Queue[Any]] = [asyncio.Queue() for _ in range(sessions)]
    outboxes: list[asyncio.Queue[tuple[str, Any]]] = [asyncio.Queue() for _ in range(sessions)]
    tasks = [loop.create_task(session(i, inboxes[i], outboxes[i])) for i in range(sessions)]
    tasks += [loop.create_task(consume(q)) for q in outboxes]
    await asyncio.sleep(0)
    t0 = now()
    for _ in range(turns):
        done_count = 0
        round_done = asyncio.Event()
        for inbox in inboxes:
            for _ in range(appends):
                inbox.put_nowait(CHUNK)
            inbox.put_nowait("commit")
        await round_done.wait()
    elapsed = now() - t0
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return sessions * turns * (appends + 1 + 3) / elapsed


# --------------------------------------------------------------------------- a bench engine


class StampingEngine:
    """A scripted engine for the load benchmarks.

    Like :class:`ScriptedEngine` (decision, text, audio, done, configurable pacing) but each
    text delta's text is the ``perf_counter`` time it was produced, so a client can measure
    event delivery lag exactly; and it records when each request reached it (``generate``
    started), when its stream was cancelled and when ``abort`` was called.
    """

    name = "bench-stamping"

    def __init__(self, tokens: int = 3, packets: int = 3, interval_s: float = 0.0) -> None:
        self.tokens = tokens
        self.packets = packets
        self.interval_s = interval_s
        self.capabilities = EngineCapabilities(
            model_native=True, produces_audio=True, max_concurrency=1 << 20
        )
        self.on_request: Callable[[ModelTurnRequest, float], None] | None = None
        self.abort_called: dict[str, float] = {}
        self.stream_cancelled: dict[str, float] = {}
        self._pcm = b"\x01\x00" * 320

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        self.abort_called.setdefault(request_id, now())

    async def generate(self, request: ModelTurnRequest) -> AsyncGenerator[EngineOutput, None]:
        rid = request.request_id
        if self.on_request is not None:
            self.on_request(request, now())
        finished = False
        try:
            yield Decision(rid, speak=True, produced_at=now())
            for i in range(max(self.tokens, self.packets)):
                if self.interval_s:
                    await anyio.sleep(self.interval_s)
                if i < self.tokens:
                    t = now()
                    yield TextDelta(rid, repr(t), 1, produced_at=t)
                if i < self.packets:
                    yield AudioPacket(rid, self._pcm, 16000, produced_at=now())
            finished = True
            yield TurnDone(rid, "completed", None, produced_at=now())
        finally:
            if not finished:
                self.stream_cancelled.setdefault(rid, now())


# --------------------------------------------------------------------------- 1. throughput


async def _throughput(
    sessions: int,
    appends: int,
    turns: int,
    asks: int,
    reps: int,
    gc_policy: Any = "default",
) -> dict[str, Any]:
    """Each phase runs ``reps`` times interleaved with its bare baseline; the best of each is
    kept (other processes on a shared machine only ever make a run slower). The collector runs
    as ``serve`` runs it (``gc_policy``), for the baselines too: the policy is process-wide."""
    from ..actors.gc_policy import GcPolicy
    from ..actors.runtime import Runtime

    if gc_policy == "default":
        gc_policy = GcPolicy()  # what ``serve`` runs with
    engine = ScriptedEngine(Script(tokens=("a",), audio_packets=0))
    best: dict[str, float] = {}

    def keep(key: str, value: float, higher: bool) -> None:
        old = best.get(key)
        if old is None or (value > old if higher else value < old):
            best[key] = value

    async with Runtime(engine, reaper_interval_s=0, gc_policy=gc_policy) as rt:
        handles = [rt.open_session_nowait() for _ in range(sessions)]
        for h in handles:
            h.core.take_events()  # session.created

        async def drained() -> None:
            while rt._ready:
                await anyio.lowlevel.checkpoint()

        async def appends_only() -> float:
            """append (tell) -> statechart, no engine: processed by the caller (an idle session's
            append does not queue: SessionActor.tell_audio); drained() waits for any that did."""
            n = sessions * appends * turns
            t0 = now()
            for _ in range(turns):
                for h in handles:
                    for _ in range(appends):
                        h.append_audio(CHUNK)
                await drained()
            rate = n / (now() - t0)
            for h in handles:
                await h.clear()
                h.core.take_events()
            return rate

        async def full_turns() -> dict[str, float]:
            """appends + commit -> engine submit -> engine outputs -> events to the client."""
            done_count = 0
            round_done = anyio.Event()
            events_seen = 0

            async def consume(h: SessionHandle) -> None:
                nonlocal done_count, events_seen
                async for e in h.events():
                    events_seen += 1
                    if e.type == "response.done":
                        done_count += 1
                        if done_count == sessions:
                            round_done.set()

            before = sum(h.core.counters.commands for h in handles)
            async with anyio.create_task_group() as tg:
                for h in handles:
                    tg.start_soon(consume, h)
                await anyio.lowlevel.checkpoint()
                events_seen = 0
                t0 = now()
                for _ in range(turns):
                    done_count = 0
                    round_done = anyio.Event()
                    for h in handles:
                        for _ in range(appends):
                            h.append_audio(CHUNK)
                        h.tell(cmd.CommitInput())
                    await round_done.wait()
                elapsed = now() - t0
                tg.cancel_scope.cancel()
            commands = sum(h.core.counters.commands for h in handles) - before
            engine_outputs = 3 * sessions * turns  # decision, one text delta, turn done
            return {
                "turn_commands_per_s": commands / elapsed,
                "turn_msgs_per_s": (commands + engine_outputs) / elapsed,
                "turns_per_s": sessions * turns / elapsed,
                "events_per_s": events_seen / elapsed,
            }

        async def ask_round_trip() -> float:
            h = handles[0]
            elapsed = 0.0
            done = 0
            while done < asks:  # in slices, reading the acks so the outbox never fills up
                n = min(500, asks - done)
                t0 = now()
                for _ in range(n):
                    await h.heartbeat()
                elapsed += now() - t0
                done += n
                h.core.take_events()
            return elapsed / asks

        for _ in range(reps):
            keep("bare_put_get_per_s", await _bare_put_get(sessions * appends * turns), True)
            keep("bare_turn_msgs_per_s", await _bare_turns(engine, sessions, appends, turns), True)
            keep("append_msgs_per_s", await appends_only(), True)
            for key, value in (await full_turns()).items():
                keep(key, value, True)
            keep("bare_ping_pong_s", await _bare_ping_pong(asks), False)
            keep("ask_round_trip_s", await ask_round_trip(), False)
            for h in handles:
                h.core.take_events()
    return best


def bench_throughput(
    quick: bool = True,
    sizes: tuple[int, int, int, int, int] | None = None,
    gc_policy: Any = "default",
) -> dict[str, Any]:
    """``sizes``: (sessions, appends per turn, turns, asks, repetitions); ``gc_policy``: the
    collector's policy for the whole run (None: CPython's own collector)."""
    sessions, appends, turns, asks, reps = sizes or (
        (100, 10, 10, 2000, 3) if quick else (500, 10, 20, 10000, 5)
    )
    r = anyio.run(_throughput, sessions, appends, turns, asks, reps, gc_policy)
    figs = [
        figure(
            "append tells processed",
            r["append_msgs_per_s"],
            "msg/s",
            r["bare_put_get_per_s"],
            "asyncio.Queue put_nowait+get",
            higher_is_better=True,
        ),
        figure(
            "turn messages (appends, commit, engine outputs)",
            r["turn_msgs_per_s"],
            "msg/s",
            r["bare_put_get_per_s"],
            "asyncio.Queue put_nowait+get",
            higher_is_better=True,
        ),
        figure(
            "turn messages, against the same turns in plain asyncio",
            r["turn_msgs_per_s"],
            "msg/s",
            r["bare_turn_msgs_per_s"],
            "task + queue per session, task per request, same engine and event count",
            higher_is_better=True,
        ),
        figure(
            f"complete turns ({appends} appends, commit, engine reply, events)",
            r["turns_per_s"],
            "turn/s",
            r["bare_put_get_per_s"] / (appends + 4),
            "queue msgs/s / msgs per turn",
            higher_is_better=True,
        ),
        figure(
            "ask round trip (heartbeat)",
            r["ask_round_trip_s"] * 1e6,
            "us",
            r["bare_ping_pong_s"] * 1e6,
            "asyncio two-queue ping-pong",
        ),
    ]
    return {
        "name": "throughput",
        "params": {
            "sessions": sessions,
            "appends_per_turn": appends,
            "turns": turns,
            "asks": asks,
            "best_of": reps,
            "gc_policy": "GcPolicy (as serve runs)" if gc_policy == "default" else repr(gc_policy),
        },
        "figures": figs,
        "raw": r,
        "series": {},
    }


# --------------------------------------------------------------------------- 2. session scale


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _scale_child(kind: str, steps: list[int]) -> None:
    """Runs in a fresh interpreter (clean RSS): opens sessions in steps, prints JSON."""

    async def bare_worker(q: asyncio.Queue[object]) -> None:
        while True:
            await q.get()

    async def main() -> dict[str, Any]:
        result: dict[str, Any] = {"steps": []}
        keep: list[Any] = []
        gc.collect()
        if kind == "runtime":
            from ..actors.runtime import Runtime

            rt = Runtime(ScriptedEngine(), reaper_interval_s=0)
            await rt.__aenter__()
            open_one: Callable[[], Any] = rt.open_session_nowait
        else:

            def open_one() -> tuple[asyncio.Queue[object], asyncio.Task[None]]:
                q: asyncio.Queue[object] = asyncio.Queue()
                return q, asyncio.create_task(bare_worker(q))

        # warm up code paths and allocator
        for _ in range(50):
            keep.append(open_one())
        await asyncio.sleep(0)
        rss0 = _rss_bytes()
        opened = 0
        elapsed = 0.0
        for target in steps:
            t0 = now()
            while opened < target:
                keep.append(open_one())
                opened += 1
            await asyncio.sleep(0)  # the bare tasks start and park on their queue
            elapsed += now() - t0
            result["steps"].append({"sessions": opened, "seconds": elapsed, "rss_bytes": _rss_bytes() - rss0})
        # heap per session: a second batch under tracemalloc
        n = steps[-1]
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(n):
            keep.append(open_one())
        await asyncio.sleep(0)
        gc.collect()
        result["tracemalloc_bytes_per_session"] = (tracemalloc.get_traced_memory()[0] - before) / n
        tracemalloc.stop()
        return result

    res = asyncio.run(main())
    sys.stdout.write(json.dumps(res) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip tearing down tens of thousands of sessions


def _run_scale_child(kind: str, steps: list[int]) -> dict[str, Any]:
    code = f"from duplex_actors.bench.runtime_bench import _scale_child; _scale_child({kind!r}, {steps!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"scale child {kind} failed: {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def bench_scale(quick: bool = True, sessions: int = 10_000) -> dict[str, Any]:
    steps = sorted({max(1, sessions // 10), sessions // 4, sessions // 2, sessions})
    if not quick:
        steps = sorted(set(steps) | {sessions * 2})
    rt = _run_scale_child("runtime", steps)
    bare = _run_scale_child("bare", steps)
    at = next(s for s in rt["steps"] if s["sessions"] == sessions)
    bt = next(s for s in bare["steps"] if s["sessions"] == sessions)
    us = at["seconds"] / sessions * 1e6
    bus = bt["seconds"] / sessions * 1e6
    heap = rt["tracemalloc_bytes_per_session"]
    bheap = bare["tracemalloc_bytes_per_session"]
    rss = at["rss_bytes"] / sessions
    brss = bt["rss_bytes"] / sessions
    figs = [
        figure(
            f"open {sessions} sessions: time per session",
            us,
            "us",
            bus,
            "asyncio task + queue per session",
            target="<= 50 us",
            met=us <= 50,
        ),
        figure(
            "heap per idle session (tracemalloc)",
            heap / 1024,
            "KiB",
            bheap / 1024,
            "asyncio task + queue per session",
            target="<= 8 KiB",
            met=heap <= 8 * 1024,
        ),
        figure("RSS per idle session", rss / 1024, "KiB", brss / 1024, "asyncio task + queue per session"),
    ]
    return {
        "name": "scale",
        "params": {"sessions": sessions, "steps": steps},
        "figures": figs,
        "raw": {"runtime": rt, "bare": bare},
        "series": {"runtime": rt["steps"], "bare": bare["steps"]},
    }


# --------------------------------------------------------------------------- load driver


class _GcPauses:
    """Time spent in garbage collection while recording (gc.callbacks).

    Wall time is what the event loop lost; it also counts any time the OS took the core away
    mid-collection, which on a loaded machine can be tens of ms. The collector's own CPU time
    (``thread_time``) does not, so both are kept."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self.cpu: list[float] = []
        self.recording = False
        self._t = self._c = 0.0

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t = now()
            self._c = time.thread_time()
        elif self.recording:
            self.pauses.append(now() - self._t)
            self.cpu.append(time.thread_time() - self._c)

    def __enter__(self) -> _GcPauses:
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)

    def summary(self) -> dict[str, float]:
        return {
            "count": len(self.pauses),
            "total_ms": sum(self.pauses) * 1e3,
            "max_ms": max(self.pauses, default=0.0) * 1e3,
            "max_cpu_ms": max(self.cpu, default=0.0) * 1e3,
        }


class _Probe:
    """Times each append from the moment its chunk was due (real cadence) to the moment the
    session core finished processing it.

    Installed by wrapping ``SessionCore.handle`` for the duration of a run (and restored): the
    wrapper adds one dict lookup and a deque pop per command, included in the figures.
    """

    def __init__(self) -> None:
        self.due: dict[str, deque[float]] = {}
        self.from_due: list[float] = []
        self.from_tell: list[float] = []
        self.recording = False
        self._orig: Callable[..., None] | None = None

    def __enter__(self) -> _Probe:
        orig = self._orig = SessionCore.handle
        probe = self

        def handle(core: SessionCore, command: cmd.Command, *, received_at: float | None = None) -> None:
            orig(core, command, received_at=received_at)
            if command.TRIGGER == "append":
                t = now()
                due = probe.due[core.session_id].popleft()
                if probe.recording:
                    probe.from_due.append(t - due)
                    if received_at is not None:
                        probe.from_tell.append(t - received_at)

        # assignment: the wrapper names its first parameter core, where the method has self
        SessionCore.handle = handle  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._orig is not None
        SessionCore.handle = self._orig  # type: ignore[method-assign]


async def _paced(
    slots: list[list[Any]],
    period: float,
    until: float,
    tick: Callable[[int, float], None],
    on_tick: Callable[[float], None] | None = None,
) -> list[float]:
    """Calls ``tick(slot, due_time)`` for each of ``len(slots)`` phase slots per ``period``,
    at real cadence, until ``until``. Returns how late each slot fired (s)."""
    n = len(slots)
    step = period / n
    t0 = now()
    k = 0
    late: list[float] = []
    while True:
        due = t0 + k * step
        # Ends at ``until`` on the wall clock too: an overloaded run drops the chunks it could
        # not send in time (its lateness says so) rather than running on to catch up.
        if due >= until or now() >= until:
            return late
        delay = due - now()
        # Always yield, also when behind: a late driver must not starve the runtime it drives.
        await anyio.sleep(delay if delay > 0 else 0)
        late.append(now() - due)
        tick(k % n, due)
        if on_tick is not None:
            on_tick(now())
        k += 1


async def _paced_recording(
    slots: list[list[Any]], until: float, tick: Callable[[int, float], None], opens: Callable[[float], bool]
) -> tuple[list[float], float, float]:
    """Drives the real-time load (:func:`_paced`, one chunk period) and measures its recording
    window: returns ``(late, cpu_s, wall_s)``, the CPU and wall seconds from the first driver
    tick at which ``opens(tick_time)`` is true (the end of the warm-up) to the driver's end. A
    run with no such tick (a starved machine) is measured over its whole window."""
    cpu0 = wall0 = None

    def mark(t: float) -> None:
        nonlocal cpu0, wall0
        if cpu0 is None and opens(t):
            cpu0, wall0 = time.process_time(), t

    cpu_start, wall_start = time.process_time(), now()
    late = await _paced(slots, CHUNK_MS / 1000, until, tick, mark)
    if cpu0 is None or wall0 is None:  # no tick after the warm-up: whole window
        cpu0, wall0 = cpu_start, wall_start
    cpu = time.process_time() - cpu0
    wall = now() - wall0
    return late, cpu, wall


# --------------------------------------------------------------------------- 3. real-time load


async def _realtime_runtime(
    n: int, seconds: float, warmup: float, turn_s: float, gc_policy: Any = "default"
) -> dict[str, Any]:
    from ..actors.gc_policy import GcPolicy
    from ..actors.runtime import Runtime

    if gc_policy == "default":
        gc_policy = GcPolicy()  # what ``serve`` runs with

    engine = StampingEngine(tokens=3, packets=3, interval_s=0.02)
    commit_told: dict[str, float] = {}
    to_engine: list[float] = []
    delivery: list[float] = []
    errors = 0
    recording = False

    def on_request(request: ModelTurnRequest, t: float) -> None:
        told = commit_told.pop(request.fence.session_id, None)
        if recording and told is not None:
            to_engine.append(t - told)

    engine.on_request = on_request
    slots_n = 20
    with _Probe() as probe, _GcPauses() as gcp:
        async with Runtime(engine, reaper_interval_s=0, gc_policy=gc_policy) as rt:
            handles = [rt.open_session_nowait() for _ in range(n)]
            for h in handles:
                probe.due[h.id] = deque()
            # Each handle with its probe deque, looked up once: the driver's own bookkeeping
            # (the bare arm's is a tuple it puts) is not the runtime's work, and two lookups by
            # session id per chunk (a property chain each) were about a microsecond a chunk.
            slots: list[list[Any]] = [
                [(h, probe.due[h.id]) for h in handles[i::slots_n]] for i in range(slots_n)
            ]
            # stagger commits: session i commits at its own phase of turn_s
            next_commit = {h: i * turn_s / n for i, h in enumerate(handles)}

            async def consume(h: SessionHandle) -> None:
                nonlocal errors
                async for e in h.events():
                    t = now()
                    typ = e.type
                    if typ == "response.output_text.delta":
                        if recording:
                            delivery.append(t - float(cast(TextDeltaEvent, e).delta))
                    elif typ == "error":
                        errors += 1

            start = now()

            def tick(slot: int, due: float) -> None:
                rel = due - start
                for h, dues in slots[slot]:
                    dues.append(due)
                    h.append_audio(CHUNK)
                    if rel >= next_commit[h]:
                        next_commit[h] += turn_s
                        commit_told[h.id] = now()
                        h.tell(cmd.CommitInput())

            async with anyio.create_task_group() as tg:
                for h in handles:
                    tg.start_soon(consume, h)

                async def flip() -> None:
                    nonlocal recording
                    await anyio.sleep(warmup)
                    recording = probe.recording = gcp.recording = True

                tg.start_soon(flip)
                late, cpu, wall = await _paced_recording(
                    slots, start + warmup + seconds, tick, lambda _t: recording
                )
                probe.recording = recording = gcp.recording = False
                tg.cancel_scope.cancel()
            stats = rt.statistics()
    return {
        "from_due": probe.from_due,
        "from_tell": probe.from_tell,
        "to_engine": to_engine,
        "delivery": delivery,
        "cpu_fraction": cpu / wall,
        "cpu_s": cpu,
        "driver_late": late,
        "errors": errors,
        "turns": stats.engine.completed,
        "gc": gcp.summary(),
    }


async def _realtime_bare(n: int, seconds: float, warmup: float) -> dict[str, Any]:
    """The same cadence into a bare asyncio task + queue per session."""
    samples: list[float] = []
    recording = False

    async def worker(q: asyncio.Queue[tuple[float, bytes]]) -> None:
        while True:
            due, _chunk = await q.get()
            if recording:
                samples.append(now() - due)

    queues: list[asyncio.Queue[tuple[float, bytes]]] = [asyncio.Queue() for _ in range(n)]
    tasks = [asyncio.create_task(worker(q)) for q in queues]
    slots_n = 20
    slots = [queues[i::slots_n] for i in range(slots_n)]

    def tick(slot: int, due: float) -> None:
        for q in slots[slot]:
            q.put_nowait((due, CHUNK))

    start = now()

    def warmed_up(t: float) -> bool:
        nonlocal recording
        recording = t - start >= warmup
        return recording

    _late, cpu, wall = await _paced_recording(slots, start + warmup + seconds, tick, warmed_up)
    recording = False
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"from_due": samples, "cpu_fraction": cpu / wall, "cpu_s": cpu}


#: Events the runtime sends for each output of a real-time bench turn (StampingEngine, 3 text
#: tokens and 3 audio packets): the commit's 3, response.created, the first text's 4 (it opens
#: the message: output item, conversation item, content part, the delta), one per later delta,
#: and the end's 7 (text, audio and transcript done, content part, output item, conversation
#: item, response.done): 20 a turn.
_REALTIME_TURN_EVENTS = {
    "commit": 3,
    "Decision": 1,
    "first_text": 4,
    "TextDelta": 1,
    "AudioPacket": 1,
    "TurnDone": 7,
}


async def _realtime_bare_turns(n: int, seconds: float, warmup: float, turn_s: float) -> dict[str, Any]:
    """The real-time load with its turns, in plain asyncio: the bare baseline doing the same job.

    Per session a task + queue takes the chunks (as :func:`_realtime_bare`) and keeps them; a
    commit every ``turn_s``, at the same phases as the runtime's, makes a request of them and
    starts a task running the same engine (StampingEngine, same pacing), whose outputs come back
    through the session's queue; the session task puts as many events as the runtime sends (as
    tuples) on a queue a consumer task per session reads, measuring each text delta's lag as the
    runtime's consumer does. What it leaves out is the runtime's own work."""
    from ..core.engine_io import ModelTurnRequest, TurnKind
    from ..core.fence import Fence

    engine = StampingEngine(tokens=3, packets=3, interval_s=0.02)
    loop = asyncio.get_running_loop()
    samples: list[float] = []
    delivery: list[float] = []
    recording = False

    async def pump(request: ModelTurnRequest, q: asyncio.Queue[tuple[float | None, Any]]) -> None:
        async for output in engine.generate(request):
            q.put_nowait((None, output))

    async def worker(
        i: int, q: asyncio.Queue[tuple[float | None, Any]], out: asyncio.Queue[tuple[str, Any]]
    ) -> None:
        audio: list[bytes] = []
        turn = 0
        texts = 0
        while True:
            due, message = await q.get()
            if due is not None:
                audio.append(message)
                if recording:
                    samples.append(now() - due)
                continue
            if message == "commit":
                turn += 1
                texts = 0
                fence = Fence(f"sess_bare{i:016d}", 0, turn)
                request = ModelTurnRequest(fence.request_id(), fence, TurnKind.RESPONSE, b"".join(audio))
                audio.clear()
                loop.create_task(pump(request, q))
                kind = "commit"
            else:
                kind = type(message).__name__
                if kind == "TextDelta":
                    texts += 1
                    if texts == 1:
                        kind = "first_text"
            # The output's own event last (the text delta opening the message comes after the
            # message's opening events, as the runtime sends them).
            for _ in range(_REALTIME_TURN_EVENTS[kind] - 1):
                out.put_nowait(("event", message))
            out.put_nowait((kind, message))

    async def consume(out: asyncio.Queue[tuple[str, Any]]) -> None:
        while True:
            kind, message = await out.get()
            t = now()
            if kind in ("first_text", "TextDelta") and recording:
                delivery.append(t - float(message.text))

    # A session's queue: (due, chunk), or (None, "commit" or an engine output).
    queues: list[asyncio.Queue[tuple[float | None, Any]]] = [asyncio.Queue() for _ in range(n)]
    outs: list[asyncio.Queue[tuple[str, Any]]] = [asyncio.Queue() for _ in range(n)]
    tasks = [asyncio.create_task(worker(i, queues[i], outs[i])) for i in range(n)]
    tasks += [asyncio.create_task(consume(o)) for o in outs]
    slots_n = 20
    slots = [queues[i::slots_n] for i in range(slots_n)]
    next_commit = {id(q): i * turn_s / n for i, q in enumerate(queues)}
    start = now()

    def tick(slot: int, due: float) -> None:
        rel = due - start
        for q in slots[slot]:
            q.put_nowait((due, CHUNK))
            if rel >= next_commit[id(q)]:
                next_commit[id(q)] += turn_s
                q.put_nowait((None, "commit"))

    def warmed_up(t: float) -> bool:
        nonlocal recording
        recording = t - start >= warmup
        return recording

    _late, cpu, wall = await _paced_recording(slots, start + warmup + seconds, tick, warmed_up)
    recording = False
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"from_due": samples, "cpu_fraction": cpu / wall, "cpu_s": cpu, "delivery": delivery}


def bench_realtime(
    quick: bool = True, sizes: tuple[int, ...] | None = None, seconds: float | None = None
) -> dict[str, Any]:
    # 5,000 is past one core (the bare baseline alone needs more): it is there for the GC
    # figures, which grow with the heap of live sessions, not for its latencies.
    sizes = sizes or ((100, 1000, 5000) if quick else (100, 1000, 2000, 3000, 5000))
    seconds = seconds or (2.0 if quick else 10.0)
    warmup = min(0.5 if quick else 1.0, seconds)
    turn_s = 2.0
    rows = []
    series: dict[str, Any] = {}
    for n in sizes:
        # Paired rounds, as the engine bench does: each round runs the runtime and the bare
        # baseline back to back (order alternating), and the round with the median chunk-p99
        # ratio is the one reported, so its figures divide to the printed ratio. A shared
        # machine's speed drifts within seconds; one pair per N compared different machines.
        rounds = 3 if n <= 1000 else 1
        pairs = []
        # At N=1,000 (the capacity figure) each round also runs the bare baseline with the
        # same turns (_realtime_bare_turns): the chunk-only one has no engine, no requests and
        # no events, so "turns included" was compared with a load that has none.
        arms = ["runtime", "bare"] + (["bare_turns"] if n == 1000 else [])
        turn_rounds: list[dict[str, Any]] = []
        for k in range(rounds):
            got: dict[str, Any] = {}
            for arm in arms if k % 2 == 0 else arms[::-1]:
                gc.collect()
                if arm == "runtime":
                    got[arm] = anyio.run(_realtime_runtime, n, seconds, warmup, turn_s)
                elif arm == "bare":
                    got[arm] = anyio.run(_realtime_bare, n, seconds, warmup)
                else:
                    got[arm] = anyio.run(_realtime_bare_turns, n, seconds, warmup, turn_s)
            pairs.append((got["runtime"], got["bare"]))
            if "bare_turns" in got:
                turn_rounds.append({"runtime": got["runtime"], "bare_turns": got["bare_turns"]})

        def p99_ratio(pair: tuple[dict[str, Any], dict[str, Any]]) -> float:
            rq, bq = percentiles(pair[0]["from_due"])["p99"], percentiles(pair[1]["from_due"])["p99"]
            return math.inf if rq is None or not bq else rq / bq

        r, b = sorted(pairs, key=p99_ratio)[len(pairs) // 2]

        def chunk_cpu(res: dict[str, Any]) -> float:
            return cast(float, res["cpu_s"]) / max(len(res["from_due"]), 1)

        by_round = [
            {
                "p99_ratio": p99_ratio(pair),
                "cpu_ratio": pair[0]["cpu_fraction"] / max(pair[1]["cpu_fraction"], 1e-9),
                "cpu_per_chunk_ratio": chunk_cpu(pair[0]) / max(chunk_cpu(pair[1]), 1e-12),
            }
            for pair in pairs
        ]
        # The same load without the runtime's GC policy, for its before/after (pauses only).
        r_off = None
        if n >= 1000:
            gc.collect()
            r_off = anyio.run(_realtime_runtime, n, seconds, warmup, turn_s, None)
        rp = percentiles(r["from_due"])
        bp = percentiles(b["from_due"])
        row = {
            "sessions": n,
            "append_to_core_ms": {k: (v * 1e3 if isinstance(v, float) else v) for k, v in rp.items()},
            "append_to_core_from_tell_ms": _ms(percentiles(r["from_tell"])),
            "commit_to_engine_ms": _ms(percentiles(r["to_engine"])),
            "event_delivery_lag_ms": _ms(percentiles(r["delivery"])),
            "driver_late_ms": _ms(percentiles(r["driver_late"])),
            "cpu_fraction": r["cpu_fraction"],
            "bare_append_ms": _ms(bp),
            "bare_cpu_fraction": b["cpu_fraction"],
            "errors": r["errors"],
            "gc_pauses": r["gc"],
            "gc_pauses_without_policy": None if r_off is None else r_off["gc"],
            "rounds": by_round,
            "ok": rp["p99"] is not None and rp["p99"] <= 0.005 and r["cpu_fraction"] < 0.95,
        }
        # CPU per chunk (process time over chunks processed, turns included): unlike latency,
        # this barely moves when other processes take the cores, so it gives the capacity.
        chunks_per_s = 1000 / CHUNK_MS
        for key, res, lat in (("", r, rp), ("bare_", b, bp)):
            per_chunk = res["cpu_s"] / lat["n"] if lat["n"] else None
            row[key + "cpu_us_per_chunk"] = None if per_chunk is None else per_chunk * 1e6
            row[key + "sessions_per_core"] = None if not per_chunk else 1 / (per_chunk * chunks_per_s)
        # Against the bare baseline with the same turns: every round's ratio, and the median's.
        turn_ratios = []
        for pair in turn_rounds:
            rt_c = pair["runtime"]["cpu_s"] / max(len(pair["runtime"]["from_due"]), 1)
            bt_c = pair["bare_turns"]["cpu_s"] / max(len(pair["bare_turns"]["from_due"]), 1)
            turn_ratios.append((rt_c / bt_c if bt_c else math.inf, rt_c * 1e6, bt_c * 1e6))
        turn_ratios.sort()
        row["cpu_vs_bare_turns"] = (
            None
            if not turn_ratios
            else {
                "median": turn_ratios[len(turn_ratios) // 2],
                "rounds": [t[0] for t in turn_ratios],
            }
        )
        # Falling behind while using little CPU means the machine, not the runtime, was full.
        late_p50 = row["driver_late_ms"]["p50"] or 0.0
        row["starved"] = late_p50 > CHUNK_MS and r["cpu_fraction"] < 0.9
        rows.append(row)
        series[str(n)] = {
            "runtime": cdf_points([x * 1e3 for x in r["from_due"]]),
            "bare": cdf_points([x * 1e3 for x in b["from_due"]]),
        }
    figs = []
    for row in rows:
        n = row["sessions"]
        a, b = row["append_to_core_ms"], row["bare_append_ms"]
        figs += [
            figure(
                f"N={n}: chunk due -> processed by core, p50",
                a["p50"],
                "ms",
                b["p50"],
                "bare task+queue per session, same cadence",
            ),
            figure(
                f"N={n}: chunk due -> processed by core, p99 (median of {len(row['rounds'])} "
                "paired rounds; p99 ratio by round: "
                + " ".join(f"{x['p99_ratio']:.2f}x" for x in row["rounds"])
                + ")",
                a["p99"],
                "ms",
                b["p99"],
                "bare task+queue per session, same cadence",
                target="<= 5 ms",
                met=a["p99"] is not None and a["p99"] <= 5,
            ),
            figure(
                f"N={n}: commit -> engine has the request, p99",
                row["commit_to_engine_ms"]["p99"],
                "ms",
                b["p99"],
                "bare chunk p99",
            ),
            figure(
                f"N={n}: event delivery lag (engine yield -> client), p99",
                row["event_delivery_lag_ms"]["p99"],
                "ms",
                b["p99"],
                "bare chunk p99",
            ),
            figure(
                f"N={n}: CPU (fraction of one core)",
                row["cpu_fraction"],
                "core",
                row["bare_cpu_fraction"],
                "bare task+queue per session",
            ),
            figure(
                f"N={n}: CPU per 20 ms chunk (turns included; ratio by round: "
                + " ".join(f"{x['cpu_per_chunk_ratio']:.2f}x" for x in row["rounds"])
                + ")",
                row["cpu_us_per_chunk"],
                "us",
                row["bare_cpu_us_per_chunk"],
                "bare task+queue per session",
            ),
        ]
        vt = row.get("cpu_vs_bare_turns")
        if vt is not None:
            ratio, runtime_us, bare_us = vt["median"]
            figs.append(
                figure(
                    f"N={n}: CPU per 20 ms chunk against a bare baseline with the same turns "
                    "(median of paired rounds; by round: "
                    + " ".join(f"{x:.2f}x" for x in vt["rounds"])
                    + ")",
                    runtime_us,
                    "us",
                    bare_us,
                    "task + queue per session, same engine, task per request, as many events",
                    target="<= 2x",
                    met=ratio <= 2,
                )
            )
        g = row["gc_pauses"]
        g_off = row["gc_pauses_without_policy"]
        figs.append(
            figure(
                f"N={n}: longest GC pause while recording ({g['count']} collections, "
                f"{_fmt(g['total_ms'])} ms in all)",
                g["max_ms"],
                "ms",
                None if g_off is None else g_off["max_ms"],
                ""
                if g_off is None
                else f"same load without the GC policy: {g_off['count']} collections, "
                f"{_fmt(g_off['total_ms'])} ms in all",
                target="<= 2 ms" if n >= 1000 else None,
                met=g["max_ms"] <= 2 if n >= 1000 else None,
            )
        )
        # The collector's own CPU: the pause without the time other processes took the core.
        figs.append(
            figure(
                f"N={n}: longest GC pause, CPU time of the collector",
                g["max_cpu_ms"],
                "ms",
                None if g_off is None else g_off["max_cpu_ms"],
                "" if g_off is None else "same load without the GC policy",
            )
        )
        if row["starved"]:
            figs.append(
                figure(
                    f"N={n}: WARNING the driver ran {_fmt(row['driver_late_ms']['p50'])} ms "
                    f"late (p50) on {_fmt(row['cpu_fraction'])} core: the machine was "
                    "oversubscribed, latencies above are not the runtime's",
                    None,
                    "",
                )
            )
    passing = [r["sessions"] for r in rows if r["ok"]]
    best = max(passing) if passing else 0
    best_row = next((r for r in rows if r["sessions"] == best), None)
    per_core = None
    if best_row is not None and best_row["cpu_fraction"] > 0:
        per_core = best / best_row["cpu_fraction"]
    figs.append(
        figure(
            "largest N tested with chunk p99 <= 5 ms (one event loop = one core)",
            best,
            "sessions",
            None,
            "",
            target=">= 1000",
            met=best >= 1000,
            higher_is_better=True,
        )
    )
    if per_core is not None:
        figs.append(
            figure(
                "  extrapolated sessions per fully used core at that load",
                per_core,
                "sessions",
                None,
                "",
                higher_is_better=True,
            )
        )
    # Capacity from N=1,000 when it ran: larger N saturate the core and only read the same.
    big = next((r for r in rows if r["sessions"] == 1000), rows[-1])
    if big["sessions_per_core"] is not None:
        figs.append(
            figure(
                f"CPU-implied real-time sessions per core (from N={big['sessions']})",
                big["sessions_per_core"],
                "sessions",
                big["bare_sessions_per_core"],
                "bare task+queue per session",
                target=">= 1000",
                met=big["sessions_per_core"] >= 1000,
                higher_is_better=True,
            )
        )
    return {
        "name": "realtime",
        "params": {
            "sizes": list(sizes),
            "seconds": seconds,
            "warmup": warmup,
            "turn_s": turn_s,
            "chunk_ms": CHUNK_MS,
        },
        "figures": figs,
        "rows": rows,
        "series": series,
    }


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _ms(p: dict[str, Any]) -> dict[str, Any]:
    return {k: (v * 1e3 if isinstance(v, float) else v) for k, v in p.items()}


# --------------------------------------------------------------------------- 4. barge-in


async def _barge_in(
    n: int,
    seconds: float,
    warmup: float,
    gc_policy: Any = "default",
) -> dict[str, Any]:
    """N sessions at real cadence; each repeatedly commits, lets the (long, paced) response
    play a little, then barges in. Measures the stop path and checks nothing stale leaks."""
    from ..actors.gc_policy import GcPolicy
    from ..actors.runtime import Runtime

    if gc_policy == "default":
        gc_policy = GcPolicy()  # what ``serve`` runs with
    # A long answer paced like real speech: one packet per 20 ms, never finishes by itself.
    engine = StampingEngine(tokens=1000, packets=1000, interval_s=0.02)
    rng = random.Random(7)
    recording = False
    told_at: dict[str, float] = {}  # request id -> barge-in told
    to_abort: list[float] = []
    to_cancel: list[float] = []
    core_done: list[float] = []
    client_done: list[float] = []
    shadow: list[float] = []
    measured: list[tuple[str, float]] = []  # (request id, barge-in told) recorded
    core_by_rid: dict[str, float] = {}
    stale_after_done = 0
    barge_ins = 0
    actions: list[tuple[float, int, str, Any]] = []  # (when, seq, kind, handle)
    seq = 0

    def schedule(when: float, kind: str, h: SessionHandle) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(actions, (when, seq, kind, h))

    shadows: dict[str, tuple[anyio.CancelScope, list[Any]]] = {}

    shadow_by_rid: dict[str, float] = {}

    async def shadow_task(scope: anyio.CancelScope, t_box: list[Any]) -> None:
        # The bare baseline: a parked task cancelled at the moment of the barge-in, under the
        # same load; how long until its cancellation runs is one loop hop, nothing more.
        with scope:
            await anyio.sleep_forever()
        if recording and t_box:
            shadow.append(now() - t_box[0])
            shadow_by_rid[t_box[1]] = shadow[-1]

    slots_n = 20
    with _GcPauses() as gcp:
        async with Runtime(engine, reaper_interval_s=0, gc_policy=gc_policy) as rt:
            handles = [rt.open_session_nowait() for _ in range(n)]
            slots = [handles[i::slots_n] for i in range(slots_n)]
            current: dict[str, str] = {}  # session id -> request id of the playing response

            async def consume(h: SessionHandle, tg: anyio.abc.TaskGroup) -> None:
                nonlocal stale_after_done
                cancelled: set[str] = set()
                audio_seen = 0
                async for e in h.events():
                    t = now()
                    typ = e.type
                    if typ == "response.output_audio.delta":
                        if cast(AudioDeltaEvent, e).response_id in cancelled:
                            stale_after_done += 1
                        audio_seen += 1
                        if audio_seen == 3:
                            scope = anyio.CancelScope()
                            box: list[Any] = []
                            shadows[h.id] = (scope, box)
                            tg.start_soon(shadow_task, scope, box)
                            schedule(t + rng.uniform(0.02, 0.2), "barge", h)
                    elif typ == "response.created":
                        audio_seen = 0
                    elif typ == "response.done":
                        e = cast(ResponseDone, e)
                        if e.status == "cancelled":
                            cancelled.add(e.response_id)
                            rid = current.pop(h.id, None)
                            told = told_at.pop(rid, None) if rid else None
                            if recording and rid is not None and told is not None:
                                client_done.append(t - told)
                                if e.metrics is not None and e.metrics.stop_latency_ms is not None:
                                    core_done.append(e.metrics.stop_latency_ms / 1e3)
                                    core_by_rid[rid] = core_done[-1]
                                measured.append((rid, told))
                        schedule(t + rng.uniform(0.1, 0.4), "commit", h)

            def on_request(request: ModelTurnRequest, t: float) -> None:
                current[request.fence.session_id] = request.request_id

            engine.on_request = on_request

            async with anyio.create_task_group() as tg:
                for h in handles:
                    tg.start_soon(consume, h, tg)
                start = now()
                for i, h in enumerate(handles):  # first commits spread over half a second
                    schedule(start + 0.1 + 0.5 * i / n, "commit", h)

                def tick(slot: int, due: float) -> None:
                    nonlocal barge_ins
                    for h in slots[slot]:
                        h.append_audio(CHUNK)
                    t = now()
                    while actions and actions[0][0] <= t:
                        _, _, kind, h = heapq.heappop(actions)
                        if kind == "commit":
                            h.tell(cmd.CommitInput())
                        else:
                            rid = current.get(h.id)
                            if rid is None:
                                continue
                            told_at[rid] = now()
                            h.tell(cmd.BargeIn(reason="turn_detected"))
                            barge_ins += 1
                            scope, box = shadows.pop(h.id, (None, None))
                            if scope is not None and box is not None:
                                box += [now(), rid]
                                scope.cancel()

                async def flip() -> None:
                    nonlocal recording
                    await anyio.sleep(warmup)
                    recording = gcp.recording = True

                tg.start_soon(flip)
                await _paced(slots, CHUNK_MS / 1000, start + warmup + seconds, tick)
                recording = gcp.recording = False
                tg.cancel_scope.cancel()
            # The engine may see the abort after the client saw response.done: read it at the end.
            added_abort: list[float] = []
            added_done: list[float] = []
            for rid, told in measured:
                if rid in engine.abort_called:
                    to_abort.append(engine.abort_called[rid] - told)
                    if rid in shadow_by_rid:
                        added_abort.append(to_abort[-1] - shadow_by_rid[rid])
                if rid in engine.stream_cancelled:
                    to_cancel.append(engine.stream_cancelled[rid] - told)
                if rid in core_by_rid and rid in shadow_by_rid:
                    added_done.append(core_by_rid[rid] - shadow_by_rid[rid])
            counters = [h.core.counters for h in handles]
            stats = rt.statistics()
    return {
        "to_abort": to_abort,
        "to_cancel": to_cancel,
        "core_done": core_done,
        "added_abort": added_abort,
        "added_done": added_done,
        "client_done": client_done,
        "shadow": shadow,
        "stale_after_done": stale_after_done,
        "barge_ins": barge_ins,
        "gc": gcp.summary(),
        "dropped_undelivered_audio": sum(c.dropped_audio_events for c in counters),
        "stale_outputs_consumed": sum(c.stale_outputs for c in counters),
        "engine_aborted": stats.engine.aborted,
    }


def bench_barge_in(
    quick: bool = True,
    sessions: int = 1000,
    seconds: float | None = None,
) -> dict[str, Any]:
    seconds = seconds or (2.5 if quick else 10.0)
    warmup = min(0.7 if quick else 1.0, seconds)
    gc.collect()
    r = anyio.run(_barge_in, sessions, seconds, warmup)
    sh = _ms(percentiles(r["shadow"]))
    parts = {
        "engine abort issued (backend.abort called)": _ms(percentiles(r["to_abort"])),
        "engine stream cancelled": _ms(percentiles(r["to_cancel"])),
        "cancelled response.done emitted by the core": _ms(percentiles(r["core_done"])),
        "cancelled response.done received by the client": _ms(percentiles(r["client_done"])),
    }
    figs = []
    for label, p in parts.items():
        figs.append(
            figure(
                f"barge-in -> {label}, p50",
                p["p50"],
                "ms",
                sh["p50"],
                "bare task.cancel() -> its finally, same load",
            )
        )
        met = None
        if label.startswith(("engine abort", "cancelled response.done emitted")):
            met = p["p99"] is not None and p["p99"] <= 1.0
        figs.append(
            figure(
                f"barge-in -> {label}, p99",
                p["p99"],
                "ms",
                sh["p99"],
                "bare task.cancel() -> its finally, same load",
                target="<= 1 ms" if met is not None else None,
                met=met,
            )
        )
    # Runtime-added: per barge-in, the runtime's latency minus the bare cancel measured at the
    # same moment (the loop's own backlog is in both; what remains is the runtime's share).
    added = {
        "engine abort issued": _ms(percentiles(r["added_abort"])),
        "cancelled response.done emitted": _ms(percentiles(r["added_done"])),
    }
    for label, p in added.items():
        for q in ("p50", "p99"):
            met = None if q == "p50" else (p[q] is not None and p[q] <= 1.0)
            figs.append(
                figure(
                    f"runtime-added (minus the paired bare cancel): {label}, {q}",
                    p[q],
                    "ms",
                    None,
                    "",
                    target="<= 1 ms" if q == "p99" else None,
                    met=met,
                )
            )
    g = r["gc"]
    figs.append(
        figure(
            f"longest GC pause while recording ({g['count']} collections, {_fmt(g['total_ms'])} ms in all)",
            g["max_ms"],
            "ms",
            None,
            "",
        )
    )
    figs.append(
        figure(
            "stale audio deltas delivered after the cancelled response.done",
            r["stale_after_done"],
            "events",
            None,
            "",
            target="0",
            met=r["stale_after_done"] == 0,
        )
    )
    return {
        "name": "barge_in",
        "params": {"sessions": sessions, "seconds": seconds, "warmup": warmup},
        "figures": figs,
        "parts": parts,
        "added": added,
        "shadow_ms": sh,
        "counts": {
            k: r[k]
            for k in (
                "barge_ins",
                "stale_after_done",
                "dropped_undelivered_audio",
                "stale_outputs_consumed",
                "engine_aborted",
            )
        },
        "series": {
            label: cdf_points([x * 1e3 for x in r[key]])
            for label, key in (
                ("engine abort issued", "to_abort"),
                ("response.done emitted (core)", "core_done"),
                ("response.done received (client)", "client_done"),
                ("bare task cancel (baseline)", "shadow"),
            )
        },
    }
