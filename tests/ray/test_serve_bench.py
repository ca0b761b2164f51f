"""The Serve sessions bench runs end to end at a tiny size on the tests' Ray cluster (no
timing asserted)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray.serve")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.mark.slow
def test_the_serve_bench_runs_both_arms_and_prints_a_ratio(ray_cluster):
    from duplex_actors.bench import serve_bench

    result = serve_bench.run(sessions=2, replicas=(1,), rounds=1, duration_s=0.5, warmup_s=0.3)
    assert result["turns_per_s"]["bare"][0] > 0 and result["turns_per_s"]["replicas=1"][0] > 0
    assert set(result["ratio_vs_bare"]) == {"replicas=1"}
    assert result["replicas_used"]["replicas=1"] == [1]
    json.dumps(result)
