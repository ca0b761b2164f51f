"""The user's side of the turn: the session core's guards and effects over its audio input.

Audio buffered and committed, server VAD's speech and idle timer, and the overlap of the
user's speech with a response (its audio held until the overlap policy decides). The rows that
name them are in :mod:`.statechart`; the state they work on is declared in
:mod:`.session_parts`.
"""

from __future__ import annotations

from typing import cast

from . import events as ev
from .actions import TranscribeInput
from .commands import (
    AppendAudio,
    SpeechStartedSignal,
    SpeechStoppedSignal,
    UpdateSession,
)
from .conversation import ContentPart, Item
from .overlap import OverlapPolicy, OverlapVerdict
from .session_config import SessionConfig
from .session_parts import SessionParts
from .step import Step


class InputEffects(SessionParts):
    """Guards and effects over the input: buffered and committed audio, speech, the idle
    timer, and speech over a response (a part of :class:`~.session.SessionCore`)."""

    __slots__ = ()

    # The two append checks run on every append: written for speed (a try costs nothing
    # unless it catches, and it only catches when asked outside an append). The command is
    # typed by annotation rather than typing.cast, which is a function call per use.
    def _g_audio_at_session_rate(self, step: Step) -> bool:
        command: AppendAudio = step.command  # type: ignore[assignment]
        try:
            return command.sample_rate == self.config.sample_rate
        except AttributeError:
            return False

    def _g_input_fits(self, step: Step) -> bool:
        command: AppendAudio = step.command  # type: ignore[assignment]
        try:
            return self._input.nbytes + len(command.pcm) <= self.config.max_input_bytes
        except AttributeError:
            return True

    def _g_within_audio_budget(self, step: Step) -> bool:
        account = self._audio_account
        if account is None:
            return True
        command: AppendAudio = step.command  # type: ignore[assignment]
        try:
            n = len(command.pcm)
        except AttributeError:
            return True
        budget = account.budget
        # AudioBudget.allows, its first (and almost always deciding) test inline.
        return budget.total + n <= budget.max_bytes or budget.allows(account, n)

    def _g_idle_deadline_passed(self, step: Step) -> bool:
        deadline = self._idle_deadline
        return deadline is not None and step.now >= deadline

    def _g_has_buffered_audio(self, step: Step) -> bool:
        return len(self._input) > 0

    def _g_server_vad(self, step: Step) -> bool:
        return self.config.server_vad

    def _g_interrupt_response(self, step: Step) -> bool:
        return self.config.interrupt_response

    def _g_holds_audio_on_speech(self, step: Step) -> bool:
        return self.config.hold_audio_on_speech

    def _g_audio_held(self, step: Step) -> bool:
        return self._hold_from is not None

    def _g_turn_end_held(self, step: Step) -> bool:
        return self._held_end is not None

    def _g_update_ends_overlap(self, step: Step) -> bool:
        # Total, as every guard: tools (the SCXML check) ask each guard on every step.
        cmd = step.command
        return isinstance(cmd, UpdateSession) and (
            cmd.server_vad is not None or cmd.interrupt_response is not None
        )

    def _g_overlap_is_interruption(self, step: Step) -> bool:
        overlap = self._overlap_ms
        if overlap is None:
            return False
        verdict = OverlapPolicy(self.config.min_interruption_ms).judge(overlap, still_speaking=True)
        return verdict is OverlapVerdict.BARGE_IN

    def _fx_buffer_audio(self, step: Step) -> None:
        command: AppendAudio = step.command  # type: ignore[assignment]  # (no cast: see above)
        buffered = self._input
        buffered += command.pcm
        window = self._pre_speech_bytes
        # Under server VAD, audio before the user speaks is only the turn's prefix padding:
        # a microphone streaming quiet kept all of it, until appends were refused as
        # input_backpressure (after 120 s) and the next turn carried minutes of silence.
        if window is not None and not self._speaking and len(buffered) > window:
            buffered.keep_last(window)

    @staticmethod
    def _speech_window(config: SessionConfig) -> int | None:
        """Bytes of input kept while no speech is open: the prefix padding under server VAD,
        everything otherwise (the client commits what it sent; a model-native model hears
        every unit, quiet included, and decides for itself)."""
        if not config.server_vad or config.model_native:
            return None
        return int(config.speech_prefix_ms * config.sample_rate / 1000) * 2

    def _fx_open_speech(self, step: Step) -> None:
        self._speaking = True
        self._idle_deadline = None  # the user is not idle

    def _fx_close_speech(self, step: Step) -> None:
        self._speaking = False
        # Speech that became no turn (a backchannel over a response) is not kept past the
        # window either; the rows run this after any commit of the speech, so a turn is whole.
        window = self._pre_speech_bytes
        if window is not None and len(self._input) > window:
            self._input.keep_last(window)
        self._fx_start_idle_timer(step)

    def _fx_start_idle_timer(self, step: Step) -> None:
        """Set server VAD's idle timer, if the session has one: the quiet counts from when the
        last response's audio finishes playing (now, if it has), never while the user speaks
        or a turn is in flight."""
        config = self.config
        timeout = config.idle_timeout_ms
        if (
            timeout is None
            or not config.server_vad
            or not config.responses  # the timer's end starts a response
            or self._speaking
            or self._turn_request is not None
            or self.lease.detached  # nobody to prompt: the timer starts again on resume
        ):
            return
        now = step.now
        self._idle_deadline = max(now, self._playing_until) + timeout / 1000.0
        self._idle_from_ms = self._input_ms

    def _fx_emit_timeout_triggered(self, step: Step) -> None:
        # The audio written since the quiet began (GA: audio_end_ms - audio_start_ms is about
        # the timeout when the client streams its microphone; equal when it sends nothing).
        timeout = self.config.idle_timeout_ms or 0
        end = self._input_ms
        start = max(self._idle_from_ms, end - timeout)
        self._emit(
            ev.InputTimeoutTriggered,
            audio_start_ms=int(start),
            audio_end_ms=int(end),
            item_id=self._input_item_id(),
        )

    def _fx_clear_input(self, step: Step) -> None:
        self._input.clear()
        self._next_input_item = None
        self._emit(ev.InputCleared)

    def _fx_emit_speech_started(self, step: Step) -> None:
        cmd = cast(SpeechStartedSignal, step.command)
        self._emit(ev.SpeechStarted, audio_start_ms=cmd.audio_ms, item_id=self._input_item_id())

    def _fx_emit_speech_stopped(self, step: Step) -> None:
        cmd = cast(SpeechStoppedSignal, step.command)
        self._emit(ev.SpeechStopped, audio_end_ms=cmd.audio_ms, item_id=self._input_item_id())

    def _fx_start_overlap(self, step: Step) -> None:
        self._overlap_ms = 0.0

    def _fx_end_overlap(self, step: Step) -> None:
        # The speech ended before the minimum: a backchannel; the response carries on.
        self._overlap_ms = None

    def _fx_hold_response_audio(self, step: Step) -> None:
        # From now on the client gets none of this response's audio until the overlap policy
        # decides. A response not begun yet is held by the id it will be given. A text-only
        # response talks over nobody: nothing is held. Text beside audio is held with it, so
        # the response's deltas still reach the client in the order they were made.
        r = self._response
        modalities = r.modalities if r is not None else self._response_modalities(step)
        if "audio" not in modalities:
            return
        self._hold_from = step.now
        rid = r.response_id if r is not None else self._next_response_id()
        self._outbox.hold(rid, text="text" in modalities)

    def _fx_release_held_audio(self, step: Step) -> None:
        if self._hold_from is None:
            return
        now = step.now
        self.counters.released_audio_events += self._outbox.release()
        # What was held plays from now: the idle timeout counts from its end.
        if self._playing_until > self._hold_from:
            self._playing_until += max(now - self._hold_from, 0.0)
        self._hold_from = None

        # A turn end that waited for this (_held_end) is completed by the row's next effects.

    def _fx_hold_turn_end(self, step: Step) -> None:
        self._held_end = step.output

    def _fx_commit_input(self, step: Step) -> None:
        # Audio committed but not yet answered accumulates: several commits before one
        # response.create all reach the engine (OpenAI's conversation keeps every user item),
        # within max_committed_bytes, the newest kept. Unbounded, a client that commits and
        # never asks for a response held all of it, and the bytes += copied it all each time.
        buffered = self._input
        nbytes = buffered.nbytes
        # Only a transcription needs the audio as one piece; the chunks move as they are.
        audio = bytes(buffered) if self.config.transcription is not None else b""
        if self.config.responses:
            committed = self._committed
            buffered.move_into(committed)
            if len(committed) > self.config.max_committed_bytes:
                committed.keep_last(self.config.max_committed_bytes - self.config.max_committed_bytes % 2)
        else:
            # No response will hear it (a transcription session): kept, a captioning session
            # held its newest max_committed_bytes of audio for nothing, counted in the budget.
            buffered.clear()
        ms = int(nbytes / 2 / self.config.sample_rate * 1000)
        item = Item(
            id=self._input_item_id(), role="user", content=(ContentPart(type="input_audio", audio_ms=ms),)
        )
        self._next_input_item = None
        previous = self._conversation.add(item)
        self._emit(ev.InputCommitted, item_id=item.id, audio_ms=ms, previous_item_id=previous)
        self._emit(ev.ItemAdded, item=item, previous_item_id=previous)
        self._emit(ev.ItemDone, item=item, previous_item_id=previous)
        if self.config.transcription is not None:
            self._actions.append(
                TranscribeInput(item.id, audio, self.config.sample_rate, self.config.transcription_language)
            )
