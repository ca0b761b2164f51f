"""What hosting the engine in a Ray actor costs: the same ScriptedEngine, in-process vs RayEngine.

Both sides run through a full :class:`~duplex_actors.Runtime` on the same loop, in the same
run; the baseline is the in-process engine and every figure is printed with
``ratio = ray / in-process``. The script has no model and no pacing (zero latencies), so what
is measured is the transport's share, i.e. the worst case: a real engine's own decode time
makes the ratio smaller, while the *added* milliseconds stay roughly the same.

* ``turn_latency``: one session, turns one after another, commit to ``response.done``.
* ``throughput``: ``sessions`` sessions at once, each doing ``turns`` turns; turns per second.
* ``added_per_output``: (ray turn latency - in-process turn latency) / outputs per turn.

``run(quick=True)`` returns a plain dict; ``python -m duplex_actors.bench.ray_bench`` prints it.
Ray is started here (loopback only, 2 CPUs, no dashboard, temp dir in a scratch folder) unless
the caller already did, and stopped again if it was started here.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, cast

import anyio

from ..actors.runtime import Runtime
from ..actors.session_handle import SessionHandle
from ..core.events import ResponseDone
from ..engines.base import EngineBackend
from ..engines.scripted import Script, ScriptedEngine

CHUNK = b"\0\0" * 320  # 20 ms of pcm16 at 16 kHz
now = time.perf_counter

#: 8 tokens + 3 audio packets + the speak decision + TurnDone: 13 outputs per turn.
SCRIPT = Script()
OUTPUTS_PER_TURN = 1 + len(SCRIPT.tokens) + SCRIPT.audio_packets + 1


def _scripted() -> EngineBackend:  # module level: picklable by reference into the actor
    return ScriptedEngine(SCRIPT)


def figure(
    metric: str,
    value: float | None,
    unit: str,
    baseline: float | None,
    baseline_label: str = "in-process ScriptedEngine",
    *,
    higher_is_better: bool = False,
) -> dict[str, Any]:
    ratio = value / baseline if value is not None and baseline else None
    return {
        "metric": metric,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "baseline_label": baseline_label,
        "ratio": ratio,
        "higher_is_better": higher_is_better,
    }


async def _turn(session: SessionHandle) -> float:
    t0 = now()
    session.append_audio(CHUNK * 5)
    await session.commit()
    async for event in session.events():
        if event.type == "response.done":
            done = cast(ResponseDone, event)  # the wire name says which event class it is
            if done.status != "completed":
                raise RuntimeError(f"bench turn ended {done.status}")
            return now() - t0
    raise RuntimeError("event stream ended before response.done")


async def _measure(
    engine: EngineBackend, *, turns: int, sessions: int, turns_each: int, warmup: int
) -> dict[str, Any]:
    async with Runtime(engine) as rt:
        session = await rt.open_session()
        for _ in range(warmup):
            await _turn(session)
        latencies = [await _turn(session) for _ in range(turns)]
        await session.close()

        many = [await rt.open_session() for _ in range(sessions)]

        async def drive(s: SessionHandle) -> None:
            for _ in range(turns_each):
                await _turn(s)

        t0 = now()
        async with anyio.create_task_group() as tg:
            for s in many:
                tg.start_soon(drive, s)
        elapsed = now() - t0
        for s in many:
            await s.close()
    return {"latencies": latencies, "turns_per_s": sessions * turns_each / elapsed}


def _ray_up() -> tuple[bool, str | None]:
    # Read by Ray at import: single-machine mode keeps every Ray server on 127.0.0.1 (passing
    # _node_ip_address="127.0.0.1" is not enough, Ray resolves it to the routable address).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return False, None
    temp_dir = tempfile.mkdtemp(prefix="dxray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=256 * 1024 * 1024,
        _temp_dir=temp_dir,
        log_to_driver=False,
    )
    return True, temp_dir


def _remove_when_quiet(path: str, attempts: int = 10) -> None:
    """Ray's helper processes may still write a file or two just after shutdown."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        time.sleep(0.2)
        if not os.path.exists(path):
            return


def run(quick: bool = True) -> dict[str, Any]:
    from ..engines.ray_engine import RayEngine

    params = {
        "turns": 40 if quick else 300,
        "sessions": 8 if quick else 32,
        "turns_each": 5 if quick else 20,
        "warmup": 5 if quick else 20,
        "outputs_per_turn": OUTPUTS_PER_TURN,
    }
    started_here, temp_dir = _ray_up()
    try:
        t0 = now()
        local = anyio.run(
            lambda: _measure(
                _scripted(),
                turns=params["turns"],
                sessions=params["sessions"],
                turns_each=params["turns_each"],
                warmup=params["warmup"],
            )
        )
        ray_engine = RayEngine(_scripted, actor_options={"num_cpus": 0})

        async def remote() -> dict[str, Any]:
            try:
                return await _measure(
                    ray_engine,
                    turns=params["turns"],
                    sessions=params["sessions"],
                    turns_each=params["turns_each"],
                    warmup=params["warmup"],
                )
            finally:
                await ray_engine.aclose()  # idempotent; the runtime may already have

        far = anyio.run(remote)
        wall = now() - t0
    finally:
        if started_here:
            import ray

            ray.shutdown()
            if temp_dir is not None:
                _remove_when_quiet(temp_dir)

    local_p50 = statistics.median(local["latencies"])
    far_p50 = statistics.median(far["latencies"])
    local_p90 = sorted(local["latencies"])[int(0.9 * len(local["latencies"]))]
    far_p90 = sorted(far["latencies"])[int(0.9 * len(far["latencies"]))]
    added = far_p50 - local_p50
    return {
        "name": "ray_engine_overhead",
        "params": params,
        "wall_s": wall,
        "figures": [
            figure("turn latency p50 (commit to response.done)", far_p50 * 1e3, "ms", local_p50 * 1e3),
            figure("turn latency p90", far_p90 * 1e3, "ms", local_p90 * 1e3),
            figure(
                f"throughput, {params['sessions']} sessions at once",
                far["turns_per_s"],
                "turns/s",
                local["turns_per_s"],
                higher_is_better=True,
            ),
            figure("added latency per turn (p50)", added * 1e3, "ms", None),
            figure("added latency per output (p50)", added / OUTPUTS_PER_TURN * 1e3, "ms", None),
        ],
    }


def _print(result: dict[str, Any]) -> None:
    print(f"{result['name']}  params={json.dumps(result['params'])}  wall={result['wall_s']:.1f}s")
    for f in result["figures"]:
        base = "" if f["baseline"] is None else f"  baseline {f['baseline']:.3f} ({f['baseline_label']})"
        ratio = "" if f["ratio"] is None else f"  ratio {f['ratio']:.2f}"
        print(f"  {f['metric']}: {f['value']:.3f} {f['unit']}{base}{ratio}")


if __name__ == "__main__":
    import sys

    _print(run(quick="--full" not in sys.argv))
