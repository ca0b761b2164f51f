"""The compiled dispatch table that sessions use and the transitions Machine it was read from
agree on every event sequence: same branch, same target, same effects in the same order, and
the same refusals. This is what lets the Machine stay the authority while sessions pay its
construction cost once."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transitions import MachineError

from duplex_actors.core.statechart import CHART, CHECKS, GUARDS, MACHINE, PRECONDITIONS, REFUSALS, TRIGGERS
from duplex_actors.errors import DuplexError, IllegalTransition


class _Model:
    """A transitions model whose guards read from per-step values and whose effects record."""

    def __init__(self) -> None:
        self.guard_values: dict[str, bool] = {}
        self.effects: list[str] = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in GUARDS:
            return lambda *a, **k: self.guard_values[name]
        if name.startswith(("trigger", "to_", "may_", "is_")) or name in TRIGGERS:
            raise AttributeError(name)
        return lambda *a, **k: self.effects.append(name)


def _machine_refusal(source: str, trigger: str, guards: dict) -> type:
    """The refusal rule of core/statechart.py, read off the Machine's own transitions: each row
    read up to its first failing condition; the first failing check names the error. An open
    state with no row for the trigger reads the trigger's preconditions first."""
    transitions = MACHINE.events[trigger].transitions.get(source, [])
    if not transitions and source != "closed":
        for name in PRECONDITIONS.get(trigger, ()):
            if not guards[name]:
                return CHECKS[name].error
    for transition in transitions:
        for condition in transition.conditions:
            if guards[condition.func] is not bool(condition.target):
                if condition.target and condition.func in CHECKS:
                    return CHECKS[condition.func].error
                break
    return REFUSALS.get((source, trigger), IllegalTransition)


steps = st.lists(
    st.tuples(st.sampled_from(TRIGGERS), st.fixed_dictionaries({g: st.booleans() for g in GUARDS})),
    min_size=1,
    max_size=40,
)


@pytest.mark.slow
@given(steps)
def test_machine_and_compiled_table_agree(sequence):
    model = _Model()
    MACHINE.add_model(model, initial="idle")
    try:
        state = "idle"
        for trigger, guards in sequence:
            model.guard_values = guards
            model.effects = []
            machine_source = model.state
            try:
                took = MACHINE.events[trigger].trigger(model)
                machine_outcome = ("ok", model.state, tuple(model.effects)) if took else ("refused",)
            except MachineError:
                machine_outcome = ("refused",)
            # What the Machine refused, the table must refuse with the error of the first check
            # that failed in the Machine's own rows, else the one REFUSALS declares for the
            # Machine's state (IllegalTransition where it declares none).
            expected_error = _machine_refusal(machine_source, trigger, guards)
            try:
                res = CHART.resolve(state, trigger, guards.__getitem__)
                table_outcome = ("ok", res.dest, res.effects)
                state = res.dest
            except DuplexError as err:
                assert type(err) is expected_error, (machine_source, trigger, type(err))
                if isinstance(err, IllegalTransition):
                    assert (err.state, err.trigger) == (machine_source, trigger)
                table_outcome = ("refused",)
            assert machine_outcome == table_outcome, (state, trigger, guards)
            assert model.state == state
    finally:
        MACHINE.remove_model(model)


def test_table_covers_exactly_the_machines_transitions():
    machine_pairs = {(src, trig) for trig, ev in MACHINE.events.items() for src in ev.transitions}
    assert machine_pairs == set(CHART.table)


def test_closed_is_absorbing_in_the_chart():
    for (state, trigger), branches in CHART.table.items():
        if state == "closed":
            assert all(b.dest == "closed" for b in branches), trigger
            # only bookkeeping of what arrives after the close
            assert all(set(b.effects) <= {"count_stale_output", "settle_abort"} for b in branches), trigger


def test_every_declared_refusal_names_a_pair_the_machine_can_refuse():
    # A refusal declared for a pair the Machine always takes (an unguarded transition) is dead.
    for (state, trigger), error in REFUSALS.items():
        transitions = MACHINE.events[trigger].transitions.get(state, [])
        assert all(t.conditions for t in transitions), (state, trigger, error.__name__)


def test_checks_are_only_ever_conditions_never_unless():
    # "Fails" means "is false" for a check: as an unless guard it would fail by holding.
    for branches in CHART.table.values():
        for branch in branches:
            assert all(want for name, want in branch.guards if name in CHECKS), branch


def test_every_declared_check_is_a_guard_of_the_chart():
    assert set(CHECKS) <= set(GUARDS)
