"""The compiled dispatch table that sessions use and the transitions Machine it was read from
agree on every event sequence: same branch, same target, same effects in the same order, and
the same refusals. This is what lets the Machine stay the authority while sessions pay its
construction cost once."""

from hypothesis import given, strategies as st
from transitions import MachineError

from duplex_actors.core.statechart import CHART, GUARDS, MACHINE, TRIGGERS, refusal


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


steps = st.lists(
    st.tuples(st.sampled_from(TRIGGERS), st.fixed_dictionaries({g: st.booleans() for g in GUARDS})),
    min_size=1, max_size=40,
)


@given(steps)
def test_machine_and_compiled_table_agree(sequence):
    model = _Model()
    MACHINE.add_model(model, initial="idle")
    try:
        state = "idle"
        for trigger, guards in sequence:
            model.guard_values = guards
            model.effects = []
            try:
                took = MACHINE.events[trigger].trigger(model)
                machine_outcome = ("ok", model.state, tuple(model.effects)) if took else ("refused",)
            except MachineError:
                machine_outcome = ("refused",)
            try:
                res = CHART.resolve(state, trigger, guards.__getitem__)
                table_outcome = ("ok", res.dest, res.effects)
                state = res.dest
            except Exception as err:
                assert type(err) is type(refusal(state, trigger))
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
            assert all(not b.effects for b in branches if trigger != "stale_output")
