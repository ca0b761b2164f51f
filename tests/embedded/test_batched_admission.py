"""Turns admitted together share the audio front end's work (features in one transform per
length, one projection of all their audio), and tokens that reach the loop together travel as
one delta: same values as one at a time, and one bad turn still fails alone."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from duplex_actors.core.engine_io import TextDelta, TurnDone  # noqa: E402
from duplex_actors.engines.embedded import SamplingParams, features  # noqa: E402
from duplex_actors.errors import InvalidCommand  # noqa: E402

from .helpers import request, run, small_engine  # noqa: E402

pytestmark = pytest.mark.embedded


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=40_000), min_size=1, max_size=12),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_batched_features_equal_one_piece_at_a_time(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    pcms = [
        torch.randint(-32768, 32768, (n,), dtype=torch.int16, generator=gen).numpy().tobytes()
        for n in lengths
    ]
    pieces = [features.pcm16_to_float(p) for p in pcms]
    tokens = [max(1, -(-n // 1280)) for n in lengths]  # the adapter's budget: 80 ms per token
    batched = features.log_mel_tokens_batch(pieces, tokens, n_mels=16, frames_per_token=8)
    # What the adapter runs: the bytes fitted (a slice or zeros appended) and converted once
    # per length give the same numbers as converting each piece and fitting its samples.
    from_bytes = features.log_mel_tokens_of_pcm(pcms, tokens, n_mels=16, frames_per_token=8)
    assert len(batched) == len(from_bytes) == len(pieces)
    for piece, n, got, got_from_bytes in zip(pieces, tokens, batched, from_bytes):
        alone = features.log_mel_tokens(piece, n, n_mels=16, frames_per_token=8)
        assert got.shape == alone.shape == (n, 128)
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
        assert torch.equal(got_from_bytes, got)


def test_features_of_an_odd_byte_count_are_refused():
    with pytest.raises(ValueError, match="even number of bytes"):
        features.log_mel_tokens_of_pcm([bytes(3200), b"\x01\x02\x03"], [3, 1], n_mels=16, frames_per_token=8)


def test_build_prompts_equals_build_prompt_and_a_bad_turn_gets_its_error_in_place():
    engine = small_engine()
    adapter = engine.thinker.adapter
    good = [request(f"s{i}", audio=bytes(2 * 1600 * (i + 1))) for i in range(5)]
    odd = request("odd", audio=b"\x01\x02\x03")  # an odd byte count is not pcm16
    turns = [good[0], odd, *good[1:]]
    built = adapter.build_prompts(turns)
    assert isinstance(built[1], InvalidCommand)
    for turn, prompt in zip(turns, built):
        if turn is odd:
            continue
        alone = adapter.build_prompt(turn)
        assert (prompt.prefix_ids, prompt.suffix_ids, prompt.budget) == (
            alone.prefix_ids,
            alone.suffix_ids,
            alone.budget,
        )
        torch.testing.assert_close(prompt.audio_features, alone.audio_features, rtol=1e-5, atol=1e-5)


def test_embed_prompts_equals_embed_prompt_and_a_prompt_that_cannot_run_fails_alone():
    engine = small_engine()
    model_cfg = engine.thinker.config
    from duplex_actors.engines.embedded.model import Thinker
    from duplex_actors.engines.embedded.thinker_backend import output_prior

    model = Thinker(model_cfg, output_prior(engine.thinker.vocab))
    gen = torch.Generator().manual_seed(3)
    width = model_cfg.audio_feature_dim
    prompts = [
        ((1, 2), torch.randn(4, width, generator=gen), (5, 6)),
        ((1,), torch.randn(0, width), (7,)),  # no audio
        ((1, 2), torch.randn(3, width, generator=gen), ()),  # no token to decode from
        ((3,), torch.randn(6, width, generator=gen), (5,)),
        ((), torch.randn(2, width, generator=gen), (4, 8, 9)),  # no prefix, a suffix of three
        ((1,), torch.randn(model_cfg.max_len, width, generator=gen), (5,)),  # longer than the cache
        ((2, 3, 4), torch.randn(0, width), (6, 7)),  # tokens only
    ]
    together = model.embed_prompts(prompts)
    assert isinstance(together[2], ValueError) and "decode from" in str(together[2])
    assert isinstance(together[5], ValueError) and "does not fit" in str(together[5])
    for i, (prefix, audio, suffix) in enumerate(prompts):
        if i in (2, 5):
            continue
        torch.testing.assert_close(
            together[i], model.embed_prompt(prefix, audio, suffix), rtol=1e-5, atol=1e-5
        )


def test_a_burst_of_turns_is_built_together_and_each_still_reports_what_it_read():
    async def main():
        engine = small_engine(max_concurrency=8)
        calls: list[int] = []
        adapter = engine.thinker.adapter
        batch = adapter.build_prompts

        def counting(requests):
            calls.append(len(requests))
            return batch(requests)

        adapter.build_prompts = counting
        await engine.start()
        try:
            # Held before the worker admits anything, so all six are admitted in one pass.
            with engine.thinker.scheduler._lock:
                streams = [engine.generate(request(f"s{i}")) for i in range(6)]
                firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
                await asyncio.sleep(0.05)
            outs = [[await f] + [o async for o in s] for f, s in zip(firsts, streams)]
        finally:
            await engine.aclose()
        return calls, outs

    calls, outs = run(main())
    assert calls and max(calls) >= 2, calls
    for out in outs:
        done = out[-1]
        assert isinstance(done, TurnDone) and done.input is not None and done.input.audio_tokens > 0


def test_tokens_that_arrive_together_are_one_delta_and_none_is_lost():
    async def main():
        # A long dispatch interval: the worker holds several steps' tokens per dispatch.
        engine = small_engine(
            dispatch_interval_s=0.05, sampling=SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
        )
        await engine.start()
        try:
            return [o async for o in engine.generate(request("s"))]
        finally:
            await engine.aclose()

    outs = run(main())
    deltas = [o for o in outs if isinstance(o, TextDelta)]
    done = outs[-1]
    assert isinstance(done, TurnDone)
    assert sum(d.token_count for d in deltas) == 24 == done.metrics.token_count
    assert len(deltas) < 24, "tokens held together should travel together"
    assert [d.produced_at for d in deltas] == sorted(d.produced_at for d in deltas)
