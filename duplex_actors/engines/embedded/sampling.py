"""Resolved sampling parameters and the batched sampler the scheduler runs once per step.

``SamplingParams`` is the *resolved* form: every knob has a value. Sessions send
``SamplingOverrides`` (``None`` = default); the adapter merges them onto a copy of its
defaults (see adapter.py). The sampler handles a whole batch whose rows may each have
different knobs, with one tensor pass instead of a Python loop per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch


def _non_negative(_inst: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


@attrs.frozen(slots=True)
class SamplingParams:
    #: 0 means greedy.
    temperature: float = attrs.field(default=0.8, validator=_non_negative)
    #: 0 means no top-k cut.
    top_k: int = attrs.field(default=40, validator=_non_negative)
    top_p: float = attrs.field(default=1.0)
    #: The most tokens a response generates when the request names no limit. At 48, answers
    #: that reached it ended incomplete though nobody had asked for a limit (5 of 200 did).
    max_tokens: int = attrs.field(default=256, validator=_non_negative)
    #: The end token is suppressed until this many tokens exist (no empty responses).
    min_tokens: int = attrs.field(default=4, validator=_non_negative)
    #: A seed makes this request's samples reproducible whatever else shares its batch.
    seed: int | None = None

    @top_p.validator
    def _check_top_p(self, _attribute: attrs.Attribute[float], value: float) -> None:
        if not 0.0 < value <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {value}")


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator,
) -> torch.Tensor:
    """One token per row of ``logits`` (n, vocab). Rows with temperature 0 take the argmax.

    Sampling uses the exponential race (argmax of p / E with E ~ Exp(1) draws a token with
    probability p), so a row's randomness is one vector of draws: from its own generator if
    the request was seeded, else from the engine's shared one.
    """
    sampled_rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if sampled_rows and logits.device.type != "cpu":
        # The draws come from CPU generators (a seeded request samples the same on any
        # device): one copy of the step's logits. All-greedy steps stay on the device.
        logits = logits.cpu()
    greedy = logits.argmax(dim=-1)
    if not sampled_rows:
        return greedy
    rows = torch.tensor(sampled_rows)
    sub = logits[rows]
    temps = torch.tensor([params[i].temperature for i in sampled_rows]).unsqueeze(1)
    sub = sub / temps
    top_ks = [params[i].top_k for i in sampled_rows]
    if any(0 < k < sub.shape[1] for k in top_ks):
        kmax = max(k if k > 0 else sub.shape[1] for k in top_ks)
        kth = sub.topk(min(kmax, sub.shape[1]), dim=-1).values
        idx = torch.tensor([(k if 0 < k <= kth.shape[1] else kth.shape[1]) - 1 for k in top_ks])
        threshold = kth.gather(1, idx.unsqueeze(1))
        sub = sub.masked_fill(sub < threshold, float("-inf"))
    probs = torch.softmax(sub, dim=-1)
    top_ps = [params[i].top_p for i in sampled_rows]
    if any(p < 1.0 for p in top_ps):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
        cut = before > torch.tensor(top_ps).unsqueeze(1)
        sorted_p = sorted_p.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter(1, order, sorted_p)
    race = torch.empty_like(probs)
    race.exponential_(generator=shared)
    for j, i in enumerate(sampled_rows):
        if generators[i] is not None:
            race[j].exponential_(generator=generators[i])
    picks = (probs / race).argmax(dim=-1)
    greedy[rows] = picks
    return greedy
