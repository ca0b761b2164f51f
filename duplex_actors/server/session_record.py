"""What the server remembers about one session across its connections (resumes): the
connection that carries it, its pacers, what its client declared about the wire, and its
server VAD settings. A connection comes and goes (:mod:`.session_connection`); the record stays
until the session is forgotten (:class:`.app.RealtimeServer`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from ..actors.session_handle import SessionHandle
from . import codec, guard, wire
from .audio_format import AudioFormat, InputConverter
from .billing import Account

if TYPE_CHECKING:
    from ..audio.server_vad import ServerVad
    from .session_connection import SessionConnection


class SessionRecord(Account):
    """What the server remembers about one session across its connections: the connection that
    carries it (at most one, by the connection chart), its pacers, its wire settings, and its
    account in the loop-share ledger (events counted and billed)."""

    __slots__ = (
        "handle",
        "tenant",
        "session_rate",
        "lock",
        "attached",
        "vad",
        "vad_settings",
        "wire",
        "converter",
        "pacer",
        "frame_pacer",
        "handling_pacer",
    )

    def __init__(
        self,
        handle: SessionHandle,
        model: str = "duplex-actors",
        pacers: tuple[guard.IntakePacer | None, ...] = (None, None, None),
        caps: object = None,
    ) -> None:
        super().__init__()
        self.handle = handle
        # Both fixed for the session's life (no update changes them), and read for every
        # frame: kept here rather than asked of the session each time.
        self.tenant = handle.tenant  # whom its work is billed to
        self.session_rate = handle.config.sample_rate  # the rate its audio is buffered at
        # The session's, not a connection's: a client that reconnects (resumes) to start over
        # with a full burst finds the buckets as it left them. Seconds of audio, bytes of
        # frames, seconds of handling.
        self.pacer, self.frame_pacer, self.handling_pacer = pacers
        self.lock = anyio.Lock()  # serialises attach, detach and resume of this session
        self.attached: SessionConnection | None = None
        # Server VAD settings while turn_detection is server_vad; the ServerVad itself is built
        # at the first append (loading a Silero model is slow; a session that never streams
        # audio, or turns VAD off first, never pays it).
        self.vad_settings: wire.TurnDetection | None = None
        self.vad: ServerVad | None = None
        self.wire = codec.WireSession(model=model)  # what the client declared about the wire
        # The engine's token limits, so max_output_tokens echoes the one that really applies.
        self.wire.engine_max_output_tokens = getattr(caps, "max_output_tokens", None)
        self.wire.engine_max_output_tokens_limit = getattr(caps, "max_output_tokens_limit", None)
        self.converter = InputConverter(self.wire.input_format, self.session_rate)

    def declare_input(self, fmt: AudioFormat) -> None:
        """The client declared the format of the audio it sends (session.update)."""
        self.wire.input_format = fmt
        self.converter = InputConverter(fmt, self.session_rate)

    def set_vad(
        self,
        settings: wire.TurnDetection | None,
        create_response: bool = True,
        interrupt_response: bool = True,
    ) -> None:
        """Turn server VAD on with ``settings``, or off (None); the detector is built at the
        next append."""
        self.vad_settings = settings
        self.vad = None
        self.wire.turn_detection = (
            None
            if settings is None
            else _turn_detection_object(settings, create_response, interrupt_response)
        )


def _turn_detection_object(
    settings: wire.TurnDetection, create_response: bool, interrupt_response: bool
) -> dict[str, Any]:
    """The GA turn_detection object in force, of the type the client asked for. semantic_vad
    runs the same detector, its eagerness set as the silence that ends a turn."""
    if settings.type == "semantic_vad":
        return {
            "type": "semantic_vad",
            "eagerness": settings.eagerness or "auto",
            "create_response": create_response,
            "interrupt_response": interrupt_response,
        }
    return {
        "type": "server_vad",
        "threshold": settings.threshold,
        "prefix_padding_ms": settings.prefix_padding_ms,
        "silence_duration_ms": settings.silence_duration_ms,
        "create_response": create_response,
        "interrupt_response": interrupt_response,
        "idle_timeout_ms": settings.idle_timeout_ms,
    }
