"""Sessions vs session-runtime replicas on Ray Serve, against a bare single-process server.

The same unpaced ScriptedEngine and the same websocket load as ``workers_bench``: ``sessions``
sessions, each committing 100 ms of audio, sending ``response.create`` and reading to
``response.done`` again and again, from separate load processes. Arms, in one run on one local
Ray cluster:

* ``bare``: ``serve`` as one process (the baseline every ratio divides by);
* ``replicas=N`` for each N in ``replicas``: the Serve app of
  :mod:`duplex_actors.scaleout.ray_serve` with N session-runtime replicas and one engine
  replica (autoscaling pinned to 1, so only the session side varies). Sessions get their URL
  from the router (least loaded first), as real clients would.

``server_cores`` for the Serve arms is every process under this one (the local Ray cluster,
its replicas, and this idle driver) minus the load clients; for ``bare`` it is the server's
process. ``python -m duplex_actors.bench.serve_bench [--quick]`` prints JSON.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import sys
import time
from multiprocessing.context import SpawnContext
from typing import Any, cast

from .ray_bench import _ray_up, _remove_when_quiet
from .workers_bench import _bare_main, _tree_cpu_s, run_load, unpaced_engine


def _serve_arm(
    ctx: SpawnContext, replicas: int, *, sessions: int, clients: int, warmup_s: float, duration_s: float
) -> dict[str, float]:
    import ray
    from ray import serve

    from ..scaleout.ray_serve import _directory, build_app, shutdown_app

    router = serve.run(
        build_app(
            unpaced_engine,
            session_replicas=replicas,
            host="127.0.0.1",
            engine_autoscaling={"min_replicas": 1, "max_replicas": 1},
            session_actor_options={"num_cpus": 0},
            engine_actor_options={"num_cpus": 0},
            report_interval_s=0.5,
        ),
        name="bench",
        route_prefix=None,
    )
    try:
        deadline = time.monotonic() + 120
        while len(ray.get(_directory().snapshot.remote())) < replicas:
            if time.monotonic() > deadline:
                raise RuntimeError("session replicas did not report")
            time.sleep(0.2)
        urls = [router.route.remote(None).result() for _ in range(sessions)]
        load = run_load(
            ctx,
            urls,
            clients=clients,
            warmup_s=warmup_s,
            duration_s=duration_s,
            cpu_of=lambda: _tree_cpu_s(os.getpid()),
        )
        load["server_cores"] -= load["client_cores"]
        load["replicas_used"] = len({url for url in urls})
        return load
    finally:
        shutdown_app("bench")


def _bare_arm(
    ctx: SpawnContext, *, sessions: int, clients: int, warmup_s: float, duration_s: float
) -> dict[str, float]:
    import signal

    ready_recv, ready_send = ctx.Pipe(duplex=False)
    server = ctx.Process(target=_bare_main, args=(ready_send,))
    server.start()
    try:
        if not ready_recv.poll(120):
            raise RuntimeError("bare server did not start")
        url = f"ws://127.0.0.1:{ready_recv.recv()}/v1/realtime"
        return run_load(
            ctx,
            [url] * sessions,
            clients=clients,
            warmup_s=warmup_s,
            duration_s=duration_s,
            cpu_of=lambda: _tree_cpu_s(cast(int, server.pid)),  # set by start()
        )
    finally:
        os.kill(cast(int, server.pid), signal.SIGTERM)
        server.join(30)


def run(
    quick: bool = False,
    *,
    sessions: int = 64,
    clients: int = 2,
    replicas: tuple[int, ...] = (1, 2),
    rounds: int | None = None,
    duration_s: float | None = None,
    warmup_s: float = 1.0,
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    rounds = rounds or (1 if quick else 2)
    duration_s = duration_s or (3.0 if quick else 5.0)
    started_here, temp_dir = _ray_up()
    from ray import serve

    per_round: list[dict[str, dict[str, float]]] = []
    try:
        serve.start(proxy_location="Disabled")
        arms = ["bare", *(f"replicas={n}" for n in replicas)]
        for r in range(rounds):
            figures = {}
            for arm in arms if r % 2 == 0 else list(reversed(arms)):
                kw: dict[str, Any] = {
                    "sessions": sessions,
                    "clients": clients,
                    "warmup_s": warmup_s,
                    "duration_s": duration_s,
                }
                figures[arm] = (
                    _bare_arm(ctx, **kw) if arm == "bare" else _serve_arm(ctx, int(arm.split("=")[1]), **kw)
                )
            per_round.append(figures)
        # ray's serve.shutdown is unannotated
        serve.shutdown()  # type: ignore[no-untyped-call]
    finally:
        if started_here:
            import ray

            ray.shutdown()
            if temp_dir is not None:
                _remove_when_quiet(temp_dir)

    def per_arm(key: str, digits: int) -> dict[str, list[float]]:
        return {arm: [round(f[arm][key], digits) for f in per_round] for arm in arms}

    return {
        "name": "ray_serve_sessions",
        "params": {
            "sessions": sessions,
            "clients": clients,
            "rounds": rounds,
            "duration_s": duration_s,
            "cpus": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(),
        },
        "turns_per_s": per_arm("turns_per_s", 1),
        "server_cores": per_arm("server_cores", 2),
        "client_cores": per_arm("client_cores", 2),
        "ratio_vs_bare": {
            arm: round(
                statistics.median(f[arm]["turns_per_s"] / f["bare"]["turns_per_s"] for f in per_round), 3
            )
            for arm in arms[1:]
        },
        "replicas_used": {arm: [f[arm]["replicas_used"] for f in per_round] for arm in arms[1:]},
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    options: dict[str, Any] = {"quick": "--quick" in args}
    for flag, key, kind in (
        ("--sessions", "sessions", int),
        ("--rounds", "rounds", int),
        ("--duration", "duration_s", float),
    ):
        if flag in args:
            options[key] = kind(args[args.index(flag) + 1])
    print(json.dumps(run(**options), indent=2))
