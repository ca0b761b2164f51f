"""The workers bench runs end to end at a tiny size: every arm serves turns, ratios and the
CPU split by process come out. No timing is asserted (a shared machine makes it noise)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("websockets")

from duplex_actors.bench import workers_bench


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_arm_serves_turns_and_the_cpu_split_names_the_processes():
    result = workers_bench.run(sessions=4, rounds=1, duration_s=0.5, warmup_s=0.3, pair=True)
    assert set(result["turns_per_s"]) == {"bare", "workers=1", "workers=2", "bare x2"}
    assert all(rounds[0] > 0 for rounds in result["turns_per_s"].values())
    assert set(result["ratio_vs_bare"]) == {"workers=1", "workers=2", "bare x2"}
    split = result["cpu_ms_per_turn_by_process"]
    assert set(split["bare"][0]) == {"front/server"}
    assert {"dx-worker0", "dx-engine"} <= set(split["workers=1"][0])
    assert {"dx-worker0", "dx-worker1", "dx-engine"} <= set(split["workers=2"][0])
    assert result["per_core_ratio_2_vs_1_workers"] > 0 and result["per_core_ratio_bare_x2_vs_bare"] > 0
    assert set(result["front_cores"]) == {"workers=1", "workers=2"}
    json.dumps(result)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_front_mode_keeps_sessions_live_through_the_front_and_reports_its_cpu():
    result = workers_bench.run_front(sessions=6, duration_s=1.0, turn_every_s=0.4)
    # each session turns every 0.4 s over 1 s: two or three each, all answered
    assert result["responses_done"] >= 12, result
    assert result["front_cores_live"] >= 0 and result["front_cores_connecting"] >= 0
    assert {"front/server", "dx-worker0", "dx-worker1", "dx-engine"} <= set(result["cores_live_by_process"])
    json.dumps(result)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_real_time_step_streams_through_server_vad_and_every_probe_comes_back():
    pytest.importorskip("onnxruntime")
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    step = workers_bench._measure_realtime(
        ctx, workers_bench._bare_main, (), sessions=4, clients=1, warmup_s=0.5, duration_s=2.0
    )
    # 4 sessions probe once a second each over 2 s; the first second's answers may fall in
    # the warm-up, so at least one a session.
    assert step["probes"] >= 4 and step["lost"] == 0 and step["errors"] == 0, step
    assert step["kept_up"] and step["probe_rtt_p99_ms"] < 1000 * workers_bench.REALTIME_RTT_P99_S
    assert step["turns_started"] == 0  # quiet noise: the VAD heard no speech
    assert step["server_cores"] > 0


def test_the_listener_counts_markers_split_across_reads_once():
    import asyncio

    class Reader:
        def __init__(self, chunks: list[bytes]) -> None:
            self.chunks = chunks

        async def read(self, n: int) -> bytes:
            return self.chunks.pop(0) if self.chunks else b""

    class Ws:
        def __init__(self, chunks: list[bytes]) -> None:
            self.reader = Reader(chunks)

    event = b'{"type":"input_audio_buffer.cleared","event_id":"e1"}'
    error = b'{"type":"error","error":{"code":"x"}}'
    stream = event + error + event + event
    # every split point of the stream into two reads, and a read per byte
    for chunks in [[stream[:i], stream[i:]] for i in range(1, len(stream))] + [
        [stream[i : i + 1] for i in range(len(stream))]
    ]:
        live = workers_bench._LiveSession(Ws(chunks))
        live.probes = [1.0, 2.0, 3.0, 4.0]
        asyncio.run(workers_bench._listen(live, [0.0]))
        assert len(live.rtts) == 3 and live.probes == [4.0], chunks
        assert live.errors == 1
