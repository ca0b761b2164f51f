"""The thinker's compute paths agree with each other: batched prefill with one-at-a-time
prefill, the (in, out) dense layer with torch's own linear."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from duplex_actors.engines.embedded import Thinker, ThinkerConfig  # noqa: E402

pytestmark = pytest.mark.embedded


def _model() -> Thinker:
    cfg = ThinkerConfig(
        vocab_size=50,
        d_model=32,
        n_layers=2,
        n_heads=2,
        d_ff=64,
        n_mels=8,
        frames_per_token=2,
        max_audio_tokens=12,
        max_new_tokens=8,
        max_slots=8,
    )
    return Thinker(cfg)


def _prompts(model: Thinker):
    gen = torch.Generator().manual_seed(7)
    dim = model.cfg.audio_feature_dim
    # Different lengths, one without audio, one that is only its decode token.
    return [
        ([1, 2], torch.randn(5, dim, generator=gen), [3, 4]),
        ([5], torch.randn(11, dim, generator=gen), [6]),
        ([7, 8, 9], torch.zeros(0, dim), [10, 11]),
        ([], torch.zeros(0, dim), [12]),
    ]


def _next_logits(model: Thinker, positions: list[int], prompts) -> torch.Tensor:
    tokens = torch.tensor([suffix[-1] for _, _, suffix in prompts])
    return model.decode(tokens, torch.tensor(positions))


def test_batched_prefill_matches_one_prompt_at_a_time():
    prompts = _prompts(_model())

    alone = _model()
    alone_positions = [alone.prefill(slot, *prompt) for slot, prompt in enumerate(prompts)]
    together = _model()
    embedded = [together.embed_prompt(*prompt) for prompt in prompts]
    together_positions = together.prefill_many(0, embedded)

    assert together_positions == alone_positions == [8, 12, 4, 0]
    for slot, length in enumerate(alone_positions):
        assert torch.allclose(
            together.k_cache[:, slot, :, :length], alone.k_cache[:, slot, :, :length], atol=1e-5
        )
        assert torch.allclose(
            together.v_cache[:, slot, :, :length], alone.v_cache[:, slot, :, :length], atol=1e-5
        )
    # The junk the padding wrote past each prompt stays invisible to the next decode step.
    assert torch.allclose(
        _next_logits(together, together_positions, prompts),
        _next_logits(alone, alone_positions, prompts),
        atol=1e-4,
    )


def test_prefill_many_fills_slots_after_the_live_ones():
    model = _model()
    prompts = _prompts(model)
    model.prefill(0, *prompts[0])
    before = model.k_cache[:, 0].clone()
    positions = model.prefill_many(1, [model.embed_prompt(*p) for p in prompts[1:3]])
    assert positions == [12, 4]
    assert torch.equal(model.k_cache[:, 0], before), "slot 0 (already live) was written"


def test_a_prompt_that_does_not_fit_is_refused_before_any_compute():
    model = _model()
    dim = model.cfg.audio_feature_dim
    with pytest.raises(ValueError, match="does not fit"):
        model.embed_prompt([1], torch.randn(model.cfg.max_len, dim), [2])
    with pytest.raises(ValueError, match="at least one token"):
        model.embed_prompt([1], torch.zeros(0, dim), [])


def test_dense_layer_computes_what_torch_linear_computes():
    model = _model()
    dense = model.blocks[0].fc1
    reference = torch.nn.Linear(dense.in_features, dense.weight_t.shape[1])
    with torch.no_grad():
        reference.weight.copy_(dense.weight_t.t())
        reference.bias.copy_(torch.randn(dense.weight_t.shape[1]))
        dense.bias.copy_(reference.bias)
        for shape in [(1, 32), (17, 32), (3, 5, 32)]:
            x = torch.randn(*shape)
            assert torch.allclose(dense(x), reference(x), atol=1e-5)


def test_a_bfloat16_kv_cache_computes_nearly_what_float32_does():
    cfg = dict(
        vocab_size=50,
        d_model=32,
        n_layers=2,
        n_heads=2,
        d_ff=64,
        n_mels=8,
        frames_per_token=2,
        max_audio_tokens=12,
        max_new_tokens=8,
        max_slots=8,
    )
    full = Thinker(ThinkerConfig(kv_dtype="float32", **cfg))
    half = Thinker(ThinkerConfig(kv_dtype="bfloat16", **cfg))
    assert half.k_cache.dtype == torch.bfloat16 and full.k_cache.dtype == torch.float32
    prompts = _prompts(full)
    logits = []
    for model in (full, half):
        positions = model.prefill_many(0, [model.embed_prompt(*p) for p in prompts])
        step = _next_logits(model, positions, prompts)
        assert step.dtype == torch.float32
        logits.append(step)
    # bf16 keeps ~3 significant digits of each key and value; the logits move by far less
    # than the gaps that decide which token wins.
    assert (logits[0] - logits[1]).abs().max() < 0.05
    assert not torch.equal(logits[0], logits[1]), "the two caches were not really different"


def test_kv_dtype_auto_resolves_to_a_supported_dtype():
    from duplex_actors.engines.embedded.model import resolve_kv_dtype

    assert resolve_kv_dtype("float32") is torch.float32
    assert resolve_kv_dtype("bfloat16") is torch.bfloat16
    assert resolve_kv_dtype("auto") in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError):
        ThinkerConfig(vocab_size=10, kv_dtype="float16")
