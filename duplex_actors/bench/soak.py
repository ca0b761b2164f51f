"""Soak: many sessions for a long time, with barge-ins, disconnects and resumes.

``run(sessions=1000, seconds=600)`` keeps ``sessions`` clients busy on one Runtime over the
scripted engine for ``seconds``. Each client talks in turns (append, commit, read the reply)
and at random barges in, cancels, drops its connection mid-stream (losing the events still
"on the wire"), detaches, waits, and resumes with the last seq it really received (sometimes
sending the resume twice, as a client that lost the answer would), or closes and opens a new
session. Every client checks its own stream as a real one would: events it receives in order
are kept, seqs at or below the highest seen are replay duplicates and dropped, and a seq that
skips ahead is a *lost event* (the figure that must be zero). At the end every session closes,
and the report says whether anything leaked.

Reported: RSS at start, after warm-up and at end (and the slope after warm-up), with the events
held in replay journals and the live Python allocations beside it (what RSS is made of), tasks
alive, open engine requests and routes, events lost, terminal-event violations, and counts of
what the clients did. ``ok`` is the conjunction of the hard checks.

Run it: ``python -m duplex_actors.bench.soak --sessions 1000 --seconds 600`` (the CLI's
``bench soak`` runs the same function).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import anyio
import anyio.abc
import anyio.lowlevel

from ..actors.runtime import Runtime
from ..actors.session_handle import SessionHandle
from ..core.clock import MONOTONIC
from ..core.events import (
    ResponseCreated,
    ResponseDone,
    ServerEvent,
    SessionClosedEvent,
    SessionCreated,
    SessionResumed,
)
from ..engines.scripted import Script, ScriptedEngine
from ..errors import DuplexError, ResumeConflict, ResyncRequired, SessionClosed, UnknownSession

if TYPE_CHECKING:
    import typer

CHUNK = b"\x01\x00" * 1600  # 100 ms of 16 kHz pcm16
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_mb() -> float:
    """Resident set size of this process, in MiB (Linux /proc; 0.0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / (1 << 20)
    except OSError:
        return 0.0


class _Stats:
    def __init__(self) -> None:
        self.c: dict[str, int] = {}
        self.errors: list[str] = []

    def add(self, key: str, n: int = 1) -> None:
        self.c[key] = self.c.get(key, 0) + n

    def error(self, message: str, count: bool = True) -> None:
        if count:
            self.add("unexpected_errors")
        if len(self.errors) < 20:
            self.errors.append(message)


class _Stream:
    """What one client saw of one session: the in-order stream it kept, checked as it goes."""

    __slots__ = (
        "last",
        "created",
        "done",
        "closed",
        "gen",
        "token",
        "pending_resume",
        "in_response",
        "trail",
        "abandoned",
    )

    def __init__(self) -> None:
        self.last = 0  # highest seq kept
        self.created: set[str] = set()
        self.done: set[str] = set()
        self.closed = 0
        self.gen = 0
        self.token = ""
        self.pending_resume: tuple[int, str, str] | None = None
        self.in_response = False
        self.trail: list[str] = []  # the last few things seen and done, for a finding's report
        #: A resume was refused (declared: resync_required / conflict): what follows is not
        #: checked for gaps, since the client knows it must resync.
        self.abandoned = False

    def note(self, what: str) -> None:
        self.trail.append(what)
        if len(self.trail) > 12:
            del self.trail[0]

    def keep(self, event: ServerEvent, stats: _Stats) -> None:
        seq = event.seq
        if seq <= self.last:
            stats.add("replay_duplicates_dropped")
            return
        if seq != self.last + 1 and not self.abandoned:
            stats.add("events_lost", seq - self.last - 1)
            stats.error(
                f"seq gap {self.last} -> {seq} ({event.type}) in {event.session_id}; recent: {self.trail}",
                count=False,
            )
        self.last = seq
        self.note(f"{seq}:{event.type}")
        stats.add("events")
        t = event.type
        # Each branch reads the event as the class its wire name stands for.
        if t == "response.created":
            event = cast(ResponseCreated, event)
            if event.response_id in self.created:
                stats.add("duplicate_response_created")
            self.created.add(event.response_id)
            self.in_response = True
        elif t == "response.done":
            event = cast(ResponseDone, event)
            if event.response_id in self.done:
                stats.add("duplicate_response_done")
            self.done.add(event.response_id)
            self.in_response = False
            stats.add("responses_" + event.status)
        elif t == "session.created":
            event = cast(SessionCreated, event)
            self.token = event.resume_token
        elif t == "session.resumed":
            event = cast(SessionResumed, event)
            # Answers can arrive late (a duplicate resume's answer, queued before the next
            # disconnect): only a newer generation counts, and only the answer to the resume
            # in hand (its generation + 1) settles it.
            if event.generation > self.gen:
                self.gen, self.token = event.generation, event.resume_token
            if self.pending_resume is not None and event.generation == self.pending_resume[0] + 1:
                self.pending_resume = None
        elif t == "session.closed":
            event = cast(SessionClosedEvent, event)
            self.closed += 1
            stats.add("closed_" + event.reason)

    def check_closed(self, stats: _Stats) -> None:
        if self.closed != 1:
            stats.add("session_closed_not_once")
            stats.error(f"{self.closed} session.closed; recent: {self.trail}", count=False)
        if self.created != self.done and not self.abandoned:
            stats.add("responses_without_one_done", len(self.created ^ self.done))
            stats.error(
                f"created/done mismatch {self.created ^ self.done}; recent: {self.trail}", count=False
            )


async def _client(
    rt: Runtime,
    rng: random.Random,
    deadline: float,
    stats: _Stats,
    p_barge: float,
    p_detach: float,
    p_churn: float,
    think: tuple[float, float],
    grace_s: float,
    journal_max_age_s: float,
) -> None:
    while MONOTONIC.now() < deadline:
        try:
            handle = await rt.open_session(disconnect_grace_s=grace_s, journal_max_age_s=journal_max_age_s)
        except DuplexError:  # admission refused: retry a little later
            stats.add("open_refused")
            await anyio.sleep(0.05)
            continue
        stats.add("sessions_opened")
        stream = _Stream()
        # The open's answer carries the resume credentials (session.created repeats them).
        stream.gen, stream.token = handle.generation, handle.resume_token
        try:
            await _converse(rt, handle, stream, rng, deadline, stats, p_barge, p_detach, p_churn, think)
        except UnknownSession:
            stats.add("session_gone")  # expired while away: declared, not lost
            continue
        except Exception as exc:  # anything else is a finding (and fails the run)
            found: BaseException = exc
            while isinstance(found, BaseExceptionGroup) and len(found.exceptions) == 1:
                found = found.exceptions[0]  # unwrap a one-error group
            stats.error(f"{type(found).__name__}: {found}; recent: {stream.trail}")
            # The client broke off without resuming, so the events it had on the wire are
            # gone *for this client*; that is its error above, not a runtime loss.
            stream.abandoned = True
        # Close and read to the end: exactly one session.closed, every response ended.
        try:
            await handle.close(reason="soak_done")
        except DuplexError:
            pass
        try:
            with anyio.fail_after(10):
                async for event in handle.events():
                    stream.keep(event, stats)
        except TimeoutError:
            stats.add("close_drain_timeout")
        stream.check_closed(stats)


async def _converse(
    rt: Runtime,
    handle: SessionHandle,
    stream: _Stream,
    rng: random.Random,
    deadline: float,
    stats: _Stats,
    p_barge: float,
    p_detach: float,
    p_churn: float,
    think: tuple[float, float],
) -> None:
    # The connection: a reader task; "on the wire" = events read but not yet kept.
    wire: list[ServerEvent] = []

    async def reader(task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async for event in handle.events():
            wire.append(event)
            if len(wire) >= rng.randint(1, 6):  # the client processes in small bursts
                for e in wire:
                    stream.keep(e, stats)
                wire.clear()
            await anyio.lowlevel.checkpoint()

    async def settle_wire() -> None:
        for e in wire:
            stream.keep(e, stats)
        wire.clear()

    while MONOTONIC.now() < deadline:
        dropped = churn = False
        async with anyio.create_task_group() as conn:
            await conn.start(reader)
            if stream.pending_resume is not None:
                # Nothing is sent on a resumed connection before its session.resumed (the
                # server answers a retry of the resume only until the client acts on it). The
                # link may drop first: the answer is lost, and the same resume is sent again.
                if rng.random() < p_detach:
                    dropped = True
                else:
                    with anyio.fail_after(10):
                        while stream.pending_resume is not None:
                            await anyio.sleep(0.002)
                            await settle_wire()
            while MONOTONIC.now() < deadline and not dropped and not churn:
                # One user turn: speak for a while, then commit.
                for _ in range(rng.randint(1, 4)):
                    handle.append_audio(CHUNK)
                    await anyio.lowlevel.checkpoint()
                try:
                    await handle.commit()
                except DuplexError as err:
                    stats.add("refused_" + err.code)
                stats.add("turns")
                # Maybe interrupt the reply, maybe drop the connection in the middle of it.
                await anyio.sleep(rng.uniform(0.0, 0.15))
                roll = rng.random()
                try:
                    if roll < p_barge:
                        await handle.barge_in()
                        stats.add("barge_ins")
                        stream.note("barge_ins")
                    elif roll < p_barge * 1.25:
                        await handle.cancel()
                        stats.add("cancels")
                        stream.note("cancels")
                except DuplexError as err:
                    stats.add("refused_" + err.code)
                if rng.random() < p_detach:
                    dropped = True
                    break
                await anyio.sleep(rng.uniform(*think))
                churn = rng.random() < p_churn  # close this session and open another
            conn.cancel_scope.cancel()  # the transport drops (or the client hangs up)
        if not dropped:
            await settle_wire()
            return
        # Disconnected: whatever was still on the wire is lost to this client.
        stats.add("wire_events_lost_in_transit", len(wire))
        wire.clear()
        stats.add("detaches")
        stream.note("detaches")
        await handle.detach()
        await anyio.sleep(rng.uniform(0.0, 1.5))
        # Resume from the last seq really kept. A client that never saw the answer to its
        # previous resume sends that same resume again (same control id).
        if stream.pending_resume is not None:
            gen, token, cid = stream.pending_resume
            stats.add("resume_retries")
            stream.note("resume_retries")
        else:
            gen, token, cid = stream.gen, stream.token, f"r{rng.getrandbits(48):x}"
            stream.pending_resume = (gen, token, cid)
        try:
            await rt.resume(handle.id, gen, token, last_seq=stream.last, control_id=cid)
            stats.add("resumes")
            stream.note("resumes")
            if rng.random() < 0.1:  # the same resume arrives twice
                await rt.resume(handle.id, gen, token, last_seq=stream.last, control_id=cid)
                stats.add("duplicate_resumes")
                stream.note("duplicate_resumes")
        except ResyncRequired:
            stats.add("resync_required")
            stream.abandoned = True
            return
        except ResumeConflict as err:
            stats.add("resume_conflicts")
            stats.error(f"resume conflict: {err}; recent: {stream.trail}", count=False)
            stream.abandoned = True
            return
        except SessionClosed:
            # Expired while away (disconnect grace ran out): the refusal declares it, so what
            # was on the wire is gone for this client by the protocol, not lost by the runtime.
            stats.add("session_gone")
            stream.abandoned = True
            return


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope (MiB per minute) of (seconds, MiB) points."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    var = sum((p[0] - mx) ** 2 for p in points)
    if var == 0:
        return 0.0
    return sum((p[0] - mx) * (p[1] - my) for p in points) / var * 60.0


async def _soak(
    sessions: int,
    seconds: float,
    seed: int,
    warmup_s: float,
    sample_every_s: float,
    p_barge: float,
    p_detach: float,
    p_churn: float,
    think: tuple[float, float],
    token_latency_s: float,
    journal_max_age_s: float,
    progress: Callable[[str], None] | None,
) -> dict[str, Any]:
    stats = _Stats()
    rng = random.Random(seed)
    script = Script(token_latency_s=token_latency_s, packet_latency_s=token_latency_s, packet_ms=100)
    # Not recording: the scripted engine's request log (every request with its audio) is test
    # bookkeeping, not the runtime's memory, and would be measured here as if it were.
    engine = ScriptedEngine(script, record=False)
    gc.collect()
    rss_start = rss_mb()
    samples: list[tuple[float, float]] = []
    # Beside RSS, what explains it: events held in replay journals (they scale with the event
    # rate of the last journal_max_age_s) and live Python allocations (flat blocks with rising
    # RSS point at the allocator, not at a leak).
    held: list[tuple[float, int, int]] = []
    t0 = MONOTONIC.now()
    deadline = t0 + seconds
    report: dict[str, Any] = {}
    async with Runtime(engine, max_sessions=sessions, stall_timeout_s=5.0, reaper_interval_s=1.0) as rt:
        baseline_tasks = len(asyncio.all_tasks())

        async def sampler() -> None:
            while True:
                await anyio.sleep(sample_every_s)
                t = MONOTONIC.now() - t0
                samples.append((t, rss_mb()))
                held.append(
                    (t, sum(h.core.journaled_events for h in rt.sessions()), sys.getallocatedblocks())
                )
                if progress:
                    st = rt.statistics()
                    progress(
                        f"t={t:6.1f}s rss={samples[-1][1]:7.1f}MiB sessions={st.sessions} "
                        f"engine_in_flight={st.engine.in_flight} events={stats.c.get('events', 0)} "
                        f"lost={stats.c.get('events_lost', 0)}"
                    )

        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler)
            async with anyio.create_task_group() as clients:
                for i in range(sessions):
                    clients.start_soon(
                        _client,
                        rt,
                        random.Random(rng.getrandbits(64)),
                        deadline,
                        stats,
                        p_barge,
                        p_detach,
                        p_churn,
                        think,
                        30.0,
                        journal_max_age_s,
                    )
                    if i % 50 == 49:
                        await anyio.lowlevel.checkpoint()  # stagger the start a little
            tg.cancel_scope.cancel()
        # Everything closed: nothing may be left in flight.
        with anyio.move_on_after(10):
            while True:
                st = rt.engine.statistics()
                if st.in_flight == 0 and st.routes == 0 and not engine.active and rt.session_count == 0:
                    break
                await anyio.sleep(0.05)
        est = rt.engine.statistics()
        # Parked engine pumps wait for the next request: a bounded pool, not a leak.
        tasks_end = len(asyncio.all_tasks()) - est.parked_pumps
        report.update(
            sessions_open_at_end=rt.session_count,
            engine_in_flight_at_end=est.in_flight,
            engine_routes_at_end=est.routes,
            engine_active_at_end=len(engine.active),
            engine_pending_abort_retries=est.pending_abort_retries,
            engine_restarts=est.restarts,
            engine_submitted=est.submitted,
            tasks_alive_at_start=baseline_tasks,
            tasks_alive_at_end=tasks_end,
            engine_parked_pumps_at_end=est.parked_pumps,
        )
    gc.collect()
    rss_end = rss_mb()
    elapsed = MONOTONIC.now() - t0
    warm = [p for p in samples if p[0] >= warmup_s]
    rss_warm = warm[0][1] if warm else (samples[-1][1] if samples else rss_end)
    growth = (warm[-1][1] - rss_warm) if warm else 0.0
    # Only samples up to the deadline: after it the clients close their sessions and the
    # journals empty with them, so "_end" is the last sample taken under load.
    held_warm = [h for h in held if warmup_s <= h[0] <= seconds]
    tasks_after = len(asyncio.all_tasks())
    c = stats.c
    report.update(
        sessions=sessions,
        seconds=seconds,
        elapsed_s=round(elapsed, 1),
        seed=seed,
        rss_start_mib=round(rss_start, 1),
        rss_after_warmup_mib=round(rss_warm, 1),
        rss_end_mib=round(rss_end, 1),
        rss_peak_mib=round(max([s[1] for s in samples] + [rss_end]), 1),
        rss_growth_after_warmup_mib=round(growth, 1),
        rss_slope_after_warmup_mib_per_min=round(_slope(warm), 2),
        warmup_s=warmup_s,
        journal_max_age_s=journal_max_age_s,
        rss_samples=[(round(t, 1), round(m, 1)) for t, m in samples],
        journal_events_after_warmup=held_warm[0][1] if held_warm else None,
        journal_events_end=held_warm[-1][1] if held_warm else None,
        py_blocks_after_warmup=held_warm[0][2] if held_warm else None,
        py_blocks_end=held_warm[-1][2] if held_warm else None,
        held_samples=[(round(t, 1), j, b) for t, j, b in held],
        tasks_alive_after_shutdown=tasks_after,
        events_lost=c.get("events_lost", 0),
        events=c.get("events", 0),
        events_per_s=round(c.get("events", 0) / max(elapsed, 1e-9)),
        counts=dict(sorted(c.items())),
        errors=stats.errors,
    )
    memory_flat = growth <= max(0.05 * rss_warm, 16.0)
    report["memory_flat"] = memory_flat
    report["ok"] = bool(
        report["events_lost"] == 0
        and c.get("session_closed_not_once", 0) == 0
        and c.get("responses_without_one_done", 0) == 0
        and c.get("duplicate_response_done", 0) == 0
        and c.get("duplicate_response_created", 0) == 0
        and c.get("unexpected_errors", 0) == 0
        and c.get("resume_conflicts", 0) == 0
        and c.get("close_drain_timeout", 0) == 0
        and report["sessions_open_at_end"] == 0
        and report["engine_in_flight_at_end"] == 0
        and report["engine_routes_at_end"] == 0
        and report["engine_active_at_end"] == 0
        and report["tasks_alive_at_end"] <= report["tasks_alive_at_start"]
        and memory_flat
    )
    return report


def plan(seconds: float, journal_max_age_s: float, warmup_s: float | None = None) -> tuple[float, float]:
    """``(run_s, warmup_s)``: how long the load runs and when memory starts to be judged.

    Warm-up lasts 1.5x the journal age (a quarter of the run if that is longer): each session's
    journal fills for ``journal_max_age_s`` and is level only after it, so RSS judged any earlier
    counts the journals filling as growth. The run then lasts at least 1.5x the warm-up, so a
    third of it is measured: a ``seconds`` too short for that is lengthened rather than judged on
    journals still filling (200 x 60 s at the default 60 s age runs 135 s, warm-up 90 s).
    """
    if warmup_s is None:
        warmup_s = max(1.5 * journal_max_age_s, 0.25 * seconds)
    return max(seconds, 1.5 * warmup_s), warmup_s


def run(
    sessions: int = 1000,
    seconds: float = 600.0,
    *,
    seed: int = 0,
    warmup_s: float | None = None,
    sample_every_s: float | None = None,
    p_barge: float = 0.2,
    p_detach: float = 0.08,
    p_churn: float = 0.03,
    think: tuple[float, float] = (0.2, 1.5),
    token_latency_s: float = 0.01,
    journal_max_age_s: float = 60.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the soak and return its report (see the module docstring).

    Memory is judged after warm-up, which outlasts the replay journal's age limit (:func:`plan`;
    the report's ``seconds`` is the run's length, which may exceed the one asked). Level as long as the
    event *rate* is: the journals hold the last ``journal_max_age_s`` of events, so a run whose
    warm-up was slowed (another process on the same cores) fills them further once it speeds up,
    and that shows as RSS growth. ``journal_events_*`` and ``py_blocks_*`` tell that apart from a
    leak; the memory check itself does not discount it.
    """
    asked = seconds
    seconds, warmup_s = plan(seconds, journal_max_age_s, warmup_s)
    if progress and seconds > asked:
        progress(
            f"running {seconds:g} s, not {asked:g}, to measure a third of it after the {warmup_s:g} s warm-up"
        )
    if sample_every_s is None:
        sample_every_s = max(0.5, min(5.0, seconds / 40))
    report = anyio.run(
        _soak,
        sessions,
        seconds,
        seed,
        warmup_s,
        sample_every_s,
        p_barge,
        p_detach,
        p_churn,
        think,
        token_latency_s,
        journal_max_age_s,
        progress,
    )
    report["seconds_asked"] = asked
    return report


def summary(report: dict[str, Any]) -> str:
    r = report
    c = r["counts"]
    return "\n".join(
        [
            f"soak: {r['sessions']} sessions x {r['seconds']} s (asked {r.get('seconds_asked', r['seconds'])} s, "
            f"elapsed {r['elapsed_s']} s), seed {r['seed']}, journal age {r['journal_max_age_s']} s",
            f"  ok: {r['ok']}",
            f"  events: {r['events']} kept ({r['events_per_s']}/s), lost (seq gaps): {r['events_lost']}, "
            f"replay duplicates dropped: {c.get('replay_duplicates_dropped', 0)}",
            f"  turns {c.get('turns', 0)}, barge-ins {c.get('barge_ins', 0)}, cancels {c.get('cancels', 0)}, "
            f"detaches {c.get('detaches', 0)}, resumes {c.get('resumes', 0)} "
            f"(retries {c.get('resume_retries', 0)}, duplicates {c.get('duplicate_resumes', 0)}), "
            f"resync_required {c.get('resync_required', 0)}, resume conflicts {c.get('resume_conflicts', 0)}, sessions opened {c.get('sessions_opened', 0)}",
            f"  responses: completed {c.get('responses_completed', 0)}, cancelled "
            f"{c.get('responses_cancelled', 0)}, failed {c.get('responses_failed', 0)}; terminal violations: "
            f"{c.get('session_closed_not_once', 0) + c.get('responses_without_one_done', 0)}",
            f"  RSS MiB: start {r['rss_start_mib']}, after warm-up ({r['warmup_s']} s) "
            f"{r['rss_after_warmup_mib']}, end {r['rss_end_mib']}, peak {r['rss_peak_mib']}; growth after "
            f"warm-up {r['rss_growth_after_warmup_mib']} (slope {r['rss_slope_after_warmup_mib_per_min']}/min), "
            f"flat: {r['memory_flat']}",
            f"  held after warm-up / at the deadline: journal events {r['journal_events_after_warmup']} / "
            f"{r['journal_events_end']}, python blocks {r['py_blocks_after_warmup']} / {r['py_blocks_end']}",
            f"  tasks alive: start {r['tasks_alive_at_start']}, end {r['tasks_alive_at_end']}, after shutdown "
            f"{r['tasks_alive_after_shutdown']}; engine in flight {r['engine_in_flight_at_end']}, routes "
            f"{r['engine_routes_at_end']}, backend active {r['engine_active_at_end']}, restarts {r['engine_restarts']}",
            f"  unexpected errors: {c.get('unexpected_errors', 0)} {r['errors'][:3]}",
        ]
    )


def register_soak(app: typer.Typer) -> None:
    """Add a ``soak`` command to a typer app (the CLI wires it as ``bench soak``)."""
    import typer

    def soak(
        sessions: int = typer.Option(1000, help="Concurrent sessions."),
        seconds: float = typer.Option(600.0, help="How long to run (at least 1.5x the warm-up)."),
        seed: int = typer.Option(0, help="Random seed."),
        json_out: str = typer.Option("", "--json", help="Also write the report here."),
        wire: bool = typer.Option(
            False,
            "--wire",
            help="Websocket clients against a real "
            "`serve` process (bench/wire_soak.py) instead of in-process.",
        ),
        hostile: float = typer.Option(0.05, help="--wire: fraction of hostile clients."),
        workers: int = typer.Option(1, help="--wire: run `serve --workers N`."),
        kill_worker: bool = typer.Option(
            False, help="--wire --workers N: SIGKILL worker 1 halfway; its clients must each be told"
        ),
        kill_workers: int = typer.Option(
            0,
            help="--wire --workers N: SIGKILL this many of the starting workers in turn, evenly "
            "spaced over the run (worker 1, then 0, then the others); --kill-worker is 1",
        ),
        journal_max_age_s: float = typer.Option(
            60.0,
            help="The sessions' journal age; warm-up is 1.5x this (a run too short for it is lengthened)",
        ),
    ) -> None:
        """Soak the runtime: sessions with barge-ins, disconnects and resumes; report leaks."""
        if wire:
            from . import wire_soak

            report = wire_soak.run(
                sessions,
                seconds,
                seed=seed,
                hostile=hostile,
                journal_max_age_s=journal_max_age_s,
                progress=typer.echo,
                workers=workers,
                kill_worker=kill_worker,
                kill_workers=kill_workers,
            )
            typer.echo(wire_soak.summary(report))
        else:
            report = run(
                sessions, seconds, seed=seed, journal_max_age_s=journal_max_age_s, progress=typer.echo
            )
            typer.echo(summary(report))
        if json_out:
            with open(json_out, "w") as f:
                json.dump(report, f, indent=2)
        if not report["ok"]:
            raise typer.Exit(1)

    app.command("soak")(soak)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m duplex_actors.bench.soak", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--journal-max-age-s", type=float, default=60.0, help="warm-up is 1.5x this")
    ap.add_argument("--json", default="")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    progress = None if args.quiet else (lambda line: print(line, flush=True))
    report = run(
        args.sessions,
        args.seconds,
        seed=args.seed,
        journal_max_age_s=args.journal_max_age_s,
        progress=progress,
    )
    print(summary(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
