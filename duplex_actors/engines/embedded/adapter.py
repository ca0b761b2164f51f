"""The model adapter contract: the seam a new model plugs into the embedded engine.

The engine (scheduler + backend) knows nothing model-specific. Everything that depends on the
model goes through one adapter object, and three rules hold for every adapter:

1. **The server computes the audio budget from the PCM itself.** How many placeholder tokens
   (or frames) a unit of audio occupies in the prompt is derived from the bytes received, on
   the server. A budget a client claims is ignored (logged when it disagrees): a client that
   lies about its budget must not be able to make the engine reserve or read past what it was
   really sent.
2. **Listen vs speak is decided from the raw streaming token snapshot of the current unit.**
   ``decide`` sees only the tokens generated for *this* unit so far, never the accumulated
   output history of the session (an old "speak" must not leak into a new unit's decision),
   and it answers ``None`` until the snapshot contains a decision.
3. **The adapter owns per-session sampling overrides.** Session and request
   ``SamplingOverrides`` are merged onto a *copy* of the adapter's defaults; the defaults the
   engine was built with never change, and one session's overrides never reach another.

:class:`ModelAdapter` is the protocol; :class:`WordThinkerAdapter` is the adapter of the
embedded random-weight thinker.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, cast

import attrs
import structlog
import torch

from ...core.engine_io import ModelTurnRequest, SamplingOverrides, TurnKind
from ...errors import InvalidCommand
from .features import HOP, SAMPLE_RATE, log_mel_tokens, log_mel_tokens_of_pcm, pcm16_to_float
from .model import ThinkerConfig
from .sampling import SamplingParams
from .vocab import Vocabulary

log = structlog.get_logger("duplex_actors.engines.embedded.adapter")


@attrs.frozen(slots=True)
class AudioBudget:
    """How much of the prompt a piece of audio occupies, computed from the PCM on the server."""

    samples: int
    tokens: int
    frames: int
    #: The audio was longer than the model's audio window; its oldest part was dropped.
    truncated: bool


@attrs.frozen(slots=True, eq=False)
class Prompt:
    prefix_ids: tuple[int, ...]
    audio_features: torch.Tensor = attrs.field(repr=lambda t: f"<{tuple(t.shape)}>")
    suffix_ids: tuple[int, ...]
    budget: AudioBudget
    decide_first: bool


class ModelAdapter(Protocol):
    """What the embedded engine asks of a model. See the module docstring for the rules."""

    vocab: Vocabulary

    @property
    def defaults(self) -> SamplingParams: ...

    def audio_budget(
        self, pcm: bytes, sample_rate: int, *, claimed_tokens: int | None = None
    ) -> AudioBudget: ...

    def build_prompt(self, request: ModelTurnRequest) -> Prompt: ...

    def build_prompts(self, requests: Sequence[ModelTurnRequest]) -> list[Prompt | Exception]:
        """``build_prompt`` of each request, in order, where the work can be shared (the
        engine admits turns in bursts); a request that cannot be built gets its exception in
        its place, and the others are built."""
        ...

    def decide(self, unit_snapshot: Sequence[int]) -> bool | None: ...

    def set_session_sampling(self, session_id: str, overrides: SamplingOverrides) -> None: ...

    def forget_session(self, session_id: str) -> None: ...

    def sampling_for(
        self, session_id: str, request_overrides: SamplingOverrides = SamplingOverrides()
    ) -> SamplingParams: ...


def _merge(params: SamplingParams, overrides: SamplingOverrides) -> SamplingParams:
    changes = {
        name: value
        for name in ("temperature", "top_k", "top_p", "max_tokens", "seed")
        if (value := getattr(overrides, name)) is not None
    }
    return attrs.evolve(params, **changes) if changes else params


class WordThinkerAdapter:
    """Adapter of the embedded thinker (log-mel audio tokens, word vocabulary)."""

    def __init__(
        self, cfg: ThinkerConfig, vocab: Vocabulary, defaults: SamplingParams = SamplingParams()
    ) -> None:
        self.cfg = cfg
        self.vocab = vocab
        self._defaults = defaults
        self._sessions: dict[str, SamplingOverrides] = {}
        self._samples_per_token = HOP * cfg.frames_per_token

    @property
    def defaults(self) -> SamplingParams:
        return self._defaults

    # --- rule 1: the budget comes from the PCM ------------------------------------------------

    def audio_budget(self, pcm: bytes, sample_rate: int, *, claimed_tokens: int | None = None) -> AudioBudget:
        if sample_rate != SAMPLE_RATE:
            raise InvalidCommand(f"the embedded thinker takes {SAMPLE_RATE} Hz audio, got {sample_rate} Hz")
        if len(pcm) % 2:
            raise InvalidCommand("pcm16 audio must have an even number of bytes")
        samples = len(pcm) // 2
        # At least one token: an empty unit still gets a (silent) placeholder to attend to.
        wanted = max(1, math.ceil(samples / self._samples_per_token))
        tokens = min(wanted, self.cfg.max_audio_tokens)
        budget = AudioBudget(samples, tokens, tokens * self.cfg.frames_per_token, wanted > tokens)
        if claimed_tokens is not None and claimed_tokens != tokens:
            log.info("adapter.client_budget_ignored", claimed=claimed_tokens, computed=tokens)
        return budget

    def build_prompt(
        self,
        request: ModelTurnRequest,
        *,
        claimed_tokens: int | None = None,
        features: torch.Tensor | None = None,
    ) -> Prompt:
        """The prompt of one turn. ``features``: its audio's log-mel tokens, computed already
        (by :meth:`build_prompts`, for a burst); by default they are computed here."""
        budget = self.audio_budget(request.audio, request.sample_rate, claimed_tokens=claimed_tokens)
        if features is None:
            features = log_mel_tokens(
                pcm16_to_float(request.audio),
                budget.tokens,
                n_mels=self.cfg.n_mels,
                frames_per_token=self.cfg.frames_per_token,
            )
        v = self.vocab
        prefix = [v.bos]
        if request.instructions:
            prefix += v.encode_known_words(request.instructions, self.cfg.max_prefix_tokens - 1)
        if request.input_text:  # typed user input (conversation.item.create) is read like words
            room = self.cfg.max_prefix_tokens - len(prefix)
            if room > 0:
                # The newest words, as a text model's prompt keeps them (prompt_window.py).
                prefix += v.encode_known_words(request.input_text, room, newest=True)
        unit = request.kind is TurnKind.UNIT
        suffix = (v.unit,) if unit else (v.respond,)
        return Prompt(tuple(prefix), features, suffix, budget, decide_first=unit)

    def build_prompts(self, requests: Sequence[ModelTurnRequest]) -> list[Prompt | Exception]:
        """:meth:`build_prompt` of each request, the audio features of all of them computed
        together (:func:`log_mel_tokens_of_pcm`); a request that cannot be built (bad audio)
        gets its exception in its place."""
        results: list[Prompt | Exception | None] = [None] * len(requests)
        where: list[int] = []
        pcms: list[bytes] = []
        tokens: list[int] = []
        for i, request in enumerate(requests):
            try:
                budget = self.audio_budget(request.audio, request.sample_rate)
            except Exception as exc:
                results[i] = exc
                continue
            where.append(i)
            pcms.append(request.audio)
            tokens.append(budget.tokens)
        # On a GPU the features are computed there, where the model reads them.
        features = log_mel_tokens_of_pcm(
            pcms,
            tokens,
            n_mels=self.cfg.n_mels,
            frames_per_token=self.cfg.frames_per_token,
            device=self.cfg.device,
        )
        for i, feats in zip(where, features):
            try:
                results[i] = self.build_prompt(requests[i], features=feats)
            except Exception as exc:
                results[i] = exc
        # Every place is filled above: by its exception or by its prompt.
        return cast(list[Prompt | Exception], results)

    # --- rule 2: decide from this unit's snapshot only ------------------------------------

    def decide(self, unit_snapshot: Sequence[int]) -> bool | None:
        """True = speak, False = listen, None = no decision token in the snapshot yet."""
        for token in unit_snapshot:
            if token == self.vocab.speak:
                return True
            if token == self.vocab.listen:
                return False
        return None

    # --- rule 3: per-session sampling, defaults untouched ---------------------------------

    def set_session_sampling(self, session_id: str, overrides: SamplingOverrides) -> None:
        self._sessions[session_id] = overrides

    def forget_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def sampling_for(
        self, session_id: str, request_overrides: SamplingOverrides = SamplingOverrides()
    ) -> SamplingParams:
        params = attrs.evolve(self._defaults)  # a copy: nothing below can reach the defaults
        params = _merge(params, self._sessions.get(session_id, SamplingOverrides()))
        params = _merge(params, request_overrides)
        if params.max_tokens > self.cfg.max_new_tokens:
            # The KV cache was sized for max_new_tokens; asking for more gets the cap.
            params = attrs.evolve(params, max_tokens=self.cfg.max_new_tokens)
        return params
