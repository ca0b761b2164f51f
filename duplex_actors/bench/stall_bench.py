"""Event-loop stalls at scale: idle sessions with periodic reclaim on, and a mass resume.

``python -m duplex_actors.bench.stall_bench --sessions 10000 [--seconds 12] [--reclaim-s 4]``
runs ``serve``'s assembly in this process (``open_server``, GcPolicy included, the scripted
engine), with a loop-lag probe on its event loop: a task that sleeps 5 ms again and again and
records how late each wake-up is. The probe runs first on the bare server (no session: the
baseline, same run), then while a client process holds ``--sessions`` idle sessions over real
sockets, for ``--seconds`` each, with the reclaim pass every ``--reclaim-s`` (30 s in
``serve``; shorter here so that a short run sees several). It prints the lag's max and p99
for both, and the longest collection the collector ran (``gc.callbacks``).

``--resume [--clients 1000]`` is the mass resume: the client process opens ``--sessions``
sessions spread over ``--clients`` clients (each counted
as its own address by the server, from a header: the bench stays on 127.0.0.1), drops every connection at once (they go silent: no close
frame, no RST, no pong, as when a client's network changes under it), and resumes all of them
at once, on new connections; a session whose resume fails for a reason worth retrying (a refused or
timed-out handshake, close 1013) retries after a short random backoff, until the session's
disconnect grace has passed. A neighbour (127.0.0.1), in conversation on its own connection
that the blip did not touch, times GA turns before the drop (the baseline) and during the
resumes; a newcomer times connecting and taking a turn (handshake, refusals and retries
included) alike. Both run in a process of their own, as users do (``--users-in-loop`` puts
them on the server's loop, as the bench did before: their client side then waits behind the
storm as well as the server's). It prints how many resumed, how many were lost (not resumed inside the grace)
and why, and both users' turns before and during.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import json
import multiprocessing
import random
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection
    from websockets.asyncio.server import ServerConnection

    from ..server.app import RealtimeServer

PROBE_SLEEP_S = 0.005
#: Resumes the storm's client starts per pass of its own loop (``--resume-slice``).
RESUME_SLICE = 50
#: How the scripted engine times its answer's 24 outputs (``--engine-pace``). "from-start": each
#: is due 20 ms after the one before it was due, as a real engine decodes in a thread or process
#: of its own (the embedded engine's scheduler thread, vLLM, the engine process of ``--workers``)
#: and its outputs wait in a queue when the loop is late. "after-each": 20 ms after the one before
#: it was taken, so the engine itself runs on the server's loop and every late wake-up lengthens
#: the answer once more (the bench before 2026-12-05: the neighbour's turn counted the loop's
#: lag up to 24 times).
ENGINE_PACES = ("from-start", "after-each")


class LagProbe:
    """How late a task sleeping ``PROBE_SLEEP_S`` again and again wakes up (seconds).

    Also what the loop's thread itself ran meanwhile (its CPU time): on a loaded host the
    wall-clock lag includes time the OS gave to other processes; the CPU time is the loop's
    own stall (a collection, a scan), which is what a test can bound."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.cpu: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            began, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(PROBE_SLEEP_S)
            self.lags.append(time.perf_counter() - began - PROBE_SLEEP_S)
            self.cpu.append(time.thread_time() - cpu)

    def start(self) -> None:
        self.lags, self.cpu = [], []
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> dict[str, float]:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        return {**lag_summary(self.lags), "max_cpu_ms": round(max(self.cpu, default=0.0) * 1e3, 2)}


def lag_summary(lags: list[float]) -> dict[str, float]:
    if not lags:
        return {"samples": 0, "max_ms": 0.0, "p99_ms": 0.0, "p50_ms": 0.0}
    ordered = sorted(lags)
    return {
        "samples": len(ordered),
        "max_ms": round(ordered[-1] * 1e3, 2),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3, 2),
        "p50_ms": round(statistics.median(ordered) * 1e3, 2),
    }


