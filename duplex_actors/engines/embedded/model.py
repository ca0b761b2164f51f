"""The thinker: a small decoder-only transformer with a preallocated, slot-compacted KV cache.

Theory of operation. The cache holds ``max_slots`` sequences. Live sequences always occupy
slots ``0 .. n-1`` (the scheduler moves the last live sequence into a hole when one leaves), so
a batched decode step works on plain views of the cache, never on gathered copies: that is
what keeps the engine within a few percent of a bare decode loop. Each sequence has its own
length; a boolean mask hides cache positions past each row's length.

A prompt is ``prefix tokens + audio tokens + suffix tokens``. :meth:`prefill` writes the cache
for every prompt position except the last, and the last suffix token is fed through the next
batched :meth:`decode` step with everyone else: a new request joins the running batch instead
of generating its first token alone.

Weights are random (seeded). No causal language model ships inside a PyPI package and nothing
may be downloaded at run time, so the words are meaningless; the compute is the real thing.
The output bias starts from a Zipf-like prior over the vocabulary (see vocab.py) so the random
model emits common words, punctuation and an end token at plausible rates.
"""

from __future__ import annotations

import math

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
    max_new_tokens: int = 64
    max_slots: int = 64
    seed: int = 20240617

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


class _Block(nn.Module):
    def __init__(self, cfg: ThinkerConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)


def _sinusoids(length: int, dim: int) -> torch.Tensor:
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


class Thinker(nn.Module):
    def __init__(self, cfg: ThinkerConfig, output_prior: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        self.tok_emb = nn.Parameter(torch.randn(cfg.vocab_size, cfg.d_model, generator=gen))
        self.audio_proj = nn.Linear(cfg.audio_feature_dim, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # Untied output head: with random weights a tied head makes every token predict
        # itself (the residual stream still carries its own embedding) and decoding loops.
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.out_bias = nn.Parameter(
            output_prior.clone().float() if output_prior is not None else torch.zeros(cfg.vocab_size)
        )
        self._init_random(gen)
        self.register_buffer("pos_emb", _sinusoids(cfg.max_len, cfg.d_model), persistent=False)
        shape = (cfg.n_layers, cfg.max_slots, cfg.n_heads, cfg.max_len, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)
        self.requires_grad_(False)
        self.eval()

    def _init_random(self, gen: torch.Generator) -> None:
        # Fan-in scaled weights keep activations O(1) through the residual stack, so the
        # (random) function of the audio is visible in the logits instead of vanishing under
        # the output prior.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                std = 1.0 / math.sqrt(module.in_features)
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
                    if module.bias is not None:
                        module.bias.zero_()
        with torch.no_grad():
            for block in self.blocks:
                # Residual branches scaled down by depth, the usual trick for stable stacks.
                block.proj.weight.mul_(1.0 / math.sqrt(2 * self.cfg.n_layers))
                block.fc2.weight.mul_(1.0 / math.sqrt(2 * self.cfg.n_layers))

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # --- compute --------------------------------------------------------------------------

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        # The random part of the logits has a spread of ~LOGIT_SCALE nats around the prior.
        return self.head(self.ln_f(x)) * LOGIT_SCALE + self.out_bias

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
        cfg = self.cfg
        if not suffix_ids:
            raise ValueError("a prompt must end with at least one token to decode from")
        parts = []
        if prefix_ids:
            parts.append(self.tok_emb[torch.tensor(prefix_ids)])
        if audio_features.numel():
            parts.append(self.audio_proj(audio_features))
        if len(suffix_ids) > 1:
            parts.append(self.tok_emb[torch.tensor(suffix_ids[:-1])])
        if not parts:
            return 0
        x = torch.cat(parts, dim=0)
        length = x.shape[0]
        if length + 1 + cfg.max_new_tokens > cfg.max_len:
            raise ValueError(f"prompt of {length} positions does not fit the cache")
        x = x + self.pos_emb[:length]
        H, D = cfg.n_heads, cfg.head_dim
        for layer, block in enumerate(self.blocks):
            q, k, v = block.qkv(block.ln1(x)).view(length, 3, H, D).permute(1, 2, 0, 3)
            self.k_cache[layer, slot, :, :length] = k
            self.v_cache[layer, slot, :, :length] = v
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block.proj(attn.transpose(0, 1).reshape(length, cfg.d_model))
            x = x + block.fc2(F.gelu(block.fc1(block.ln2(x))))
        return length

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step for the live slots ``0 .. n-1``: ``tokens[i]`` sits at
        ``positions[i]`` of slot i. Returns logits of shape (n, vocab)."""
        cfg = self.cfg
        n = tokens.shape[0]
        H, D = cfg.n_heads, cfg.head_dim
        span = int(positions.max()) + 1
        rows = torch.arange(n)
        # Row i may attend to cache positions 0 .. positions[i].
        mask = (torch.arange(span)[None, :] <= positions[:, None]).view(n, 1, 1, span)
        x = self.tok_emb[tokens] + self.pos_emb[positions]
        for layer, block in enumerate(self.blocks):
            q, k, v = block.qkv(block.ln1(x)).view(n, 3, H, D).unbind(1)
            self.k_cache[layer, rows, :, positions] = k
            self.v_cache[layer, rows, :, positions] = v
            keys = self.k_cache[layer, :n, :, :span]
            values = self.v_cache[layer, :n, :, :span]
            attn = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask)
            x = x + block.proj(attn.reshape(n, cfg.d_model))
            x = x + block.fc2(F.gelu(block.fc1(block.ln2(x))))
        return self._logits(x)

    @torch.inference_mode()
    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` cache positions of ``src`` into ``dst`` (slot compaction)."""
        self.k_cache[:, dst, :, :length] = self.k_cache[:, src, :, :length]
        self.v_cache[:, dst, :, :length] = self.v_cache[:, src, :, :length]
