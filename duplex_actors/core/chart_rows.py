"""One row of a statechart's transition table, as ``transitions.Machine`` takes it: the session
chart (:mod:`.statechart`), the connection chart (:mod:`.connection_chart`) and the lifecycle
charts the tooling draws (:mod:`duplex_actors.tooling.lifecycles`) are all tables of these."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def row(
    trigger: str,
    source: str | list[str],
    dest: str | None,
    effects: Iterable[str] = (),
    conditions: Iterable[str] = (),
    unless: Iterable[str] = (),
) -> dict[str, Any]:
    """One transition: ``trigger`` from ``source`` (a state or a list) to ``dest`` (None: an
    internal transition), taken when every guard in ``conditions`` holds and none in
    ``unless`` does, performing ``effects`` in order. Guards and effects are names: of the
    session core's ``_g_<name>`` and ``_fx_<name>`` methods for the session chart, each called
    with the trigger's :class:`~duplex_actors.core.step.Step`."""
    return {
        "trigger": trigger,
        "source": source,
        "dest": dest,
        "after": list(effects),
        "conditions": list(conditions),
        "unless": list(unless),
    }


__all__ = ["row"]