class CollectionTimer:
    """The collector's own pauses, by generation (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.longest: dict[int, float] = {}
        self.count = 0
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            took = time.perf_counter() - self._began
            generation = info["generation"]
            self.longest[generation] = max(self.longest.get(generation, 0.0), took)
            self.count += 1

    def __enter__(self) -> CollectionTimer:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    def summary(self) -> dict[str, float]:
        return {f"gen{g}_longest_ms": round(t * 1e3, 2) for g, t in sorted(self.longest.items())}


# -- the client process -----------------------------------------------------------------------


CLIENT_HEADER = "X-Stall-Bench-Client"


#: The server modules that read a client's address through their own ``_address`` name. The
#: simulation must reach every one: when http_gate.py moved out of app.py with its own copy,
#: patching app alone left every storm handshake charged to 127.0.0.1, the neighbour's own
#: tenant in the loop share, which then held the neighbour's frames and the storm's
#: handshakes as one client's.
ADDRESS_READERS = ("app", "http_gate")


def _address_readers() -> list[Any]:  # modules, whose _address is read and patched
    import importlib

    return [importlib.import_module(f"duplex_actors.server.{name}") for name in ADDRESS_READERS]


def _simulate_addresses() -> None:
    """Count each bench client as its own address (the bench stays on 127.0.0.1): the quotas,
    connect rates and loop share see ``--clients`` clients, as they would 1,000 addresses."""
    from ..server import http_gate

    real = http_gate._address

    def address(ws: ServerConnection) -> str:
        request = getattr(ws, "request", None)
        client = request.headers.get(CLIENT_HEADER) if request is not None else None
        return f"bench-client-{client}" if client is not None else real(ws)

    for module in _address_readers():
        module._address = address


def _client_process(
    url: str,
    sessions: int,
    clients: int,
    resume: bool,
    pipe: Connection[tuple[str, Any], str],
    resume_slice: int = RESUME_SLICE,
) -> None:
    asyncio.run(_client_main(url, sessions, clients, resume, pipe, resume_slice))


def _raw_process(host: str, port: int, count: int, pipe: Connection[tuple[str, int], str]) -> None:
    """Hold ``count`` TCP connections that never send a byte, opened as fast as they go."""
    import socket

    held = []
    for _ in range(count):
        try:
            held.append(socket.create_connection((host, port)))
        except OSError:
            break
    pipe.send(("opened", len(held)))
    pipe.recv()
    for sock in held:
        sock.close()


async def _client_main(
    url: str,
    sessions: int,
    clients: int,
    resume: bool,
    pipe: Connection[tuple[str, Any], str],
    resume_slice: int = RESUME_SLICE,
) -> None:
    from websockets.asyncio.client import connect

    loop = asyncio.get_running_loop()
    opened: list[tuple[ClientConnection, dict[str, Any]]] = []
    gate = asyncio.Semaphore(100)

    async def one(i: int) -> None:
        headers = {CLIENT_HEADER: str(i % clients)}
        async with gate:
            for _attempt in range(20):
                try:
                    ws = await connect(
                        url, additional_headers=headers, ping_interval=None, compression=None, open_timeout=60
                    )
                    created = json.loads(await ws.recv())
                    break
                except Exception:
                    await asyncio.sleep(0.2 + random.random())
            else:
                return
        state = {
            "sid": created["session"]["id"],
            "token": created["resume_token"],
            "generation": 0,
            "last": created.get("server_event_seq", 0),
            "headers": headers,
        }
        opened.append((ws, state))

    await asyncio.gather(*(one(i) for i in range(sessions)))
    pipe.send(("opened", len(opened)))
    command = await loop.run_in_executor(None, pipe.recv)
    if command == "drop" and resume:
        for ws, _ in opened:
            # A blip: the old connections go silent (no close, no RST, no pong), as a client
            # whose network changed under it; the server learns of it from its keepalive or
            # from the resume that takes the session over.
            ws.transport.pause_reading()
        began = time.monotonic()
        grace = 30.0  # SessionConfig.disconnect_grace_s, serve's default
        kept: list[ClientConnection] = []
        # This process's own loop: one process drives every storm client, so a try can time
        # out on its own side (its 101 waiting here behind thousands of others), not only
        # on the server's.
        probe = LagProbe()
        probe.start()
        tries = [_resume_one(url, state, began + grace - 1.0, kept) for _, state in opened]
        if resume_slice:
            # Every resume starts at once, as far as the server can tell, but this loop takes
            # a pass between slices: started all in one pass, their first steps held it for
            # seconds (8,000 at once: 5.6 s), and every try's 10 s handshake timer ran through
            # that stall while no answer could be read. Clients on machines of their own
            # have no such stall.
            tasks: list[asyncio.Future[tuple[str, int]]] = []
            for start in range(0, len(tries), resume_slice):
                tasks.extend(asyncio.ensure_future(t) for t in tries[start : start + resume_slice])
                await asyncio.sleep(0)
            outcomes = await asyncio.gather(*tasks)
        else:
            outcomes = await asyncio.gather(*tries)
        took = time.monotonic() - began
        client_loop = await probe.stop()
        tally: dict[str, int] = {}
        for outcome, _ in outcomes:
            tally[outcome] = tally.get(outcome, 0) + 1
        attempts = sum(n for _, n in outcomes)
        pipe.send(
            (
                "resumed",
                {
                    "outcomes": tally,
                    "attempts": attempts,
                    "failed_tries": FAILURES,
                    "seconds": round(took, 2),
                    "client_loop": client_loop,
                },
            )
        )
        await loop.run_in_executor(None, pipe.recv)
        for ws in kept:
            ws.transport.abort()
    for ws, _ in opened:
        ws.transport.abort()


FAILURES: dict[str, int] = {}  # every failed try, by reason (the client process's)


async def _resume_one(
    url: str, state: dict[str, Any], deadline: float, kept: list[ClientConnection]
) -> tuple[str, int]:
    """Resume one session until it works, a refusal that is final, or ``deadline``; a resumed
    connection is kept open (in ``kept``), as its client would keep it. Each try waits up to
    10 s for its handshake and 10 s for its answer, as websockets' clients do by default."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

    attempts = 0
    last = "timeout"
    while time.monotonic() < deadline:
        attempts += 1
        stage, ws = "handshake", None
        try:
            ws = await connect(
                f"{url}?session_id={state['sid']}",
                additional_headers=state["headers"],
                ping_interval=None,
                compression=None,
                open_timeout=min(10.0, max(1.0, deadline - time.monotonic())),
            )
            stage = "resume"
            await ws.send(
                json.dumps(
                    {
                        "type": "session.resume",
                        "session_id": state["sid"],
                        "generation": state["generation"],
                        "resume_token": state["token"],
                        "last_seq": state["last"],
                        # the same resume again: a try whose answer was lost gets it
                        "control_id": "r1",
                    }
                )
            )
            while True:
                wait = min(10.0, max(1.0, deadline - time.monotonic()))
                event = json.loads(await asyncio.wait_for(ws.recv(), wait))
                if event["type"] == "session.resumed":
                    kept.append(ws)
                    return "resumed", attempts
                if event["type"] == "error" and event.get("server_event_seq") is None:
                    last = f"refused:{event['error']['code']}"
                    break
        except InvalidStatus as exc:
            last = f"http:{exc.response.status_code}"
        except (TimeoutError, ConnectionClosed, InvalidHandshake, OSError) as exc:
            last = f"{stage}:{type(exc).__name__}"
        if ws is not None:
            ws.transport.abort()
        FAILURES[last] = FAILURES.get(last, 0) + 1
        if last.startswith("refused:") and last not in (
            "refused:quota_exceeded",
            "refused:resource_exhausted",
        ):
            return last, attempts
        await asyncio.sleep(0.2 + random.random() * 0.8)
    return last, attempts


