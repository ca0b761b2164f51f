"""The vLLM bench's smoke form on the shared engine: every figure it reports comes out, each with
its bare AsyncLLM baseline (the bench once crashed when the engine began passing ``priority``
and its stand-ins did not take it). Sizes are tiny, so no figure's value is asserted."""

from __future__ import annotations

import pytest

from duplex_actors.core.engine_io import TextDelta, TurnDone

from .support import collect, make_request

pytestmark = pytest.mark.vllm


def test_vllm_bench_smoke_reports_every_figure_against_bare_asyncllm(vllm):
    from duplex_actors.bench import vllm_bench

    raw = vllm.run(vllm_bench.measure(vllm.engine, "smoke"), timeout=300)
    tokens = vllm_bench.SIZES["smoke"][0]
    assert [t["streams"] for t in raw["throughput"]] == list(vllm_bench.CONCURRENCY)
    for t in raw["throughput"]:
        # Both arms streamed every token (measure raises otherwise) at a positive rate.
        assert t["tokens_per_stream"] == tokens
        assert t["bare_tok_s"] > 0 and t["ours_tok_s"] > 0 and t["ratio"] > 0
    assert raw["ttft"]["samples"] == vllm_bench.SIZES["smoke"][2] and raw["ttft"]["added_ms_p50"] >= 0
    assert raw["wrapper"]["bare_us_per_token"] > 0

    out = vllm_bench.result(raw)
    assert out["name"] == "vllm" and out["params"]["size"] == "smoke"
    throughput = [f for f in out["figures"] if f["metric"].endswith("streams through VllmEngine (median)")]
    assert len(throughput) == len(vllm_bench.CONCURRENCY)
    for fig in throughput:
        assert fig["baseline_label"].startswith("bare AsyncLLM") and fig["met"] in (True, False)
    assert all(f["value"] is not None for f in out["figures"])


def test_the_replay_stand_in_takes_what_the_engine_passes(vllm):
    """The wrapper-cost arm swaps the engine's AsyncLLM for a replay: the engine's tenant
    priority must reach it, and the engine's stream must come through whole."""
    from duplex_actors.bench import vllm_bench

    raw = vllm.run(vllm_bench._wrapper_cost(vllm.engine, 50, 1))
    assert raw["tokens"] == 50 and raw["ours_us_per_token"] > 0
    replay = vllm_bench._ReplayLLM(3)
    engine = vllm.engine
    real, engine._llm = engine._llm, replay
    # As the bench does: the replay has no tokenizer to render a prompt with.
    real_render, engine.render_prompt = engine.render_prompt, (lambda text: text)
    try:
        outs = vllm.run(collect(engine, make_request(3)))
    finally:
        engine._llm = real
        engine.render_prompt = real_render
    assert "priority" in getattr(replay, "options", {}), outs
    assert isinstance(outs[-1], TurnDone) and outs[-1].reason == "length"
    assert sum(o.token_count for o in outs if isinstance(o, TextDelta)) == 3
