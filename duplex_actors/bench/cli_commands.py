"""``duplex-actors bench``: run the benchmark suite (also ``python -m duplex_actors.bench``)."""

from __future__ import annotations

import importlib
import importlib.util
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from . import report

BENCHES = ("throughput", "scale", "realtime", "barge_in", "wire", "wire_capacity", "engine", "vllm")
#: Benches run only when named with --only (they start heavy machinery of their own).
OPT_IN = ("ray",)
_HINTS = {
    "torch": " (extra 'embedded')",
    "vllm": " (vLLM lives in its own venv, see docs/engines.md: "
    "<that venv>/bin/python -m duplex_actors.bench --quick --only vllm)",
    "ray": " (extra 'ray')",
}


def _engine_bench(name: str, module: str, needs: str, quick: bool) -> dict[str, Any]:
    """The engine teams' benches: run only when their module and its heavy dependency exist."""
    if importlib.util.find_spec(needs) is None:
        hint = _HINTS.get(needs, "")
        return {"name": name, "skipped": f"'{needs}' is not installed in this environment{hint}"}
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return {"name": name, "skipped": f"{module} is not present in this checkout"}
        raise
    raw = mod.run(quick=quick)
    if isinstance(raw, dict) and "figures" in raw:
        return {"params": raw.get("params", {}), **raw, "name": name}
    figures = _embedded_figures(raw) if name == "engine" else None
    return {"name": name, "params": {"quick": quick}, "raw": raw, "figures": figures}


def _embedded_figures(raw: dict[str, Any]) -> list[dict[str, Any]] | None:
    """engine_bench returns tokens/s per concurrency for the engine and a bare decode loop of
    the same model, each pair from the round whose ratio was the median; show them as figures
    with ratios (its targets: >= 0.8x bare at each concurrency, and batch 64 >= 10x sequential
    batch-1)."""
    from .runtime_bench import figure

    try:
        engine, bare = raw["engine_tokens_per_s"], raw["bare_tokens_per_s"]
        figs = []
        for n in engine:
            ratio_ok = engine[n] / bare[n] >= raw.get("targets", {}).get("engine_vs_bare", 0.8)
            figs.append(
                figure(
                    f"embedded engine, {n} concurrent requests (median of paired rounds)",
                    engine[n],
                    "tok/s",
                    bare[n],
                    "bare batched decode loop, same model",
                    target=">= 0.8x bare",
                    met=ratio_ok,
                    higher_is_better=True,
                )
            )
        seq = raw["sequential_b1_tokens_per_s"]
        top = max(engine, key=lambda k: int(k))
        paired = raw.get("engine64_paired_tokens_per_s", engine[top])
        figs.append(
            figure(
                f"embedded engine at {top} vs sequential batch 1 (median of paired rounds)",
                paired,
                "tok/s",
                seq,
                "bare loop, batch 1, one request after another",
                target=">= 10x",
                met=paired / seq >= 10,
                higher_is_better=True,
            )
        )
        return figs
    except (KeyError, TypeError, ZeroDivisionError, ValueError):
        return None  # an unexpected shape: printed key by key instead


def _wire(quick: bool) -> dict[str, Any]:
    if importlib.util.find_spec("websockets") is None:
        return {"name": "wire", "skipped": "'websockets' is not installed (extra 'server')"}
    from .wire_bench import bench_wire

    return bench_wire(quick)


def _wire_capacity(quick: bool) -> dict[str, Any]:
    if importlib.util.find_spec("websockets") is None:
        return {"name": "wire_capacity", "skipped": "'websockets' is not installed (extra 'server')"}
    from .wire_capacity_bench import bench_wire_capacity

    return bench_wire_capacity(quick, echo=lambda _line: None)


def _plan(quick: bool) -> dict[str, Callable[[], dict[str, Any]]]:
    from . import runtime_bench as rb

    return {
        "throughput": lambda: rb.bench_throughput(quick),
        "scale": lambda: rb.bench_scale(quick),
        "realtime": lambda: rb.bench_realtime(quick),
        "barge_in": lambda: rb.bench_barge_in(quick),
        "wire": lambda: _wire(quick),
        "wire_capacity": lambda: _wire_capacity(quick),
        "engine": lambda: _engine_bench("engine", "duplex_actors.bench.engine_bench", "torch", quick),
        "vllm": lambda: _engine_bench("vllm", "duplex_actors.bench.vllm_bench", "vllm", quick),
        "ray": lambda: _engine_bench("ray", "duplex_actors.bench.ray_bench", "ray", quick),
    }


def run_suite(
    quick: bool = False,
    out: Path = Path("bench-results"),
    only: list[str] | None = None,
    echo: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    wanted = list(only or BENCHES)
    unknown = [w for w in wanted if w not in BENCHES + OPT_IN]
    if unknown:
        raise typer.BadParameter(f"unknown benchmark(s) {unknown}; choose from {list(BENCHES + OPT_IN)}")
    plan = _plan(quick)
    results: list[dict[str, Any]] = []
    echo(
        f"duplex_actors bench ({'quick' if quick else 'full'}): every figure is printed with a "
        f"bare baseline measured in this run; ratio = runtime / bare"
    )
    for name in wanted:
        t0 = time.perf_counter()
        try:
            result = plan[name]()
        except Exception as exc:  # one failing bench must not hide the others' figures
            result = {"name": name, "error": _describe(exc), "traceback": traceback.format_exc()}
        result["seconds"] = time.perf_counter() - t0
        report.print_result(result, echo)
        echo(f"  ({result['seconds']:.1f} s)")
        results.append(result)
    path = report.write_json(results, out, quick=quick)
    md = report.write_markdown(results, out)
    pngs = report.write_pngs(results, out, echo)
    echo(f"wrote {path}, {md}" + "".join(f", {p}" for p in pngs))
    return results


def _describe(exc: BaseException) -> str:
    """The leaf errors, not just 'unhandled errors in a TaskGroup'."""
    leaves = []

    def walk(e: BaseException) -> None:
        subs = getattr(e, "exceptions", None)
        if subs:
            for sub in subs:
                walk(sub)
        else:
            leaves.append(f"{type(e).__name__}: {e}")

    walk(exc)
    return "; ".join(leaves)


def bench(
    quick: bool = typer.Option(False, "--quick", help="Small sizes; finishes in under two minutes."),
    out: Path = typer.Option(Path("bench-results"), "--out", help="Directory for JSON and PNGs."),
    only: list[str] | None = typer.Option(
        None,
        "--only",
        help=f"Run only this benchmark (repeatable): {', '.join(BENCHES)}; opt-in only: {', '.join(OPT_IN)}.",
    ),
) -> None:
    """Benchmark the runtime: throughput, session scale, real-time load, barge-in, engines."""
    results = run_suite(quick, out, only, typer.echo)
    if any(r.get("error") for r in results):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