# -- the server side --------------------------------------------------------------------------


#: Where the newcomer connects from: a loopback address of its own, so that every part of the
#: server that tells clients apart by their socket's address (the opening slots) sees another
#: client than the storm's, whose connections all come from 127.0.0.1.
NEWCOMER_SOURCE = "127.0.0.3"


async def _newcomer_turn(url: str) -> float:
    """A user who connects now and takes one turn: the handshake included."""
    began = time.perf_counter()
    from .flood_bench import _turn

    await _turn(url, source=NEWCOMER_SOURCE)
    return time.perf_counter() - began


class _Neighbour:
    """A user in the middle of a conversation on its own connection, untouched by the blip:
    each turn is 100 ms of audio, a commit and a response, timed to its ``response.done``."""

    APPEND = json.dumps(
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x01\x00" * 2400).decode()}
    )
    TURN = (
        APPEND,
        json.dumps({"type": "input_audio_buffer.commit"}),
        json.dumps({"type": "response.create"}),
    )

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        #: where the slowest turn's time went: until response.created, and the longest wait
        #: between two of its events after that (ms)
        self.slowest: dict[str, float] = {}

    async def turn(self) -> float:
        began = time.perf_counter()
        for text in self.TURN:
            await self.ws.send(text)
        created_ms, longest_gap_ms, last = None, 0.0, began
        while True:
            kind = json.loads(await self.ws.recv())["type"]
            now = time.perf_counter()
            if created_ms is None and kind == "response.created":
                created_ms = (now - began) * 1e3
            elif created_ms is not None:
                longest_gap_ms = max(longest_gap_ms, (now - last) * 1e3)
            last = now
            if kind == "response.done":
                break
        took = time.perf_counter() - began
        if took * 1e3 > self.slowest.get("turn_ms", 0):
            self.slowest = {
                "turn_ms": round(took * 1e3, 1),
                "until_created_ms": round(created_ms or 0, 1),
                "longest_gap_after_ms": round(longest_gap_ms, 1),
            }
        return took


