"""Printing, JSON and pictures for the benchmark suite.

A result is the dict a ``bench_*`` function returns; its ``figures`` are printed one per line
as ``value | bare baseline | ratio | target``. Pictures need matplotlib (extra ``embedded``);
without it the suite still prints and writes JSON, and says that it drew nothing.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Echo = Callable[[str], None]


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    v = float(value)
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    if abs(v) >= 0.1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _verdict(fig: dict[str, Any]) -> str:
    if fig.get("target") is None:
        return ""
    met = fig.get("met")
    mark = "met" if met else ("MISSED" if met is False else "?")
    return f"target {fig['target']}: {mark}"


def format_figure(fig: dict[str, Any]) -> str:
    parts = [f"{fig['metric']}: {_num(fig['value'])} {fig['unit']}"]
    if fig.get("baseline") is not None:
        parts.append(f"bare {_num(fig['baseline'])} {fig['unit']} ({fig['baseline_label']})")
        parts.append(f"ratio {_num(fig['ratio'])}x")
    verdict = _verdict(fig)
    if verdict:
        parts.append(verdict)
    return "  " + " | ".join(parts)


def print_result(result: dict[str, Any], echo: Echo = print) -> None:
    echo(f"[{result['name']}] {json.dumps(result.get('params', {}))}")
    if result.get("skipped"):
        echo(f"  skipped: {result['skipped']}")
        return
    if result.get("error"):
        echo(f"  error: {result['error']}")
        return
    figures = result.get("figures")
    if figures:
        for fig in figures:
            echo(format_figure(fig))
    else:  # an engine bench that returns its own shape: show its top-level figures
        for key, value in result.get("raw", {}).items():
            if isinstance(value, (int, float, str)) or value is None:
                echo(f"  {key}: {_num(value) if not isinstance(value, str) else value}")
    for key, value in (result.get("counts") or {}).items():
        echo(f"  {key}: {value}")


def environment() -> dict[str, Any]:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_at_end": load,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(results: list[dict[str, Any]], out: Path, *, quick: bool) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.json"
    doc = {"quick": quick, "environment": environment(), "results": results}
    path.write_text(json.dumps(doc, indent=1, default=str))
    return path


def markdown_table(results: list[dict[str, Any]]) -> str:
    lines = ["| benchmark | figure | runtime | bare baseline | ratio | target |", "|---|---|---|---|---|---|"]
    for r in results:
        if r.get("skipped") or r.get("error"):
            lines.append(f"| {r['name']} | {r.get('skipped') or r.get('error')} | | | | |")
            continue
        for f in r.get("figures") or []:
            base = (
                ""
                if f.get("baseline") is None
                else f"{_num(f['baseline'])} {f['unit']} ({f['baseline_label']})"
            )
            ratio = "" if f.get("ratio") is None else f"{_num(f['ratio'])}x"
            lines.append(
                f"| {r['name']} | {f['metric'].strip()} | {_num(f['value'])} {f['unit']} | "
                f"{base} | {ratio} | {_verdict(f)} |"
            )
    return "\n".join(lines) + "\n"


def write_markdown(results: list[dict[str, Any]], out: Path) -> Path:
    path = out / "bench.md"
    path.write_text(markdown_table(results))
    return path


# --------------------------------------------------------------------------- pictures


def write_pngs(results: list[dict[str, Any]], out: Path, echo: Echo = print) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        echo("  matplotlib is not installed (extra 'embedded'): no PNGs drawn")
        return []
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    by_name = {r["name"]: r for r in results if not r.get("skipped") and not r.get("error")}

    if "realtime" in by_name:
        series = by_name["realtime"]["series"]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, (n, s) in enumerate(series.items()):
            color = f"C{i}"
            if s["runtime"]:
                xs, ys = zip(*s["runtime"])
                ax.plot(xs, ys, color=color, label=f"runtime, N={n}")
            if s["bare"]:
                xs, ys = zip(*s["bare"])
                ax.plot(xs, ys, color=color, linestyle="--", label=f"bare task+queue, N={n}")
        ax.axvline(5, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("chunk due -> processed (ms, log)")
        ax.set_ylabel("fraction of chunks")
        ax.set_title("Real-time load: 20 ms chunks at real cadence")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / "realtime_cdf.png", plt))

    if "barge_in" in by_name:
        series = by_name["barge_in"]["series"]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, pts in series.items():
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, label=label, linestyle="--" if "baseline" in label else "-")
        ax.axvline(1, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("time after the barge-in command (ms, log)")
        ax.set_ylabel("fraction of barge-ins")
        ax.set_title(f"Barge-in stop latency, {by_name['barge_in']['params']['sessions']} sessions")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / "barge_in_cdf.png", plt))

    if "scale" in by_name:
        series = by_name["scale"]["series"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for label, steps in series.items():
            ns = [s["sessions"] for s in steps]
            a1.plot(ns, [s["seconds"] / s["sessions"] * 1e6 for s in steps], marker="o", label=label)
            a2.plot(ns, [s["rss_bytes"] / s["sessions"] / 1024 for s in steps], marker="o", label=label)
        a1.axhline(50, color="grey", linewidth=0.8)
        a1.set_xlabel("sessions open")
        a1.set_ylabel("open time per session (us, cumulative mean)")
        a2.set_xlabel("sessions open")
        a2.set_ylabel("RSS per session (KiB)")
        for a in (a1, a2):
            a.legend(fontsize=8)
            a.grid(alpha=0.3)
        fig.suptitle("Session scale: runtime vs an asyncio task + queue per session")
        written.append(_save(fig, out / "scale.png", plt))
    return written


def _save(fig: Figure, path: Path, plt: ModuleType) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_and_save(report: dict[str, Any], path: str | None) -> None:
    """A bench command's JSON report: printed, and written to ``path`` when one is given."""
    text = json.dumps(report, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
