"""The end-of-demo summary table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_report(console: Console, report: dict[str, Any]) -> None:
    table = Table(title="per-response metrics (nearest-rank percentiles)")
    for col in ("metric", "count", "p50", "p90", "p99", "mean", "source"):
        table.add_column(col, justify="right")
    for name, s in report["metrics"].items():
        table.add_row(
            name,
            str(s["count"]),
            _fmt(s["p50"], 3),
            _fmt(s["p90"], 3),
            _fmt(s["p99"], 3),
            _fmt(s["mean"], 3),
            s["source"],
        )
    console.print(table)
    t = report["totals"]
    console.print(
        f"turns spoken {t['turns_spoken']}, responses completed {t['responses_completed']}, "
        f"cancelled {t['responses_cancelled']}, failed {t['responses_failed']}; barge-ins attempted "
        f"{t['barge_ins_attempted']}, backchannels {t['backchannels']}; audio packets {t['audio_packets']}; "
        f"stale audio after cancel {t['stale_audio_after_cancel']}; dropped mic chunks {t['dropped_chunks']}"
    )
    console.print(
        f"wall {report['wall_s']:.1f} s, CPU {report['cpu_s']:.1f} s "
        f"({report['cpu_per_wall']:.2f} cores), speech synthesis for callers {report['speech_synthesis_s']:.1f} s"
    )
