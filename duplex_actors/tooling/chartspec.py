"""A neutral, ordered description of one state machine, read back from a transitions Machine.

Every export (Mermaid, DOT, SVG, SCXML, JSON, the design-review table) is drawn from a
:class:`ChartSpec`, and a ChartSpec is only ever built from a live ``transitions.Machine``, so
no chart can say something the code does not do.

Ordering is part of the meaning: for one (state, trigger) the branches are tried in the order
the Machine holds them, and the first whose guards hold wins. The spec keeps that order
(``Edge.priority``) and otherwise sorts by state order, then trigger order, so that the same
code always produces byte-identical exports (the drift check depends on it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs
from transitions import Machine

#: One branch of a (state, trigger) in :meth:`ChartSpec.table`: (dest, guards, effects).
Branch = tuple[str, tuple[tuple[str, bool], ...], tuple[str, ...]]


@attrs.frozen(slots=True)
class Edge:
    source: str
    trigger: str
    #: ``None`` for an internal transition (state unchanged, nothing exited or entered).
    target: str | None
    #: (guard name, required truth); all must hold. ``False`` comes from ``unless``.
    guards: tuple[tuple[str, bool], ...]
    effects: tuple[str, ...]
    #: Position among the branches of the same (source, trigger): 0 is tried first.
    priority: int

    @property
    def internal(self) -> bool:
        return self.target is None

    @property
    def dest(self) -> str:
        """Where the machine is after the edge fires (the source for internal edges)."""
        return self.source if self.target is None else self.target

    @property
    def is_else(self) -> bool:
        """Tried only when every earlier branch of its (source, trigger) failed. Many such
        branches differ from an earlier one only by this position, so every export says it."""
        return self.priority > 0

    def guard_text(self) -> str:
        """When the edge is taken: ``a and not b``, ``else``, ``else if a`` (empty when it is
        the only or first branch and unguarded)."""
        own = " and ".join(name if want else f"not {name}" for name, want in self.guards)
        if not self.is_else:
            return own
        return f"else if {own}" if own else "else"

    def label(self) -> str:
        """UML-style edge label: ``trigger [guard] / effect, effect``."""
        text = self.trigger
        guard = self.guard_text()
        if guard:
            text += f" [{guard}]"
        if self.effects:
            text += " / " + ", ".join(self.effects)
        return text


@attrs.frozen(slots=True)
class ChartSpec:
    name: str
    title: str
    states: tuple[str, ...]
    initial: str
    #: States nothing leaves: drawn as ending the lifecycle. Those with no transitions at all
    #: become SCXML ``<final>``; an absorbing state that still consumes events stays a state.
    absorbing: tuple[str, ...]
    triggers: tuple[str, ...]
    guards: tuple[str, ...]
    edges: tuple[Edge, ...]
    #: One sentence per trigger on why it exists.
    why: Mapping[str, str] = attrs.field(factory=dict)
    #: What each state means, one line each.
    state_docs: Mapping[str, str] = attrs.field(factory=dict)
    #: What each guard means, one line each (optional).
    guard_docs: Mapping[str, str] = attrs.field(factory=dict)
    #: Typed refusals: (state, trigger) -> error name, for pairs with no edge.
    refusals: Mapping[tuple[str, str], str] = attrs.field(factory=dict)
    #: Error named for pairs with no edge and no entry in ``refusals``.
    default_refusal: str | None = None
    #: Who raises each trigger (client, engine, self), where the chart declares it.
    origins: Mapping[str, str] = attrs.field(factory=dict)
    #: Checking guards: guard -> the error its failure is refused with, when no branch holds
    #: (the first failing check in row order names it; see core/statechart.py).
    guard_refusals: Mapping[str, str] = attrs.field(factory=dict)
    #: Checks a pair with no edge still reads, in order, before its typed refusal (the session
    #: chart's preconditions): (state, trigger) -> check names.
    preconditions: Mapping[tuple[str, str], tuple[str, ...]] = attrs.field(factory=dict)

    def edges_from(self, state: str) -> tuple[Edge, ...]:
        return tuple(e for e in self.edges if e.source == state)

    def branches(self, state: str, trigger: str) -> tuple[Edge, ...]:
        return tuple(e for e in self.edges if e.source == state and e.trigger == trigger)

    def has_transitions(self, state: str) -> bool:
        return any(e.source == state for e in self.edges)

    def resolve(self, state: str, trigger: str, guard_values: Mapping[str, bool]) -> Edge | None:
        """The edge the machine takes, or None when the event is refused."""
        for edge in self.branches(state, trigger):
            if all(bool(guard_values.get(name, False)) is want for name, want in edge.guards):
                return edge
        return None

    def refused(self, state: str) -> list[tuple[str, bool, str | None]]:
        """``(trigger, only_when_no_guard_holds, error)`` for each trigger ``state`` may refuse
        without a failing check (see :meth:`check_refusals` for those)."""
        out = []
        for trigger in self.triggers:
            branches = self.branches(state, trigger)
            if branches and any(not b.guards for b in branches):
                continue  # an unguarded branch always applies
            if branches and any(all(n in self.guard_refusals for n, _ in b.guards) for b in branches):
                continue  # a branch made only of checks: when it fails, one of them names the error
            error = self.refusals.get((state, trigger), self.default_refusal)
            out.append((trigger, bool(branches), error))
        return out

    def check_refusals(self, state: str, trigger: str) -> list[tuple[tuple[tuple[str, bool], ...], str, str]]:
        """``(guards that held, failing check, error)`` in the order the refusal rule reads them:
        each branch's guards left to right, a check failing while the guards before it held."""
        out = []
        branches = self.branches(state, trigger)
        if not branches:  # a pair with no edge: its preconditions, each after the ones before
            names = self.preconditions.get((state, trigger), ())
            held = tuple((name, True) for name in names)
            return [(held[:i], name, self.guard_refusals[name]) for i, name in enumerate(names)]
        for edge in branches:
            for i, (name, want) in enumerate(edge.guards):
                if want and name in self.guard_refusals:
                    out.append((edge.guards[:i], name, self.guard_refusals[name]))
        return out

    def table(self) -> dict[tuple[str, str], tuple[Branch, ...]]:
        """``{(state, trigger): ((dest, guards, effects), ...)}`` in priority order."""
        out: dict[tuple[str, str], list[Branch]] = {}
        for edge in self.edges:
            out.setdefault((edge.source, edge.trigger), []).append((edge.dest, edge.guards, edge.effects))
        return {key: tuple(value) for key, value in out.items()}


