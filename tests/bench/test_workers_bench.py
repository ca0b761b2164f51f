"""The workers bench runs end to end at a tiny size: every arm serves turns, ratios and the
CPU split by process come out. No timing is asserted (a shared machine makes it noise)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("websockets")

from duplex_actors.bench import workers_bench


@pytest.mark.timeout(180)
def test_every_arm_serves_turns_and_the_cpu_split_names_the_processes():
    result = workers_bench.run(sessions=4, rounds=1, duration_s=0.5, warmup_s=0.3)
    assert set(result["turns_per_s"]) == {"bare", "workers=1", "workers=2"}
    assert all(rounds[0] > 0 for rounds in result["turns_per_s"].values())
    assert set(result["ratio_vs_bare"]) == {"workers=1", "workers=2"}
    split = result["cpu_ms_per_turn_by_process"]
    assert set(split["bare"][0]) == {"front/server"}
    assert {"dx-worker0", "dx-engine"} <= set(split["workers=1"][0])
    assert {"dx-worker0", "dx-worker1", "dx-engine"} <= set(split["workers=2"][0])
    json.dumps(result)