async def _users_alone(neighbour: _Neighbour, url: str) -> tuple[float, float]:
    """The two users' turns before the drop: their medians (seconds)."""
    alone = statistics.median([await neighbour.turn() for _ in range(5)])
    neighbour.slowest = {}
    return alone, statistics.median([await _newcomer_turn(url) for _ in range(5)])


async def _users_during(neighbour: _Neighbour, url: str, until: asyncio.Future[Any]) -> dict[str, Any]:
    """Both users take turns, one after another each, until ``until`` is done."""
    turns: list[float] = []
    newcomer_turns: list[float] = []
    refused = 0

    async def neighbour_turns() -> None:
        while not until.done():
            turns.append(await neighbour.turn())

    async def newcomer_turns_() -> None:
        nonlocal refused
        while not until.done():
            # a turn as a user who connects now waits for it: refused tries (503) and their
            # retries included
            began = time.perf_counter()
            while True:
                try:
                    await _newcomer_turn(url)
                    break
                except Exception:
                    refused += 1
                    await asyncio.sleep(0.2)
            newcomer_turns.append(time.perf_counter() - began)

    await asyncio.gather(neighbour_turns(), newcomer_turns_())
    return {
        "neighbour_during_ms": _median_ms(turns),
        "neighbour_worst_ms": _max_ms(turns),
        "neighbour_turns": len(turns),
        "neighbour_slowest": neighbour.slowest,
        "newcomer_during_ms": _median_ms(newcomer_turns),
        "newcomer_worst_ms": _max_ms(newcomer_turns),
        "newcomer_turns": len(newcomer_turns),
        "newcomer_refused": refused,
    }


