"""A session's settings (:class:`SessionConfig`) and what it counts (:class:`SessionCounters`).

The config is a frozen value: ``session.update`` replaces it with an evolved copy, so a model
turn that was built from the old one never sees it change underneath.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from .engine_io import SPEED_RANGE, FunctionTool, SamplingOverrides

_none_or_positive: Callable[[Any, Any, int | None], Any] = attrs.validators.optional(attrs.validators.gt(0))
# A value that makes no sense is refused when the config is made, naming its field: before,
# an embedder's sample_rate of 0 made every commit "buffer too small", an outbox_reserve of 0
# failed the session's opening inside the runtime, and a negative grace or age went unnoticed.
_positive = attrs.validators.gt(0)
_not_negative = attrs.validators.ge(0)
_not_negative_s = attrs.validators.ge(0.0)  # seconds (NaN is refused too)
_none_or_not_negative: Callable[[Any, Any, int | None], Any] = attrs.validators.optional(_not_negative)


@attrs.frozen(slots=True, kw_only=True)
class SessionConfig:
    """How one session behaves: turn-taking, audio format, response shape, tools and limits."""

    #: server VAD's end of speech starts a model turn (OpenAI's turn_detection.create_response);
    #: False = wait for response.create.
    auto_respond: bool = True
    #: An explicit commit starts a model turn too. On for embedders (commit, then read the
    #: reply); the Realtime server turns it off, because in OpenAI's GA contract a client commit
    #: only adds the audio to the conversation and a response needs response.create.
    respond_on_commit: bool = True
    #: The session makes responses. False: a transcription session (GA ``session.type:
    #: "transcription"``): its committed audio is transcribed and nothing answers it;
    #: response.create is refused (ResponsesNotOffered), and nothing starts a response on the
    #: session's own (auto_respond, respond_on_commit, model_native and the idle timeout are
    #: read as off, whatever they say).
    responses: bool = True
    #: server VAD: speech_stopped ends the user's turn (commit) instead of a client commit.
    server_vad: bool = False
    #: Under server VAD, the audio kept from before the user starts speaking (OpenAI's
    #: turn_detection.prefix_padding_ms). While no speech is open the input buffer holds only
    #: this much of the newest audio, so a microphone streaming silence never fills it (a turn
    #: is prefix + speech + the silence that ended it, as OpenAI commits it). Not in
    #: model-native mode, whose model hears every unit, quiet included.
    speech_prefix_ms: int = attrs.field(default=300, validator=attrs.validators.ge(0))
    #: Under server VAD, the quiet after a response (once its audio has played) that makes the
    #: session commit what it holds and respond on its own (OpenAI's
    #: turn_detection.idle_timeout_ms, input_audio_buffer.timeout_triggered). None: never.
    idle_timeout_ms: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.gt(0))
    )
    #: model-native duplex: the model decides listen/speak per audio unit.
    model_native: bool = False
    #: Send a ``duplex.state`` event on every change of the statechart's state (extension,
    #: off by default: GA clients never see it).
    state_events: bool = False
    sample_rate: int = attrs.field(default=16000, validator=_positive)
    #: The rate the client plays the session's audio at (None: ``sample_rate``). Model turns
    #: pass it to the engine (``ModelTurnRequest.output_sample_rate``) so a speaking engine
    #: synthesises at it and the edge need not convert.
    output_sample_rate: int | None = attrs.field(default=None, validator=_none_or_positive)
    #: How fast the engine speaks, 1.0 being its natural pace (OpenAI's audio.output.speed,
    #: 0.25-1.5). Model turns pass it to the engine (``ModelTurnRequest.speed``).
    output_speed: float = attrs.field(
        default=1.0, validator=[attrs.validators.ge(SPEED_RANGE[0]), attrs.validators.le(SPEED_RANGE[1])]
    )
    unit_samples: int = attrs.field(default=16000, validator=_positive)
    #: speech over a response longer than this (in audio) barges in; shorter is a backchannel.
    min_interruption_ms: int = attrs.field(default=500, validator=_not_negative)
    #: Speech over a response may cancel it (OpenAI's turn_detection.interrupt_response). False:
    #: the response plays to its end, and under server VAD the speech is committed when it
    #: stops (no response is created for it while one plays, as OpenAI says it may not be).
    interrupt_response: bool = True
    #: Speech over a response holds its audio from the client until the overlap policy has
    #: decided (OpenAI stops at speech_started): released on a backchannel, dropped on an
    #: interruption. False: the audio plays on until the interruption (the earlier behaviour,
    #: kept as the benchmark's baseline).
    hold_audio_on_speech: bool = True
    instructions: str | None = None
    sampling: SamplingOverrides = SamplingOverrides()
    #: What a response streams. ("text", "audio"): text deltas and audio (with per-packet
    #: transcripts) side by side; ("audio",): OpenAI's audio responses, the words streamed only
    #: as the audio's transcript; ("text",): text, no audio.
    modalities: tuple[str, ...] = ("text", "audio")
    #: function tools the model may call (session.update ``tools``) and the ``tool_choice``.
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: str = "auto"
    #: input transcription: the model name the client asked for (None: off). The runtime's
    #: transcriber does the work, whatever the name.
    transcription: str | None = None
    #: the language the client says the user speaks (None: unsaid); a recogniser that cannot
    #: hear it fails each turn's transcription (runtime.transcribe), the session goes on.
    transcription_language: str | None = None
    #: Items the conversation keeps (oldest forgotten first).
    max_items: int = attrs.field(default=256, validator=_positive)
    #: Characters of text the conversation keeps over all its items (oldest items forgotten
    #: first, never the newest): 256 K characters, about 64 K tokens, twice the context of
    #: OpenAI's realtime models. None: only ``max_items`` bounds it.
    max_conversation_chars: int | None = attrs.field(default=1 << 18, validator=_none_or_not_negative)
    #: uncommitted user audio kept at most (bytes of pcm16); beyond it: input_backpressure.
    max_input_bytes: int = attrs.field(default=16000 * 2 * 120, validator=_not_negative)
    #: committed user audio waiting for the next response, kept at most (bytes of pcm16; the
    #: newest is kept, as a conversation forgets its oldest items). A GA commit does not start
    #: a response, so a client committing and never asking for one held every commit's audio.
    max_committed_bytes: int = attrs.field(default=16000 * 2 * 120, validator=attrs.validators.ge(0))
    #: Events the session holds for its client at most (core/outbox.py); the engine waits for
    #: the client at half of it, and goes on once three quarters are free.
    outbox_capacity: int = 2048
    #: Of it, kept for terminal events only (at least 2, and less than the capacity).
    outbox_reserve: int = attrs.field(default=16)
    #: Bytes of a response's audio the session may hold unsent (in its outbox, and on its way
    #: there from the engine) before the engine waits for the listener to take some: a client
    #: that reads slowly, or has gone away for a resume, is not sent audio faster than it takes
    #: it, and the server does not keep a whole answer's audio for it. The engine goes on once
    #: half of it has been taken. 256 KiB is about 5 s of 24 kHz pcm16. None: no audio bound
    #: (the outbox's half still applies).
    unsent_audio_bytes: int | None = attrs.field(default=256 << 10, validator=_none_or_positive)
    idle_ttl_s: float = attrs.field(default=300.0, validator=_not_negative_s)
    disconnect_grace_s: float = attrs.field(default=30.0, validator=_not_negative_s)
    journal_max_events: int = attrs.field(default=4096, validator=_not_negative)
    journal_max_bytes: int = attrs.field(default=8 << 20, validator=_not_negative)
    journal_max_age_s: float = attrs.field(default=60.0, validator=_not_negative_s)

    @outbox_reserve.validator
    def _reserve_within_capacity(self, attribute: attrs.Attribute[int], reserve: int) -> None:
        if not self.outbox_capacity > reserve >= 2:
            raise ValueError(
                f"outbox_reserve ({reserve}) must be at least 2 and less than outbox_capacity ({self.outbox_capacity})"
            )

    def public(self) -> dict[str, Any]:
        return {
            "auto_respond": self.auto_respond,
            "respond_on_commit": self.respond_on_commit,
            "responses": self.responses,
            "model_native": self.model_native,
            "state_events": self.state_events,
            "server_vad": self.server_vad,
            "speech_prefix_ms": self.speech_prefix_ms,
            "idle_timeout_ms": self.idle_timeout_ms,
            "sample_rate": self.sample_rate,
            "output_sample_rate": self.output_sample_rate,
            "output_speed": self.output_speed,
            "min_interruption_ms": self.min_interruption_ms,
            "interrupt_response": self.interrupt_response,
            "instructions": self.instructions,
            "modalities": list(self.modalities),
            "tools": [
                {"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters}
                for t in self.tools
            ],
            "tool_choice": self.tool_choice,
            "max_output_tokens": self.sampling.max_tokens,
            "transcription": self.transcription,
            "transcription_language": self.transcription_language,
        }


@attrs.define(slots=True)
class SessionCounters:
    """Running totals of one session (mutable: the core bumps them in place, no copy per event)."""

    commands: int = 0
    rejected: int = 0
    stale_outputs: int = 0
    invalid_outputs: int = 0
    dropped_audio_events: int = 0
    #: audio (and transcript) deltas held while the user spoke over the response, then sent
    #: on because the overlap was a backchannel
    released_audio_events: int = 0
    responses: int = 0
    cancelled: int = 0
    failed: int = 0
