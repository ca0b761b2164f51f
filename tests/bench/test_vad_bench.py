"""The server VAD bench runs end to end at a tiny size: every arm streams its sessions, every
probe comes back, and the batched arm scores windows in batches. No timing is asserted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("websockets")
pytest.importorskip("onnxruntime")

from duplex_actors.bench import vad_bench


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_arm_streams_and_the_batched_one_batches():
    result = vad_bench.run(sizes=(4,), rounds=1, seconds=2.0)
    arms = result["4"]
    assert set(arms) == {"batched", "one_by_one", "no_vad"}
    for arm in arms.values():
        assert arm["loop_cpu_ms_per_session_s"][0] > 0
        assert arm["probes_lost"] == [0] and arm["errors"] == [0]
        assert arm["probe_p50_ms"][0] is not None
    assert arms["batched"]["windows_per_batch"][0] >= 1
    assert arms["one_by_one"]["windows_per_batch"] == [None]  # no batcher
    assert arms["no_vad"]["ratio_to_no_vad (median)"] == 1.0
    json.dumps(result)
