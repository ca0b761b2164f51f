"""The seam every engine backend plugs into.

A backend turns a :class:`ModelTurnRequest` into a stream of outputs. The shared
:class:`~duplex_actors.actors.engine_actor.EngineActor` owns the backend, starts one stream per
request, routes outputs to sessions by request id, and guarantees one terminal output per
request. So a backend only has to:

* ``generate(request)``: an async iterator of outputs for that request, ending after its
  terminal output (``TurnDone`` or ``EngineFailure``; for a UNIT turn a listen ``Decision`` is
  terminal too). Batching across concurrent requests is the backend's business: many
  ``generate`` calls are alive at once and should share decode steps.
* free the request's resources promptly when the consuming task is cancelled (that is how the
  engine actor aborts), and also when ``abort(request_id)`` is called.
* never block the event loop: model compute runs in a worker thread or process.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Protocol, runtime_checkable

import attrs

from ..core.engine_io import EngineOutput, ModelTurnRequest


@attrs.frozen(slots=True)
class EngineCapabilities:
    """What an engine can do, which the runtime plans around: model-native listen/speak decisions,
    audio output, the unit size, and how many requests it takes at once.
    """

    #: Can decide listen/speak per audio unit (model-native duplex mode).
    model_native: bool = False
    #: Produces AudioPacket outputs (has a talker).
    produces_audio: bool = False
    #: Samples per model unit in model-native mode (16000 = 1 s at 16 kHz).
    unit_samples: int = 16000
    max_concurrency: int = 64
    #: The most tokens one response may generate when the request names no limit (the
    #: engine's own cap, echoed as ``max_output_tokens``); None: the engine has none.
    max_output_tokens: int | None = None
    #: The most tokens any request may ask for (a larger limit is cut to it); None: no ceiling.
    max_output_tokens_limit: int | None = None
    #: Reads the conversation's earlier items (``ModelTurnRequest.history``): a text model that
    #: answers from a transcript. Off, requests carry no history (nothing to copy to an engine
    #: process for an engine that would not read it).
    reads_history: bool = False


@runtime_checkable
class EngineBackend(Protocol):
    """What the engine actor needs of a model backend: start, close, and ``generate(request)``, an
    async stream of engine outputs ending with exactly one terminal; plus ``abort``. Implemented by
    the scripted, embedded, vLLM and Ray engines.
    """

    name: str
    capabilities: EngineCapabilities

    async def start(self) -> None:
        """Load weights, start worker threads. Called once by the engine actor."""

    async def aclose(self) -> None:
        """Stop and free everything; in-flight streams end."""

    def generate(self, request: ModelTurnRequest) -> AsyncGenerator[EngineOutput, None]:
        """Stream the outputs of one model turn: an async generator, which the caller closes
        (``aclose``) when it stops reading early."""

    async def abort(self, request_id: str) -> None:
        """Stop a request now; a no-op for unknown or finished ids.

        A backend whose abort never needs to wait may also offer ``abort_nowait(request_id)``
        (synchronous, same contract): the engine actor then calls it on the barge-in path itself
        instead of starting a task for ``abort``, one event-loop iteration sooner."""


def sync_abort(backend: EngineBackend) -> Callable[[str], None] | None:
    """The backend's ``abort_nowait``, if the class that defines its ``abort`` defines it too:
    a subclass that overrides ``abort`` alone (to count or fail aborts) must still be called
    through it. Wrappers delegate with this, so the rule holds through them as well."""
    for klass in type(backend).__mro__:
        if "abort" in vars(klass):
            if "abort_nowait" not in vars(klass):
                return None
            break
    return getattr(backend, "abort_nowait", None)


def delegated_sync_abort(inner: EngineBackend) -> Callable[[str], None]:
    """For a wrapper's ``abort_nowait`` property: the inner backend's, or AttributeError."""
    nowait = sync_abort(inner)
    if nowait is None:
        raise AttributeError("abort_nowait")
    return nowait