def _users_process(url: str, pipe: Connection[tuple[float, float] | dict[str, Any], str]) -> None:
    """The neighbour and the newcomer in a process of their own, as real users are: on the
    server's loop, their own sends, receives and JSON waited behind the storm too, so their
    turns measured the storm twice (once per side of the socket)."""
    asyncio.run(_users_main(url, pipe))


async def _users_main(url: str, pipe: Connection[tuple[float, float] | dict[str, Any], str]) -> None:
    from websockets.asyncio.client import connect

    loop = asyncio.get_running_loop()
    ws = await connect(url, max_size=None)
    await ws.recv()
    neighbour = _Neighbour(ws)
    pipe.send(await _users_alone(neighbour, url))
    await loop.run_in_executor(None, pipe.recv)  # the storm began
    until = loop.run_in_executor(None, pipe.recv)
    pipe.send(await _users_during(neighbour, url, until))
    await ws.close()


def _counts(server: RealtimeServer) -> dict[str, float]:
    """The server's resume outcomes, pacing and disconnects so far (its /metrics)."""
    counts = {}
    for family in server.metrics.registry.collect():
        if family.name in (
            "duplex_resumes",
            "duplex_client_paced_seconds",
            "duplex_disconnects",
            "duplex_connections_accepted",
        ):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    label = ",".join(str(v) for v in sample.labels.values())
                    counts[f"{family.name}[{label}]"] = round(sample.value, 2)
    return counts


def _median_ms(samples: list[float]) -> float | None:
    return round(statistics.median(samples) * 1e3, 1) if samples else None


def _max_ms(samples: list[float]) -> float | None:
    return round(max(samples) * 1e3, 1) if samples else None


def _timed_ms(work: Callable[[], object]) -> float:
    began = time.perf_counter()
    work()
    return round((time.perf_counter() - began) * 1e3, 2)


