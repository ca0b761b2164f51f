"""The embedded CPU engine: a random-weight torch thinker with continuous batching, a model
adapter, and (optionally) the Piper talker. Needs the 'embedded' extra (torch, numpy, piper).

Public names: :class:`EmbeddedEngine`, :func:`make_embedded_engine`, :class:`EmbeddedThinker`,
the adapter contract (:class:`ModelAdapter`, :class:`WordThinkerAdapter`), and the scheduler's
observability records (:class:`StepRecord`, :class:`SlotReleased`, :class:`SchedulerStats`).
"""

from .adapter import AudioBudget, ModelAdapter, Prompt, WordThinkerAdapter
from .backend import EmbeddedEngine, make_embedded_engine
from .model import Thinker, ThinkerConfig, resolve_device
from .sampling import SamplingParams
from .scheduler import BatchScheduler, SchedulerStats, SlotReleased, StepRecord
from .thinker_backend import EmbeddedThinker

__all__ = [
    "AudioBudget",
    "BatchScheduler",
    "EmbeddedEngine",
    "EmbeddedThinker",
    "ModelAdapter",
    "Prompt",
    "SamplingParams",
    "SchedulerStats",
    "SlotReleased",
    "StepRecord",
    "Thinker",
    "ThinkerConfig",
    "WordThinkerAdapter",
    "make_embedded_engine",
    "resolve_device",
]
