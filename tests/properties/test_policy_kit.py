"""The kit's pieces for testing a session policy: building a changed chart from rows, and
swapping the reference model the machines compare against."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from duplex_actors.testing import (
    CHART,
    TRANSITIONS,
    SessionCoreMachine,
    SessionModel,
    UnknownChartName,
    policy_chart,
    row,
)

QUICK = settings(
    max_examples=3,
    stateful_step_count=8,
    deadline=None,
    database=None,
    phases=(Phase.generate,),
    suppress_health_check=list(HealthCheck),
)


def test_the_shipped_rows_compile_to_the_shipped_chart():
    assert policy_chart(TRANSITIONS).table == CHART.table


def test_a_policy_naming_what_the_core_lacks_fails_when_built():
    rows = [
        *TRANSITIONS,
        row("heartbeat", "idle", None, ["touch_lease", "tuoch_lease"], conditions=["is_tuesday"]),
    ]
    with pytest.raises(UnknownChartName) as info:
        policy_chart(rows)
    assert info.value.missing == ["_fx_tuoch_lease", "_g_is_tuesday"]


def test_the_reference_model_can_be_swapped():
    built = []

    class CountingModel(SessionModel):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    class Machine(SessionCoreMachine):
        def make_model(self, session_id, config):
            return CountingModel(session_id, config)

    run_state_machine_as_test(Machine, settings=QUICK)
    assert built and all(isinstance(m, CountingModel) for m in built)
