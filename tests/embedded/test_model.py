"""The thinker's compute paths agree with each other: batched prefill with one-at-a-time
prefill, the (in, out) dense layer with torch's own linear, a cache whose time axis grows and
shrinks with one that never moves, low-precision dense layers with float32 ones, shared
key/value heads with one key/value head per query head."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from duplex_actors.engines.embedded import Thinker, ThinkerConfig  # noqa: E402

pytestmark = pytest.mark.embedded


SMALL = dict(
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


def _model(**overrides) -> Thinker:
    # float32 dense layers unless a test asks otherwise: these tests compare compute paths,
    # and low precision would differ between a step of few rows and one of many.
    return Thinker(ThinkerConfig(**{"dense_low_precision_from_rows": None, **SMALL, **overrides}))


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


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_batched_prefill_matches_one_prompt_at_a_time(kv_heads):
    prompts = _prompts(_model())

    alone = _model(n_kv_heads=kv_heads)
    alone_positions = [alone.prefill(slot, *prompt) for slot, prompt in enumerate(prompts)]
    together = _model(n_kv_heads=kv_heads)
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
    full = _model(kv_dtype="float32")
    half = _model(kv_dtype="bfloat16")
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


def _decode_run(model: Thinker, prompts, steps: int, leave_after: int) -> list[torch.Tensor]:
    """Prefill, decode ``steps`` greedy steps; after ``leave_after`` every sequence but the
    shortest leaves (the scheduler's compaction: the survivor moves into slot 0)."""
    positions = model.prefill_many(0, [model.embed_prompt(*p) for p in prompts])
    tokens = torch.tensor([suffix[-1] for _, _, suffix in prompts])
    pos = torch.tensor(positions)
    logits = []
    for step in range(steps):
        if step == leave_after:
            survivor = int(pos.argmin())
            model.move_slot(survivor, 0, int(pos[survivor]))
            tokens, pos = tokens[survivor : survivor + 1], pos[survivor : survivor + 1]
        out = model.decode(tokens, pos)
        logits.append(out)
        tokens, pos = out.argmax(dim=-1), pos + 1
    return logits


def test_a_cache_whose_time_axis_grows_and_shrinks_computes_what_a_fixed_one_does():
    # Sequences far apart in length, decoded across several growth boundaries; then the long
    # ones leave, and the axis shrinks under the survivor. The reference never relays out
    # (growth as long as the cache), so every step's logits must match it.
    cfg = dict(max_audio_tokens=40, max_new_tokens=48)
    gen = torch.Generator().manual_seed(3)
    dim = _model(**cfg).cfg.audio_feature_dim
    prompts = [
        ([1, 2], torch.randn(30, dim, generator=gen), [3, 4]),
        ([5], torch.zeros(0, dim), [6]),
        ([7, 8, 9], torch.randn(3, dim, generator=gen), [10, 11]),
    ]
    moving = _model(cache_growth=4, **cfg)
    fixed = _model(cache_growth=1000, **cfg)
    assert fixed.cache_capacity == fixed.cfg.max_len

    capacities = []
    original_fit = moving._fit_cache

    def recording_fit(needed: int, *, live: int) -> None:
        original_fit(needed, live=live)
        capacities.append((needed, moving.cache_capacity))

    moving._fit_cache = recording_fit  # type: ignore[method-assign]
    got = _decode_run(moving, prompts, steps=40, leave_after=24)
    want = _decode_run(fixed, prompts, steps=40, leave_after=24)

    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.allclose(a, b, atol=1e-5), f"step {step} differs"
    seen = [capacity for _, capacity in capacities]
    assert all(needed <= capacity < needed + 8 for needed, capacity in capacities)
    assert all(capacity % 4 == 0 for capacity in seen)
    grew = any(b > a for a, b in zip(seen, seen[1:]))
    shrank = any(b < a for a, b in zip(seen, seen[1:]))
    assert grew and shrank, seen


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
def test_low_precision_dense_layers_compute_nearly_what_float32_does(precision):
    from duplex_actors.engines.embedded.model import resolve_dense_low_precision

    full = _model()
    low = _model(dense_low_precision=precision, dense_low_precision_from_rows=2)
    prompts = _prompts(full)
    logits = []
    for model in (full, low):
        positions = model.prefill_many(0, [model.embed_prompt(*p) for p in prompts])
        logits.append(_next_logits(model, positions, prompts))
    if resolve_dense_low_precision(precision) is None:
        # Hosts without native bf16 dot products (or without torch's int8 kernels) keep
        # float32 whatever the setting.
        assert low.dense_low_precision is None
        assert torch.equal(logits[0], logits[1])
        return
    assert low.dense_low_precision == (precision, 2)
    # bf16 keeps ~3 significant digits of each weight, int8 ~2 (per output channel) and
    # quantises each step's activations too: the logits move by far less than the ~1.5 nats
    # of spread that decide which token wins.
    assert (logits[0] - logits[1]).abs().max() < 0.1
    assert not torch.equal(logits[0], logits[1]), f"the {precision} path did not run"
    # A one-row step stays below the threshold, so it is float32 in both (on fresh models:
    # the caches above were written by prefills of different precision).
    one = [
        model.decode(torch.tensor([3]), torch.tensor([0]))
        for model in (_model(), _model(dense_low_precision=precision, dense_low_precision_from_rows=2))
    ]
    assert torch.equal(one[0], one[1])


def test_shared_key_value_heads_compute_what_repeated_heads_do():
    # A model whose 4 query heads share 2 key/value heads is the same function as one with 4
    # key/value heads where each shared head's weights are repeated for its 2 query heads.
    # This pins which query head reads which cache head, in prefill and in every decode step
    # (across cache growth and compaction).
    cfg = dict(n_heads=4, max_audio_tokens=20, max_new_tokens=24, cache_growth=4)
    shared = _model(n_kv_heads=2, **cfg)
    repeated = _model(n_kv_heads=4, **cfg)
    D, H = shared.cfg.head_dim, 4
    heads = [0, 0, 1, 1]  # query head -> the key/value head it shares

    def spread(w: torch.Tensor) -> torch.Tensor:
        return torch.cat([w[..., h * D : (h + 1) * D] for h in heads], dim=-1)

    weights = shared.state_dict()
    for name in [n for n in weights if ".qkv." in n]:
        if name.endswith("bias"):  # zeros at init: make them matter
            weights[name] = torch.randn_like(weights[name])
            shared.state_dict()[name].copy_(weights[name])
        q, k, v = weights[name].split((H * D, 2 * D, 2 * D), dim=-1)
        weights[name] = torch.cat([q, spread(k), spread(v)], dim=-1)
    repeated.load_state_dict(weights)
    assert shared.k_cache.shape[2] == 2 and repeated.k_cache.shape[2] == 4
    prompts = _prompts(shared)
    got = _decode_run(shared, prompts, steps=20, leave_after=12)
    want = _decode_run(repeated, prompts, steps=20, leave_after=12)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.allclose(a, b, atol=1e-4), f"step {step} differs"


def test_key_value_heads_must_divide_the_query_heads():
    with pytest.raises(ValueError, match="must divide"):
        ThinkerConfig(vocab_size=10, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="must divide"):
        ThinkerConfig(vocab_size=10, n_kv_heads=0)
