"""Server events of input transcription, named as in the OpenAI Realtime API (GA).

When a session asks for input transcription (``session.audio.input.transcription``), each
committed user turn is transcribed off the event loop and the session sends, for the turn's
item: ``conversation.item.input_audio_transcription.delta`` (one per piece the recogniser
decodes: a turn of up to 4 s is one piece, a longer one is cut at pauses; the deltas joined
are the transcript) then ``...completed`` with the transcript, or ``...failed`` with an error
(possibly after deltas, when a later piece failed). They may arrive before, during or after
the turn's response: transcription runs beside the model turn, never in front of it.
"""

from __future__ import annotations

import attrs

from .events import ServerEvent


@attrs.frozen(slots=True, kw_only=True)
class TranscriptionDelta(ServerEvent):
    TYPE = "conversation.item.input_audio_transcription.delta"
    item_id: str
    delta: str


@attrs.frozen(slots=True, kw_only=True)
class TranscriptionCompleted(ServerEvent):
    TYPE = "conversation.item.input_audio_transcription.completed"
    item_id: str
    transcript: str


@attrs.frozen(slots=True, kw_only=True)
class TranscriptionFailed(ServerEvent):
    TYPE = "conversation.item.input_audio_transcription.failed"
    item_id: str
    message: str
