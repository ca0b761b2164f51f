"""Engine actions: what :class:`~duplex_actors.core.session.SessionCore` asks the shell to do.

The core never talks to an engine itself; it leaves these for the shell to carry out
(``SessionCore.take_actions``), and takes an :class:`InputTranscript` back when a
:class:`TranscribeInput` has been done.
"""

from __future__ import annotations

from typing import Union

import attrs

from .engine_io import ModelTurnRequest


@attrs.frozen(slots=True)
class SubmitTurn:
    """Start a model turn (a response, or a model-native unit) for ``request``."""

    request: ModelTurnRequest


@attrs.frozen(slots=True)
class TranscribeInput:
    """Transcribe a committed turn's audio (off the event loop) for ``item_id``."""

    item_id: str
    audio: bytes = attrs.field(repr=lambda b: f"<{len(b)} bytes>")
    sample_rate: int = 16000
    #: what the session asked the recogniser to hear (None: unsaid)
    language: str | None = None


@attrs.frozen(slots=True)
class InputTranscript:
    """What the recogniser made of ``item_id``'s audio; ``error`` set when it failed.

    A long turn is heard piece by piece: each piece's words go out as they come (``delta``,
    ``final=False``), and the last one carries the whole ``text`` as well."""

    item_id: str
    #: The whole transcript (when ``final``).
    text: str = ""
    error: str | None = None
    #: Words heard since the last delta (they follow it as written); None: all of ``text``.
    delta: str | None = None
    #: False: a delta only, more of the turn is still being heard.
    final: bool = True


@attrs.frozen(slots=True)
class AbortRequests:
    """Stop these engine requests; their output, if any still arrives, is stale."""

    request_ids: tuple[str, ...]
    reason: str


#: Everything ``SessionCore.take_actions`` may hand the shell.
EngineAction = Union[SubmitTurn, AbortRequests, TranscribeInput]
