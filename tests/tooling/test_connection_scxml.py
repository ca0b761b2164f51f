"""The connection chart's SCXML export, run by an independent interpreter, takes the same steps
and performs the same effects as the table the server's connections fire their triggers into."""

from __future__ import annotations

import attrs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duplex_actors.core import connection_chart as chart
from duplex_actors.errors import IllegalTransition
from duplex_actors.tooling import statechart_export as export
from duplex_actors.tooling.scxml import to_scxml

CONNECTION = export.spec("connection")

steps = st.lists(
    st.tuples(
        st.sampled_from(chart.TRIGGERS),
        st.builds(chart.Facts, st.booleans(), st.booleans(), st.booleans()),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps)
def test_the_scxml_export_takes_the_tables_steps(sequence):
    from .scxml_runner import Interpreter  # skips when scjson is missing

    machine = Interpreter(to_scxml(CONNECTION))
    lifecycle = chart.ConnectionLifecycle()
    for trigger, facts in sequence:
        guards = {
            name: bool(value) for name, value in attrs.asdict(facts).items() if name in CONNECTION.guards
        }
        before = lifecycle.state
        try:
            expected = lifecycle.fire(trigger, facts)
        except IllegalTransition:
            machine.send(trigger, guards)
            assert machine.state == before
            assert machine.refusal == "IllegalTransition"
            continue
        effects = machine.send(trigger, guards)
        assert machine.state == lifecycle.state, (before, trigger, facts)
        assert tuple(effects) == expected