async def run(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """The bench (arguments as ``_run``); what it patches for the run is put back after it."""
    from ..actors import gc_policy

    readers = _address_readers()
    addresses = [module._address for module in readers]
    saved = (gc_policy.reclaim, gc_policy.reclaim_due)
    try:
        return await _run(*args, **kwargs)
    finally:
        gc_policy.reclaim, gc_policy.reclaim_due = saved
        for module, address in zip(readers, addresses, strict=True):
            module._address = address


async def _run(
    sessions: int,
    seconds: float,
    reclaim_s: float,
    resume: bool = False,
    clients: int = 1000,
    reclaim_on_clock: bool = False,
    growth_only: bool = False,
    raw: bool = False,
    max_connections: int | None = None,
    config_overrides: dict[str, Any] | None = None,
    users_in_loop: bool = False,
    resume_slice: int = RESUME_SLICE,
    engine_pace: str = "from-start",
) -> dict[str, Any]:
    from ..actors import gc_policy
    from ..engines.scripted import Script, ScriptedEngine
    from ..server.app import ServerConfig
    from ..server.cli_commands import open_server
    from ..server.lingering import LINGERING

    _simulate_addresses()
    # serve's connection limit, unless the idle sessions alone need more
    limit = max_connections or max(ServerConfig().max_connections, sessions + 100)
    config = ServerConfig(port=0, max_connections=limit, **(config_overrides or {}))
    if engine_pace not in ENGINE_PACES:
        raise ValueError(f"engine_pace: one of {ENGINE_PACES}")
    script = Script(
        tokens=tuple(f" w{i}" for i in range(24)),
        audio_packets=12,
        token_latency_s=0.02,
        paced_from_start=engine_pace == "from-start",
    )
    mode = "resume" if resume else "raw" if raw else "idle"
    report: dict[str, Any] = {
        "sessions": sessions,
        "reclaim_s": reclaim_s,
        "mode": mode,
        "engine_pace": engine_pace,
    }
    if growth_only:
        report["growth_only"] = True
        # The policy before serve estimated the garbage: memory growth alone decides.
        due = gc_policy.reclaim_due
        gc_policy.reclaim_due = lambda policy, resident, after, garbage=None: due(policy, resident, after)  # type: ignore[assignment]
    if reclaim_on_clock:
        report["reclaim_on_clock"] = True
        # The policy before reclaims were due on growth: every interval, whatever memory did.
        gc_policy.reclaim_due = lambda *_: True
    reclaims: list[dict[str, Any]] = []
    real_reclaim = gc_policy.reclaim

    def logged_reclaim() -> int:
        before, cpu = gc_policy.resident_bytes(), time.thread_time()
        found = real_reclaim()
        reclaims.append(
            {
                "at_s": round(time.perf_counter() - started, 1),
                "cpu_ms": round((time.thread_time() - cpu) * 1e3, 1),
                "rss_mb": round((before or 0) / 2**20),
                "found": found,
            }
        )
        return found

    gc_policy.reclaim = logged_reclaim
    report["reclaims"] = reclaims  # the policy's full collections: when, what they cost
    started = time.perf_counter()
    probe = LagProbe()
    async with open_server(ScriptedEngine(script, record=False), config, gc_reclaim_s=reclaim_s) as server:
        loop = asyncio.get_running_loop()
        with CollectionTimer() as timer:
            probe.start()
            await asyncio.sleep(seconds)
            report["baseline"] = {**await probe.stop(), **timer.summary()}
        users_process = users_pipe = neighbour = neighbour_ws = None
        if resume and users_in_loop:
            from websockets.asyncio.client import connect

            neighbour_ws = await connect(server.url, max_size=None)
            await neighbour_ws.recv()
            neighbour = _Neighbour(neighbour_ws)
            alone = await _users_alone(neighbour, server.url)
        elif resume:
            users_pipe, users_end = multiprocessing.get_context("spawn").Pipe()
            users_process = multiprocessing.get_context("spawn").Process(
                target=_users_process, args=(server.url, users_end), daemon=True
            )
            users_process.start()
            alone = await loop.run_in_executor(None, users_pipe.recv)
        if resume:
            report["users"] = "in the server's loop" if users_in_loop else "a process of their own"
            report["neighbour_alone_ms"] = round(alone[0] * 1e3, 1)
            report["newcomer_alone_ms"] = round(alone[1] * 1e3, 1)
        parent, child = multiprocessing.get_context("spawn").Pipe()
        target: Callable[..., None]
        args: tuple[Any, ...]
        if raw:
            target, args = _raw_process, (config.host, server.port, sessions, child)
        else:
            target, args = _client_process, (server.url, sessions, clients, resume, child, resume_slice)
        process = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
        process.start()
        began = time.perf_counter()
        with CollectionTimer() as timer:
            probe.start()  # the ramp: the reclaims the sessions' growth is owed fall here
            _, count = await loop.run_in_executor(None, parent.recv)
            report["opening"] = {**await probe.stop(), **timer.summary()}
        report["opened"] = count
        report["open_s"] = round(time.perf_counter() - began, 1)
        report["server_sessions"] = server.runtime.session_count
        if not resume:
            # The first window may still take a reclaim the sessions' growth is owed; the
            # second is the steady state.
            for window in ("idle_first", "idle_steady"):
                with CollectionTimer() as timer:
                    began_s = round(time.perf_counter() - started, 1)
                    probe.start()
                    await asyncio.sleep(seconds)
                    report[window] = {"began_s": began_s, **await probe.stop(), **timer.summary()}
            report["one_reap_ms"] = _timed_ms(server.runtime.reap_now)
            report["one_sweep_ms"] = _timed_ms(server._sweep)
        else:
            with CollectionTimer() as timer:
                probe.start()
                parent.send("drop")
                waiting = loop.run_in_executor(None, parent.recv)
                if neighbour is not None:
                    users = await _users_during(neighbour, server.url, waiting)
                else:
                    assert users_pipe is not None
                    users_pipe.send("storm")
                    users_report = loop.run_in_executor(None, users_pipe.recv)
                    await asyncio.wait([waiting])
                    users_pipe.send("stop")
                    users = await users_report
                _, resumed = await waiting
                report["resume"] = {**resumed, **await probe.stop(), **timer.summary()}
                report.update(users)
                report["server_counts"] = _counts(server)
                # what the reclaim policy sees: closed connections and transports not yet freed
                report["unfreed"] = {"connections": LINGERING.connections, "transports": LINGERING.transports}
            if neighbour_ws is not None:
                await neighbour_ws.close()
            if users_process is not None:
                users_process.join(30)
        parent.send("stop")
        process.join(60)
        if process.is_alive():
            process.kill()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=3000)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--reclaim-s", type=float, default=4.0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--max-connections", type=int, default=None, help="the server's (default: serve's)")
    parser.add_argument("--raw", action="store_true", help="idle TCP connections that never send a byte")
    parser.add_argument(
        "--reclaim-on-clock", action="store_true", help="reclaim at every interval (the policy before growth)"
    )
    parser.add_argument(
        "--growth-only",
        action="store_true",
        help="reclaim on memory growth alone, ignoring serve's estimate of the garbage (an A/B)",
    )
    parser.add_argument(
        "--loop-share-floor", type=float, default=None, help="loop_share_floor_s_per_s (an A/B; 0 before)"
    )
    parser.add_argument("--no-loop-share", action="store_true", help="loop_share_s_per_s=None (an A/B)")
    parser.add_argument(
        "--takeover-close-wait",
        type=float,
        default=None,
        help="app.TAKEOVER_CLOSE_WAIT_S (an A/B; 1.0 before)",
    )
    parser.add_argument(
        "--opening-slots",
        type=int,
        default=None,
        help="max_opening_connections: handshakes at once (an A/B; serve's default otherwise)",
    )
    parser.add_argument(
        "--backlog", type=int, default=None, help="the listening socket's (an A/B; asyncio's 100)"
    )
    parser.add_argument(
        "--users-in-loop",
        action="store_true",
        help="run the neighbour and the newcomer on the server's own loop (an A/B: the bench before "
        "2026-12-04 20:00 UTC did; their client side then waited behind the storm too)",
    )
    parser.add_argument(
        "--resume-slice",
        type=int,
        default=RESUME_SLICE,
        help="resumes the storm's client process starts per pass of its loop (0: all in one pass, "
        "as the bench did before 2026-12-04 20:30 UTC)",
    )
    parser.add_argument(
        "--engine-pace",
        choices=ENGINE_PACES,
        default=ENGINE_PACES[0],
        help="how the scripted engine times its answers (from-start: as a real engine in its own "
        "thread or process; after-each: on the server's loop, as the bench did before 2026-12-05)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.backlog is not None:
        import functools

        from ..server import app

        # app's own name for websockets' serve, patched (strict mypy wants re-exports explicit)
        app.serve = functools.partial(app.serve, backlog=args.backlog)  # type: ignore[attr-defined]
    if args.takeover_close_wait is not None:
        from ..server import app

        app.TAKEOVER_CLOSE_WAIT_S = args.takeover_close_wait
    report = asyncio.run(
        run(
            args.sessions,
            args.seconds,
            args.reclaim_s,
            args.resume,
            args.clients,
            reclaim_on_clock=args.reclaim_on_clock,
            growth_only=args.growth_only,
            raw=args.raw,
            max_connections=args.max_connections,
            config_overrides={
                **({"loop_share_s_per_s": None} if args.no_loop_share else {}),
                **(
                    {}
                    if args.loop_share_floor is None
                    else {"loop_share_floor_s_per_s": args.loop_share_floor}
                ),
                **({} if args.opening_slots is None else {"max_opening_connections": args.opening_slots}),
            },
            users_in_loop=args.users_in_loop,
            resume_slice=args.resume_slice,
            engine_pace=args.engine_pace,
        )
    )
    from .report import print_and_save

    print_and_save(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
