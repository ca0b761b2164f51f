"""Build a session policy chart to test: the shipped rows, changed.

A policy is a list of rows (:func:`~duplex_actors.core.statechart.row`), usually the shipped
:data:`~duplex_actors.core.statechart.TRANSITIONS` with some rows replaced or added.
:func:`policy_chart` compiles it the way the shipped chart is compiled and checks every guard
and effect it names exists on the core that will run it, so a typo fails when the chart is
built, not as a confusing state machine failure many steps later::

    from duplex_actors.testing import TRANSITIONS, CANCEL_RESPONSE, policy_chart, row

    rows = [r for r in TRANSITIONS if (r["trigger"], r["source"]) != ("barge_in", "responding")]
    rows.insert(0, row("barge_in", "responding", "barge_in",
                       [e for e in CANCEL_RESPONSE if e != "emit_response_cancelled"]))
    chart = policy_chart(rows)   # hand it to SessionCore(..., chart=chart) in make_core()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..core.session import SessionCore
from ..core.statechart import CompiledChart, build_machine, compile_chart


class UnknownChartName(ValueError):
    """A policy row names a guard or an effect the session core does not implement."""

    def __init__(self, missing: list[str], core: type) -> None:
        super().__init__(f"{core.__name__} implements no {', '.join(missing)}")
        self.missing = missing


def policy_chart(rows: Iterable[dict[str, Any]], core: type = SessionCore) -> CompiledChart:
    """Compile ``rows`` into the frozen table a :class:`SessionCore` takes as ``chart=``."""
    chart = compile_chart(build_machine(list(rows)))
    names = {f"_g_{name}" for branches in chart.table.values() for b in branches for name, _ in b.guards}
    names |= {f"_fx_{effect}" for branches in chart.table.values() for b in branches for effect in b.effects}
    missing = sorted(name for name in names if not callable(getattr(core, name, None)))
    if missing:
        raise UnknownChartName(missing, core)
    return chart
