"""The thinker: a small decoder-only transformer with a preallocated, slot-compacted KV cache.

Theory of operation. The cache holds ``max_slots`` sequences. Live sequences always occupy
slots ``0 .. n-1`` (the scheduler moves the last live sequence into a hole when one leaves), so
a batched decode step works on plain views of the cache, never on gathered copies: that is
what keeps the engine within a few percent of a bare decode loop. Each sequence has its own
length; an additive mask hides cache positions past each row's length.

The cache's time axis is only as long as the live sequences need (rounded up to
``cache_growth`` positions), not ``max_len``: then the keys of slots ``0 .. n-1`` are one
contiguous block, and a batched step's attention is two plain batched matmuls over it. Over a
slice of a longer axis the same matmuls (and torch's fused attention) ran 2.5-3x slower at 64
rows, as torch copies or walks the strided blocks; attention was half of a 64-row step. The
axis grows by copying the live part into a longer one (every ``cache_growth`` steps at most)
and shrinks the same way once the longest live sequence is well below it.

A prompt is ``prefix tokens + audio tokens + suffix tokens``. :meth:`prefill_many` writes the
cache for every prompt position except the last, for all the requests that join at one step in
one pass, and the last suffix token is fed through the next batched :meth:`decode` step with
everyone else: a new request joins the running batch instead of generating its first token
alone.

Weights are random (seeded). No causal language model ships inside a PyPI package and nothing
may be downloaded at run time, so the words are meaningless; the compute is the real thing.
The output bias starts from a Zipf-like prior over the vocabulary (see vocab.py) so the random
model emits common words, punctuation and an end token at plausible rates.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch import nn
from torch.nn import functional as F

#: Spread of the random network's contribution to the logits. Large enough that the audio and
#: the context visibly change the output, small enough that the output prior still sets rates.
LOGIT_SCALE = 1.5


@attrs.frozen(slots=True)
class ThinkerConfig:
    vocab_size: int
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 1024
    n_mels: int = 64
    #: 10 ms mel frames per audio token (8 -> one token per 80 ms of audio).
    frames_per_token: int = 8
    max_prefix_tokens: int = 16
    max_audio_tokens: int = 96
    #: The most tokens any response may generate (the cache is sized for it): a request asking
    #: for more gets this many (EngineCapabilities.max_output_tokens_limit).
    max_new_tokens: int = 256
    max_slots: int = 64
    seed: int = 20240617
    #: KV cache storage: "float32" (the default), "bfloat16", or "auto" (bfloat16 where the
    #: CPU reports native bf16, else float32). Half the bytes can speed a batched step's
    #: attention, but whether it does depends on torch's bf16 kernels on the host: on the
    #: AVX512-BF16 EPYC this project runs on (2026-12-01), bf16 attention took 1.76 ms per
    #: layer at 64 rows against 0.37 ms in float32, and the bare loop ran 13-22% faster at
    #: batch 16-64 with float32. float32 also gives the same tokens on every host.
    kv_dtype: str = attrs.field(
        default="float32", validator=attrs.validators.in_(("auto", "float32", "bfloat16"))
    )

    #: Key/value heads, shared by groups of ``n_heads // n_kv_heads`` query heads
    #: (grouped-query attention; 1 is multi-query). A batched decode step reads every live
    #: row's whole cache, which made attention a sixth of a 64-row step with one key/value
    #: head per query head; shared heads cut what it reads, and the cache's memory, by
    #: ``n_heads / n_kv_heads``, and give each batched matmul several query rows. Real models
    #: (Llama 3, Mistral, Qwen2) share their heads for the same reason.
    n_kv_heads: int = attrs.field(default=1)
    #: Granularity of the cache's time axis (see the module docstring). Larger means fewer
    #: relayout copies but more masked positions in every step's attention.
    cache_growth: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    #: Steps of at least this many rows (batched decode, prefill) run the dense layers on
    #: low-precision weights (``dense_low_precision``); smaller steps stay in float32, as
    #: fast as they can be. At one row the weights' bytes, not the arithmetic, set the pace,
    #: and converting or quantising the activations costs more than it saves; from about 8
    #: rows the arithmetic does, and the low-precision kernels win (measured figures in
    #: docs/embedded.md). ``None`` keeps float32 everywhere (then a request's tokens never
    #: depend on how many others share its step).
    dense_low_precision_from_rows: int | None = 8
    #: The low precision: "bfloat16" (bf16 copies of the weights, float32 accumulation; only
    #: where the CPU has native bf16 dot products, elsewhere torch emulates them 10-60x
    #: slower), "int8" (weights quantised per output channel, activations per step, through
    #: torch's quantized CPU kernels: fbgemm on x86, qnnpack on ARM), or "auto": bfloat16 where
    #: native, else int8 where those kernels run, else float32.
    dense_low_precision: str = attrs.field(
        default="auto", validator=attrs.validators.in_(("auto", "bfloat16", "int8"))
    )
    #: Where the weights, the cache and every step live: "cpu", "cuda" or "cuda:N" (see
    #: :func:`resolve_device` for "auto"). The weights are drawn on the CPU from the seed and
    #: moved, so every device runs the same model. On CUDA, "auto" low precision stays float32:
    #: a step of this model is a few hundred small kernels, bound by their launches, not their
    #: arithmetic (int8 dynamic linear is CPU-only; "bfloat16" can still be asked for).
    device: str = attrs.field(default="cpu")
    #: CUDA only: capture the batched decode step once per batch bucket as a CUDA graph and
    #: replay it (what vLLM does for decode): a launch-bound step then costs one launch. The
    #: cache's time axis is then fixed at ``max_len`` (graphs need fixed shapes; the masked tail
    #: costs little on a GPU) and a batch runs padded to its bucket. Off by default: not yet
    #: measured on a GPU (scripts/device-check.sh measures both).
    cuda_graphs: bool = False

    @device.validator
    def _known_device(self, attribute: attrs.Attribute[str], value: str) -> None:
        if value != "cpu" and not (value == "cuda" or value.startswith("cuda:")):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {value!r}")

    @n_kv_heads.validator
    def _kv_heads_divide_heads(self, attribute: attrs.Attribute[int], value: int) -> None:
        if value < 1 or self.n_heads % value:
            raise ValueError(f"n_kv_heads={value} must divide n_heads={self.n_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def max_len(self) -> int:
        # prefix + audio + suffix (kind token, maybe a decision token) + generated tokens
        return self.max_prefix_tokens + self.max_audio_tokens + 2 + self.max_new_tokens

    @property
    def audio_feature_dim(self) -> int:
        return self.n_mels * self.frames_per_token


class _Dense(nn.Module):
    """A linear layer that keeps its weight as (in, out), contiguous.

    ``nn.Linear`` keeps (out, in) and multiplies by its transpose; on this CPU build that
    costs 1.2-2x more per call at the batch sizes a decode step has (1-64 rows), and a decode
    step is mostly these calls. Same function, other memory layout.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True) -> None:
        super().__init__()
        self.in_features = in_features
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._low: Callable[[torch.Tensor], torch.Tensor] | None = None

    def keep_low_precision_copy(self, precision: str) -> None:
        """Keep a ``precision`` ("bfloat16" or "int8") copy of the weights for
        :meth:`forward_low_precision`; call once the weights are final."""
        weight, bias = self.weight_t.detach(), None if self.bias is None else self.bias.detach()
        if precision == "bfloat16":
            weight_bf16 = weight.to(torch.bfloat16).contiguous()
            bias_bf16 = None if bias is None else bias.to(torch.bfloat16)

            def forward_bf16(x: torch.Tensor) -> torch.Tensor:
                xb = x.to(torch.bfloat16)
                y = (
                    torch.mm(xb, weight_bf16)
                    if bias_bf16 is None
                    else torch.addmm(bias_bf16, xb, weight_bf16)
                )
                return y.to(torch.float32)

            self._low = forward_bf16
        elif precision == "int8":
            packed = _pack_int8(weight, bias)
            self._low = lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)
        else:
            raise ValueError(f"unknown precision {precision!r}")

    def forward_low_precision(self, x: torch.Tensor) -> torch.Tensor:
        """The same layer on the low-precision copy, for a 2-D float32 ``x``; float32 out."""
        return self.forward(x) if self._low is None else self._low(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            if self.bias is None:
                return torch.mm(x, self.weight_t)
            return torch.addmm(self.bias, x, self.weight_t)
        y = torch.matmul(x, self.weight_t)
        return y if self.bias is None else y + self.bias


def _pack_int8(weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.ScriptObject:
    """Quantise an (in, out) float32 weight to int8, symmetric per output channel, and pack it
    for ``quantized.linear_dynamic`` (which quantises each call's activations per tensor,
    multiplies in int8 with int32 sums, and returns float32)."""
    weight = weight_t.t().contiguous()  # the kernels take (out, in)
    scales = (weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0).to(torch.float64)
    with warnings.catch_warnings():
        # torch 2.13 marks quantized tensor creation deprecated (the kernels are not);
        # _int8_kernels() checks at start that they still run, else the model stays float32.
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch.quantize_per_channel(
            weight, scales, torch.zeros(weight.shape[0], dtype=torch.long), 0, torch.qint8
        )
    packed: torch.ScriptObject = torch.ops.quantized.linear_prepack(quantized, bias)
    return packed


class _Block(nn.Module):
    def __init__(self, cfg: ThinkerConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        # Query heads, then the shared key heads, then the value heads.
        self.qkv = _Dense(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim)
        self.proj = _Dense(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = _Dense(cfg.d_model, cfg.d_ff)
        self.fc2 = _Dense(cfg.d_ff, cfg.d_model)


class _BlockParts:
    """A block's layers as plain attributes, for the compute paths: called through
    ``forward`` and ``F.layer_norm``, without nn.Module's per-call machinery (hook checks, and
    ``__getattr__`` through ``_modules`` on every access), which py-spy put at ~10% of a
    one-row decode step. The same parameter tensors, so the weights stay the module's."""

    __slots__ = ("norm1", "qkv", "proj", "norm2", "fc1", "fc2")

    def __init__(self, block: _Block) -> None:
        self.norm1 = _norm_args(block.ln1)
        self.qkv, self.proj = block.qkv, block.proj
        self.norm2 = _norm_args(block.ln2)
        self.fc1, self.fc2 = block.fc1, block.fc2


def _norm_args(norm: nn.LayerNorm) -> tuple[Any, torch.Tensor, torch.Tensor, float]:
    # The shape is a tuple, which F.layer_norm takes though its annotation says list[int].
    return (tuple(norm.normalized_shape), norm.weight, norm.bias, norm.eps)


def _sinusoids(length: int, dim: int) -> torch.Tensor:
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


class Thinker(nn.Module):
    # Buffers made by register_buffer, which the type checker cannot see.
    pos_emb: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(self, cfg: ThinkerConfig, output_prior: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        self.tok_emb = nn.Parameter(torch.randn(cfg.vocab_size, cfg.d_model, generator=gen))
        self.audio_proj = _Dense(cfg.audio_feature_dim, cfg.d_model)
        blocks = [_Block(cfg) for _ in range(cfg.n_layers)]
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # Untied output head: with random weights a tied head makes every token predict
        # itself (the residual stream still carries its own embedding) and decoding loops.
        self.head = _Dense(cfg.d_model, cfg.vocab_size, bias=False)
        self.out_bias = nn.Parameter(
            output_prior.clone().float() if output_prior is not None else torch.zeros(cfg.vocab_size)
        )
        self._init_random(gen, blocks)
        self.register_buffer("pos_emb", _sinusoids(cfg.max_len, cfg.d_model), persistent=False)
        device = torch.device(cfg.device)
        if device.type != "cpu":
            self.to(device)  # weights drawn on the CPU (same on every device), then moved
        self.device = device
        self._on_cpu = device.type == "cpu"
        kv_dtype = resolve_kv_dtype(cfg.kv_dtype, device)
        # One flat storage per cache, allocated once at its largest and viewed at the current
        # capacity. Zeros, not empty: every position of the time axis, masked or not, goes
        # through the matmuls (times a zero weight if masked), so each must hold a finite
        # number; junk left by earlier sequences and layouts is finite too.
        size = cfg.n_layers * cfg.max_slots * cfg.n_kv_heads * cfg.max_len * cfg.head_dim
        self._k_storage = torch.zeros(size, dtype=kv_dtype, device=device)
        self._v_storage = torch.zeros(size, dtype=kv_dtype, device=device)
        if cfg.cuda_graphs and device.type != "cuda":
            raise ValueError("cuda_graphs needs a CUDA device")
        # Graph replays read the cache at fixed addresses and shapes: its axis never changes.
        self._pinned_capacity = cfg.cuda_graphs
        capacity = cfg.max_len if cfg.cuda_graphs else min(cfg.cache_growth, cfg.max_len)
        self.register_buffer("k_cache", self._cache_view(self._k_storage, capacity), persistent=False)
        self.register_buffer("v_cache", self._cache_view(self._v_storage, capacity), persistent=False)
        self.requires_grad_(False)
        self.eval()
        self._parts = [_BlockParts(block) for block in blocks]
        self._final_norm = _norm_args(self.ln_f)
        from_rows = cfg.dense_low_precision_from_rows
        kind = None if from_rows is None else resolve_dense_low_precision(cfg.dense_low_precision, device)
        self._low_precision_kind = kind
        self._low_from_rows = None if kind is None else from_rows
        if kind is not None:
            for module in self.modules():
                if isinstance(module, _Dense):
                    module.keep_low_precision_copy(kind)
        self._graphs: _DecodeGraphs | None = _DecodeGraphs(self) if cfg.cuda_graphs else None

    def _init_random(self, gen: torch.Generator, blocks: list[_Block]) -> None:
        # Fan-in scaled weights keep activations O(1) through the residual stack, so the
        # (random) function of the audio is visible in the logits instead of vanishing under
        # the output prior.
        for module in self.modules():
            if isinstance(module, _Dense):
                std = 1.0 / math.sqrt(module.in_features)
                with torch.no_grad():
                    # Drawn in (out, in) order, then transposed: the same weights an
                    # nn.Linear initialised this way would hold.
                    out_features = module.weight_t.shape[1]
                    drawn = torch.randn((out_features, module.in_features), generator=gen) * std
                    module.weight_t.copy_(drawn.t())
                    if module.bias is not None:
                        module.bias.zero_()
        with torch.no_grad():
            for block in blocks:
                # Residual branches scaled down by depth, the usual trick for stable stacks.
                block.proj.weight_t.mul_(1.0 / math.sqrt(2 * self.cfg.n_layers))
                block.fc2.weight_t.mul_(1.0 / math.sqrt(2 * self.cfg.n_layers))

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # --- the cache's time axis ------------------------------------------------------------

    def _cache_view(self, storage: torch.Tensor, capacity: int) -> torch.Tensor:
        cfg = self.cfg
        shape = (cfg.n_layers, cfg.max_slots, cfg.n_kv_heads, capacity, cfg.head_dim)
        return storage[: math.prod(shape)].view(shape)

    @property
    def dense_low_precision(self) -> tuple[str, int] | None:
        """The low precision batched steps' dense layers run in on this host, and from how
        many rows: ``("int8", 8)``, ``("bfloat16", 8)``, or None (float32 only)."""
        if self._low_precision_kind is None or self._low_from_rows is None:
            return None
        return self._low_precision_kind, self._low_from_rows

    @property
    def cache_capacity(self) -> int:
        """Positions the cache's time axis holds now (see the module docstring)."""
        return int(self.k_cache.shape[3])

    def _fit_cache(self, needed: int, *, live: int) -> None:
        """Make the time axis hold ``needed`` positions: grow to the next multiple of
        ``cache_growth``, or shrink once it is two steps of growth longer than needed. The first
        ``live`` slots keep their contents; the rest of the storage is left as it is."""
        capacity, growth = self.cache_capacity, self.cfg.cache_growth
        if (capacity >= needed and capacity < needed + 2 * growth) or self._pinned_capacity:
            return
        target = min(self.cfg.max_len, -(-needed // growth) * growth)
        keep = min(capacity, target)
        for name, storage in (("k_cache", self._k_storage), ("v_cache", self._v_storage)):
            # The new view reuses the same memory under other strides: copy the live part
            # out first, as the two layouts overlap.
            kept = getattr(self, name)[:, :live, :, :keep].clone()
            view = self._cache_view(storage, target)
            view[:, :live, :, :keep] = kept
            setattr(self, name, view)

    def _dense(self, layer: _Dense, x: torch.Tensor, rows: int) -> torch.Tensor:
        low = self._low_from_rows
        return layer.forward_low_precision(x) if low is not None and rows >= low else layer.forward(x)

    def _feed_forward(self, parts: _BlockParts, x: torch.Tensor, rows: int) -> torch.Tensor:
        # (Keeping the hidden layer in bf16 through the GELU saves two conversions, but
        # measured the same at 64 rows: 430-475 us either way.)
        hidden = F.gelu(self._dense(parts.fc1, F.layer_norm(x, *parts.norm2), rows))
        return self._dense(parts.fc2, hidden, rows)

    # --- compute --------------------------------------------------------------------------

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        # The random part of the logits has a spread of ~LOGIT_SCALE nats around the prior.
        return self.head.forward(F.layer_norm(x, *self._final_norm)) * LOGIT_SCALE + self.out_bias

    def _prompt_embeddings(
        self,
        prefix_ids: Sequence[int],
        audio_features: torch.Tensor,
        suffix_ids: Sequence[int],
        projected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Input vectors of every prompt position except the last token, (length, d_model).
        ``projected``: ``audio_proj`` of the features, computed already (:meth:`embed_prompts`)."""
        problem = self._prompt_problem(
            len(prefix_ids) + int(audio_features.shape[0]) + len(suffix_ids) - 1, suffix_ids
        )
        if problem is not None:
            raise problem
        parts = []
        device = None if self._on_cpu else self.device  # (None: torch's default, the CPU)
        if prefix_ids:
            parts.append(self.tok_emb[torch.tensor(prefix_ids, device=device)])
        if projected is not None:
            parts.append(projected)
        elif audio_features.numel():
            if device is not None:
                audio_features = audio_features.to(device)  # the features are computed on the CPU
            parts.append(self.audio_proj(audio_features))
        if len(suffix_ids) > 1:
            parts.append(self.tok_emb[torch.tensor(suffix_ids[:-1], device=device)])
        if not parts:
            return self.tok_emb.new_zeros((0, self.cfg.d_model))
        return torch.cat(parts, dim=0)

    @torch.inference_mode()
    def prefill(
        self,
        slot: int,
        prefix_ids: list[int],
        audio_features: torch.Tensor,
        suffix_ids: list[int],
    ) -> int:
        """Write the cache of ``slot`` for the whole prompt except its last token, which is
        returned: the caller feeds it to the next batched decode step. Returns the position
        that token occupies."""
        return self.prefill_many(slot, [self._prompt_embeddings(prefix_ids, audio_features, suffix_ids)])[0]

    def embed_prompt(
        self, prefix_ids: Sequence[int], audio_features: torch.Tensor, suffix_ids: Sequence[int]
    ) -> torch.Tensor:
        """Validate one prompt and compute its input vectors (for :meth:`prefill_many`).
        Raises ValueError for a prompt that cannot run (empty suffix, too long)."""
        with torch.inference_mode():
            return self._prompt_embeddings(prefix_ids, audio_features, suffix_ids)

    # Each element is a Tensor or a ValueError; list[Any] lets a caller whose prompts are all
    # valid (a bench) hand the list to prefill_many as it is.
    def embed_prompts(
        self, prompts: Sequence[tuple[Sequence[int], torch.Tensor, Sequence[int]]]
    ) -> list[Any]:
        """:meth:`embed_prompt` of several (prefix_ids, audio_features, suffix_ids), in order.
        Their token ids cross to the device in one copy and are looked up in one gather, and
        their audio features in one copy and one projection: one of each per prompt cost a
        launch apiece and, for the ids, a wait on a GPU (measured: docs/benchmarks.md, "Figures
        moved from code comments"). A prompt that cannot run gets its ValueError in its place."""
        with torch.inference_mode():
            out: list[torch.Tensor | ValueError | None] = [None] * len(prompts)
            runnable: list[int] = []
            for i, (prefix_ids, audio, suffix_ids) in enumerate(prompts):
                problem = self._prompt_problem(
                    len(prefix_ids) + int(audio.shape[0]) + len(suffix_ids) - 1, suffix_ids
                )
                if problem is not None:
                    out[i] = problem
                else:
                    runnable.append(i)
            if len(runnable) < 2:
                return [p if p is not None else self.embed_prompt(*prompts[i]) for i, p in enumerate(out)]
            sizes = [int(prompts[i][1].shape[0]) for i in runnable if prompts[i][1].numel()]
            try:
                joined = (
                    torch.cat([prompts[i][1] for i in runnable if prompts[i][1].numel()]) if sizes else None
                )
                if joined is not None and not self._on_cpu:
                    joined = joined.to(self.device)
                audio_rows = iter(self.audio_proj(joined).split(sizes)) if joined is not None else iter(())
            except RuntimeError:  # features of mismatched widths: each prompt alone says why
                return [p if p is not None else self.embed_prompt(*prompts[i]) for i, p in enumerate(out)]
            ids: list[int] = []
            for i in runnable:
                ids += prompts[i][0]
                ids += prompts[i][2][:-1]
            device = None if self._on_cpu else self.device
            token_rows = self.tok_emb[torch.tensor(ids, dtype=torch.long, device=device)]
            at = 0
            for i in runnable:
                prefix_ids, audio, suffix_ids = prompts[i]
                parts = []
                if prefix_ids:
                    parts.append(token_rows[at : at + len(prefix_ids)])
                    at += len(prefix_ids)
                if audio.numel():
                    parts.append(next(audio_rows))
                if len(suffix_ids) > 1:
                    parts.append(token_rows[at : at + len(suffix_ids) - 1])
                    at += len(suffix_ids) - 1
                out[i] = (
                    torch.cat(parts)
                    if len(parts) > 1
                    else parts[0]
                    if parts
                    else self.tok_emb.new_zeros((0, self.cfg.d_model))
                )
            return out

    def _prompt_problem(self, positions: int, suffix_ids: Sequence[int]) -> ValueError | None:
        """Why a prompt of ``positions`` input vectors (every position but the last token's)
        cannot run, or None."""
        if not suffix_ids:
            return ValueError("a prompt must end with at least one token to decode from")
        if positions + 1 + self.cfg.max_new_tokens > self.cfg.max_len:
            return ValueError(f"prompt of {positions} positions does not fit the cache")
        return None

    @torch.inference_mode()
    def prefill_many(self, first_slot: int, prompts: list[torch.Tensor]) -> list[int]:
        """Prefill several prompts (from :meth:`embed_prompt`) into slots ``first_slot ..``
        in one batched pass; returns each one's decode position (its length).

        Prompts are right-padded to the longest. Causal attention makes that exact: a real
        position only attends to positions before it, which are all real. The padded tail
        writes junk into the cache past each prompt's length, which stays invisible: decode
        masks positions past a row's own, and overwrites each one before it becomes visible.
        One pass for many joiners costs about as much as a few single prefills, which is
        what makes a burst of turns (many sessions committing at once) cheap.
        """
        cfg = self.cfg
        lengths = [int(p.shape[0]) for p in prompts]
        longest = max(lengths, default=0)
        if longest == 0:
            return lengths
        count = len(prompts)
        # Slots past the joiners are empty (slots are compact), so only those before keep data.
        self._fit_cache(longest + 1, live=first_slot)
        # One call for the padded batch (a copy per prompt launched from C++, not Python).
        x = nn.utils.rnn.pad_sequence(prompts, batch_first=True) + self.pos_emb[:longest]
        H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        rows = count * longest
        slots = slice(first_slot, first_slot + count)
        for layer, parts in enumerate(self._parts):
            qkv = self._dense(parts.qkv, F.layer_norm(x, *parts.norm1).view(rows, cfg.d_model), rows)
            q, k, v = qkv.view(count, longest, H + 2 * K, D).transpose(1, 2).split((H, K, K), dim=1)  # type: ignore[no-untyped-call]  # torch: untyped
            self.k_cache[layer, slots, :, :longest] = k  # (cast to the cache's dtype)
            self.v_cache[layer, slots, :, :longest] = v
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=K != H)
            attn = attn.transpose(1, 2).reshape(rows, cfg.d_model)
            x = x + self._dense(parts.proj, attn, rows).view(count, longest, cfg.d_model)
            x = x + self._feed_forward(parts, x.view(rows, cfg.d_model), rows).view(
                count, longest, cfg.d_model
            )
        return lengths

    @torch.inference_mode()
    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, *, max_position: int | None = None
    ) -> torch.Tensor:
        """One decode step for the live slots ``0 .. n-1``: ``tokens[i]`` sits at
        ``positions[i]`` of slot i. Returns logits of shape (n, vocab), on the model's device.

        ``tokens`` and ``positions`` may be on the CPU whatever the device (they are moved in
        one copy), or already on the device (a step launched from the last one's tokens);
        ``max_position``, their largest position when the caller knows it, spares reading it
        back from the device. With CUDA graphs the logits are a view of the graph's output,
        valid until the next step."""
        n = tokens.shape[0]
        if self._on_cpu:
            self._fit_cache((int(positions.max()) if max_position is None else max_position) + 1, live=n)
            return self._decode_rows(tokens, positions, n, self.cache_capacity)
        if self._graphs is not None:
            return self._graphs.run(tokens, positions, n)
        self._fit_cache((int(positions.max()) if max_position is None else max_position) + 1, live=n)
        moved = torch.stack((tokens.to(positions.device), positions)).to(self.device, non_blocking=True)
        return self._decode_rows(moved[0], moved[1], n, self.cache_capacity)

    def _decode_rows(self, tokens: torch.Tensor, positions: torch.Tensor, n: int, width: int) -> torch.Tensor:
        """The step itself, on the model's device, over a cache axis of ``width`` positions
        that already holds every row's position (decode fits it; graphs pin it)."""
        cfg = self.cfg
        H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        group = H // K
        kv_dtype = self.k_cache.dtype
        device = None if self._on_cpu else self.device
        rows = torch.arange(n, device=device)
        # Row i may attend to cache positions 0 .. positions[i]; the rest of the (compact,
        # contiguous) time axis is masked out. One mask row per (row, key head) pair, broadcast
        # over the query heads that share it.
        hidden = torch.arange(width, device=device)[None, :] > positions[:, None]
        mask = torch.zeros((n, 1, width), dtype=kv_dtype, device=device).masked_fill_(
            hidden.view(n, 1, width), -math.inf
        )
        mask = mask.expand(n, K, width).reshape(n * K, 1, width)
        scale = 1.0 / math.sqrt(D)
        x = self.tok_emb[tokens] + self.pos_emb[positions]
        for layer, parts in enumerate(self._parts):
            qkv = self._dense(parts.qkv, F.layer_norm(x, *parts.norm1), n)
            q, k, v = qkv.view(n, H + 2 * K, D).split((H, K, K), dim=1)  # type: ignore[no-untyped-call]  # torch: untyped
            self.k_cache[layer, rows, :, positions] = k.to(kv_dtype)
            self.v_cache[layer, rows, :, positions] = v.to(kv_dtype)
            # Slots 0 .. n-1 over the whole axis: one contiguous block, so plain batched matmuls,
            # each with the ``group`` query heads that share a key head as its rows.
            keys = self.k_cache[layer, :n].view(n * K, width, D)
            values = self.v_cache[layer, :n].view(n * K, width, D)
            scores = torch.baddbmm(
                mask, q.reshape(n * K, group, D).to(kv_dtype), keys.transpose(1, 2), alpha=scale
            )
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(kv_dtype)
            attn = torch.bmm(weights, values).to(x.dtype)
            x = x + self._dense(parts.proj, attn.view(n, cfg.d_model), n)
            x = x + self._feed_forward(parts, x, n)
        return self._logits(x)

    @torch.inference_mode()
    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` cache positions of ``src`` into ``dst`` (slot compaction)."""
        self.k_cache[:, dst, :, :length] = self.k_cache[:, src, :, :length]
        self.v_cache[:, dst, :, :length] = self.v_cache[:, src, :, :length]


def resolve_device(name: str) -> str:
    """A device setting ("cpu", "cuda", "cuda:N", "auto") as ThinkerConfig.device takes it:
    "auto" is "cuda" where torch sees a CUDA device, else "cpu". Asking for CUDA where there is
    none is an error here, not a failure at the first step."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cpu":
        if not (name == "cuda" or name.startswith("cuda:")):
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {name!r}")
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device")
    return name


def resolve_kv_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """The KV cache dtype for a ThinkerConfig.kv_dtype setting (on CUDA, "auto" is float32:
    see ThinkerConfig.device)."""
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if device is not None and device.type != "cpu":
        return torch.float32
    return torch.bfloat16 if _native_bf16() else torch.float32


def resolve_dense_low_precision(name: str, device: torch.device | None = None) -> str | None:
    """The low precision for a ThinkerConfig.dense_low_precision setting on this host, or
    None where it would be slower than float32 (emulated bf16) or cannot run (no int8 kernels).
    On CUDA: "bfloat16" if asked for by name, else None (see ThinkerConfig.device)."""
    if device is not None and device.type != "cpu":
        return "bfloat16" if name == "bfloat16" else None
    if name == "bfloat16":
        return "bfloat16" if _native_bf16() else None
    if name == "int8":
        return "int8" if _int8_kernels() else None
    if _native_bf16():
        return "bfloat16"
    return "int8" if _int8_kernels() else None


class _DecodeGraphs:
    """CUDA graphs of the batched decode step, one per batch bucket (powers of two up to
    ``max_slots``, and ``max_slots``), as vLLM captures its decode.

    All are captured when the model is built, before any sequence lives in the cache: the
    warm-up runs write junk at position 0 of the bucket's slots. At a step of n rows the
    smallest bucket >= n is replayed with the inputs in its static buffers; its padded rows
    (token 0 at position 0 of free slots n..) write junk where a joining sequence's prefill
    writes before anything reads it. Graphs share one memory pool, largest captured first.
    """

    def __init__(self, model: Thinker) -> None:
        cfg = model.cfg
        self._model = model
        top = cfg.max_slots
        sizes = {top}
        size = 1
        while size < top:
            sizes.add(size)
            size *= 2
        self.buckets = sorted(sizes)
        device = model.device
        # Inputs for the largest bucket; smaller buckets capture views of their first rows.
        self._inputs = torch.zeros((2, top), dtype=torch.long, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        width = cfg.max_len
        pool = None
        with torch.inference_mode():
            stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch: untyped __new__
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for bucket in self.buckets:  # warm-up: lazy inits happen outside capture
                    model._decode_rows(self._inputs[0, :bucket], self._inputs[1, :bucket], bucket, width)
            torch.cuda.current_stream(device).wait_stream(stream)
            for bucket in reversed(self.buckets):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    out = model._decode_rows(
                        self._inputs[0, :bucket], self._inputs[1, :bucket], bucket, width
                    )
                pool = graph.pool()
                self._graphs[bucket] = (graph, out)
            torch.cuda.synchronize(device)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
        bucket = next(b for b in self.buckets if b >= n)
        graph, out = self._graphs[bucket]
        if tokens.device.type == "cpu":
            staged = torch.zeros((2, bucket), dtype=torch.long)
            staged[0, :n] = tokens
            staged[1, :n] = positions
            self._inputs[:, :bucket].copy_(staged, non_blocking=True)  # one copy for both
        else:  # already on the device: copied there, the padding rows zeroed as above
            self._inputs[:, n:bucket].zero_()
            self._inputs[0, :n].copy_(tokens)
            self._inputs[1, :n].copy_(positions)
        graph.replay()
        return out[:n]


@functools.cache
def _int8_kernels() -> bool:
    """Whether torch's dynamic int8 linear runs here (fbgemm/x86 or qnnpack), checked once on
    a tiny layer: the quantized ops are optional in a torch build, and deprecated."""
    if torch.backends.quantized.engine not in ("x86", "fbgemm", "qnnpack"):
        return False
    try:
        packed = _pack_int8(torch.ones(4, 2), None)
        out = torch.ops.quantized.linear_dynamic(torch.ones(1, 4), packed, True)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.allclose(out, torch.full((1, 2), 4.0), atol=0.1))


def _native_bf16() -> bool:
    # torch exposes the check only under torch.cpu's private names; without them, assume no.
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except Exception:
        return False
