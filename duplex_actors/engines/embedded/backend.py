"""EmbeddedEngine: the whole CPU duplex engine (thinker + optional talker) as one backend.

This is what the engine actor owns when the embedded engine is chosen. Requests that ask for
audio (``"audio" in request.modalities``) and an engine built with a talker get speech
packets; others get text only. Model-native mode (TurnKind.UNIT) is always available.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Callable

import attrs

from ...core.engine_io import EngineOutput, ModelTurnRequest
from ..base import EngineCapabilities, delegated_sync_abort
from ..talker import SpeakingEngine, Talker, TalkerConfig
from .adapter import ModelAdapter
from .model import ThinkerConfig, resolve_device
from .sampling import SamplingParams
from .scheduler import BatchScheduler
from .thinker_backend import EmbeddedThinker
from .vocab import default_vocabulary


class EmbeddedEngine:
    def __init__(self, thinker: EmbeddedThinker, talker: Talker | None = None) -> None:
        self.thinker = thinker
        self.talker = talker
        self._front = SpeakingEngine(thinker, talker) if talker is not None else thinker
        self.name = "embedded"
        self.capabilities: EngineCapabilities = attrs.evolve(
            thinker.capabilities, model_native=True, produces_audio=talker is not None
        )

    @property
    def scheduler(self) -> BatchScheduler | None:
        """The thinker's batch scheduler (stats, observers); None before start()."""
        return self.thinker.scheduler

    @property
    def adapter(self) -> ModelAdapter:
        return self.thinker.adapter

    async def start(self) -> None:
        await self._front.start()

    async def aclose(self) -> None:
        await self._front.aclose()

    def generate(self, request: ModelTurnRequest) -> AsyncGenerator[EngineOutput, None]:
        return self._front.generate(request)

    async def abort(self, request_id: str) -> None:
        await self._front.abort(request_id)

    @property
    def abort_nowait(self) -> Callable[[str], None]:
        return delegated_sync_abort(self._front)


def make_embedded_engine(
    *,
    talker: bool = True,
    d_model: int = 256,
    n_layers: int = 4,
    n_heads: int = 4,
    n_kv_heads: int = 1,
    d_ff: int = 1024,
    max_new_tokens: int = 256,
    max_concurrency: int = 64,
    max_queue: int = 256,
    sampling: SamplingParams = SamplingParams(),
    talker_config: TalkerConfig = TalkerConfig(),
    torch_threads: int | None = 1,
    seed: int = 20240617,
    dispatch_interval_s: float = 0.005,
    device: str | None = None,
    cuda_graphs: bool = False,
) -> EmbeddedEngine:
    """Build (not start) the embedded engine. Defaults: ~3.1 M parameter thinker (4 query
    heads sharing one key/value head), 64 live sequences, 256 queued, Piper talker speaking
    at each request's ``audio_out_rate``. ``talker=False`` gives a text-only engine (no piper
    import).

    ``torch_threads=1`` (process-wide, applied at start): on 2 cores the event loop, VAD and
    the talker need the other core, and a 2-thread OpenMP team stalls badly whenever one of
    its threads is descheduled. ``None`` leaves torch's setting alone.

    ``dispatch_interval_s``: how long the worker may hold a running response's tokens before
    waking the event loop (first tokens and endings go at once; see scheduler.py for why).

    ``device``: where the thinker runs: "cpu", "cuda", "cuda:N" or "auto" (CUDA when torch
    sees one). None reads ``DUPLEX_EMBEDDED_DEVICE`` (what ``serve --device`` and ``demo
    --device`` set, so ``serve --workers N``'s worker processes get it too), else "cpu".
    ``cuda_graphs``: replay the batched decode step as CUDA graphs (ThinkerConfig.cuda_graphs);
    None of this changes the CPU path. The talker (Piper, onnxruntime) stays on the CPU.
    """
    vocab = default_vocabulary()
    device = resolve_device(device or os.environ.get("DUPLEX_EMBEDDED_DEVICE") or "cpu")
    config = ThinkerConfig(
        vocab_size=len(vocab),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_ff=d_ff,
        max_new_tokens=max_new_tokens,
        max_slots=max_concurrency,
        seed=seed,
        device=device,
        cuda_graphs=cuda_graphs,
    )
    thinker = EmbeddedThinker(
        config,
        defaults=sampling,
        max_concurrency=max_concurrency,
        max_queue=max_queue,
        torch_threads=torch_threads,
        seed=seed,
        dispatch_interval_s=dispatch_interval_s,
    )
    return EmbeddedEngine(thinker, Talker(config=talker_config) if talker else None)