def spec_from_machine(
    machine: Machine,
    *,
    name: str,
    title: str,
    why: Mapping[str, str] | None = None,
    state_docs: Mapping[str, str] | None = None,
    guard_docs: Mapping[str, str] | None = None,
    refusals: Mapping[tuple[str, str], str] | None = None,
    default_refusal: str | None = None,
    origins: Mapping[str, str] | None = None,
    guard_refusals: Mapping[str, str] | None = None,
    preconditions: Mapping[tuple[str, str], tuple[str, ...]] | None = None,
) -> ChartSpec:
    """Read a transitions Machine back into a :class:`ChartSpec` (it is never written by hand)."""
    states = tuple(machine.states.keys())
    triggers = tuple(machine.events.keys())
    state_rank = {s: i for i, s in enumerate(states)}
    trigger_rank = {t: i for i, t in enumerate(triggers)}
    edges: list[Edge] = []
    for trigger, event in machine.events.items():
        for source, transitions in event.transitions.items():
            for priority, t in enumerate(transitions):
                guards = tuple(
                    (c.func if isinstance(c.func, str) else c.func.__name__, bool(c.target))
                    for c in t.conditions
                )
                effects = tuple(e if isinstance(e, str) else e.__name__ for e in t.after)
                edges.append(Edge(source, trigger, t.dest, guards, effects, priority))
    edges.sort(key=lambda e: (state_rank[e.source], trigger_rank[e.trigger], e.priority))
    guard_names = tuple(dict.fromkeys(name for e in edges for name, _ in e.guards))
    leaving = {e.source for e in edges if e.target is not None and e.target != e.source}
    absorbing = tuple(s for s in states if s not in leaving)
    initial = machine.initial
    if initial is None:
        raise ValueError(f"chart {name!r}: the machine has no initial state")
    return ChartSpec(
        name=name,
        title=title,
        states=states,
        initial=initial,
        absorbing=absorbing,
        triggers=triggers,
        guards=guard_names,
        edges=tuple(edges),
        why=dict(why or {}),
        state_docs=dict(state_docs or {}),
        guard_docs=dict(guard_docs or {}),
        refusals=dict(refusals or {}),
        default_refusal=default_refusal,
        origins=dict(origins or {}),
        guard_refusals=dict(guard_refusals or {}),
        preconditions=dict(preconditions or {}),
    )


def undocumented(spec: ChartSpec, names: Iterable[str] | None = None) -> list[str]:
    """Triggers of ``spec`` with no sentence in ``why`` (the review table needs one each)."""
    return [t for t in (names or spec.triggers) if not spec.why.get(t)]
