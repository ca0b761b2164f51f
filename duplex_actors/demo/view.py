"""The live progress view: one row per caller, refreshed a few times a second."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio
from rich.console import Console
from rich.live import Live
from rich.table import Table

if TYPE_CHECKING:
    from ..actors.runtime import Runtime
    from .caller import Caller


def _table(callers: Sequence[Caller], runtime: Runtime, remaining: float) -> Table:
    stats = runtime.engine.statistics()
    table = Table(
        title=f"duplex_actors demo — {remaining:4.0f} s left — engine in flight "
        f"{stats.in_flight}, submitted {stats.submitted}",
        caption="done = completed, cut = cancelled by barge-in, ack = backchannels said",
    )
    for column in ("#", "state", "turns", "done", "cut", "fail", "barge", "ack", "pkts", "TTFT ms"):
        table.add_column(column, justify="right")
    for c in callers:
        s = c.stats
        table.add_row(
            str(c.index),
            c.session.state,
            str(s.turns_spoken),
            str(s.responses_completed),
            str(s.responses_cancelled),
            str(s.responses_failed),
            str(s.barge_ins_attempted),
            str(s.backchannels),
            str(s.audio_packets),
            "-" if s.last_ttft_ms is None else f"{s.last_ttft_ms:.1f}",
        )
    return table


async def live_view(console: Console, callers: Sequence[Caller], runtime: Runtime, deadline: float) -> None:
    with Live(
        _table(callers, runtime, deadline - time.perf_counter()),
        console=console,
        refresh_per_second=4,
        transient=False,
    ) as live:
        while time.perf_counter() < deadline + 2:
            await anyio.sleep(0.25)
            live.update(_table(callers, runtime, max(deadline - time.perf_counter(), 0)))
            if all(c.session.state == "closed" for c in callers):
                break
