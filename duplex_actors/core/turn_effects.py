"""The engine's side of the turn: the session core's guards and effects over model requests.

Submitting a model turn or a model-native unit, a unit's listen or speak decision, the end of a
turn, and cancelling: the epoch moves on and every request of the old one is aborted until the
engine confirms it ended (:func:`~.engine_io.is_terminal`). The actions go to the shell
through the core's action list.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import attrs

from . import events as ev
from .actions import AbortRequests, SubmitTurn
from .commands import (
    CreateResponse,
)
from .conversation import Item
from .engine_io import (
    Decision,
    EngineOutput,
    FunctionResult,
    FunctionTool,
    ModelTurnRequest,
    TurnKind,
)
from .session_parts import SessionParts
from .step import Step
from .text_budget import response_text_bytes
from .unit_holds import SharedWords, UnitHold


class TurnEffects(SessionParts):
    """Guards and effects over model requests: submit, decide, finish, abort (a part of
    :class:`~.session.SessionCore`)."""

    __slots__ = ()

    # A session without responses (transcription) starts none on its own, whatever its
    # turn-taking settings say: these guards are where the chart asks.
    def _g_auto_respond(self, step: Step) -> bool:
        config = self.config
        return config.auto_respond and config.responses

    def _g_responses_offered(self, step: Step) -> bool:
        return self.config.responses

    def _g_not_draining(self, step: Step) -> bool:
        return not self.draining

    def _g_model_native(self, step: Step) -> bool:
        config = self.config
        return config.model_native and config.responses

    def _g_respond_on_commit(self, step: Step) -> bool:
        config = self.config
        return config.respond_on_commit and config.responses

    def _g_names_active_response(self, step: Step) -> bool:
        wanted = getattr(step.command, "response_id", None)
        return wanted is None or wanted == self.response_id

    def _g_aborts_settled(self, step: Step) -> bool:
        # No abort outstanding besides the one whose end is being confirmed (if any is).
        aborting = self._aborting
        if not aborting:
            return True
        output = step.output
        return output is not None and len(aborting) == 1 and output.request_id in aborting

    def _request(
        self,
        step: Step,
        kind: TurnKind,
        audio: bytes,
        unit: int | None = None,
        words: str | None = None,
        history: tuple[Item, ...] = (),
    ) -> ModelTurnRequest:
        """A model request under the session's current fence (``unit``: a model-native unit's
        number, which its request id carries)."""
        cmd = step.command
        fence = self.fence  # one Fence for the request and its id
        instructions = getattr(cmd, "instructions", None) or self.config.instructions
        shown = self._response_modalities(step)
        tools, tool_choice, sampling = self._response_options(step)
        return ModelTurnRequest(
            request_id=fence.request_id(unit),
            fence=fence,
            kind=kind,
            audio=audio,
            sample_rate=self.config.sample_rate,
            output_sample_rate=self.config.output_sample_rate,
            speed=self.config.output_speed,
            instructions=instructions,
            sampling=sampling,
            # The engine always writes the words: an audio response's transcript is its text.
            modalities=("text", "audio") if "audio" in shown else ("text",),
            submitted_at=step.now,
            input_text=self._pending_words() if words is None else words,
            history=history,
            tools=tools,
            tool_choice=tool_choice,
            tenant=self.tenant,
        )

    def _fx_submit_model_turn(self, step: Step) -> None:
        cmd = step.command
        asked = cmd if isinstance(cmd, CreateResponse) else None
        results: tuple[FunctionResult, ...] = ()
        words = self._response_words(asked)
        # Read before the pending words are taken: what the conversation held before them.
        history = self._history() if self.sends_history and (asked is None or asked.input is None) else ()
        # Its own context (GA response.input) has no audio: the pending turn waits for its response.
        audio = b"" if asked is not None and asked.input is not None else bytes(self._committed)
        # Out of band, or on its own context, a response leaves the pending turn (read, not
        # taken) for the default conversation's next response.
        if asked is None or (asked.input is None and not asked.out_of_band):
            self._committed.clear()
            results = () if self._calls is None else self._calls.take_results()
            self._pending_text = {}
            self._pending_chars = 0
            self._withdraw_offered_words()
        request = self._request(step, TurnKind.RESPONSE, audio, words=words, history=history)
        if results:
            request = attrs.evolve(request, function_results=results)
        self._turn_request = request.request_id
        self._turn_kind = TurnKind.RESPONSE
        self._overlap_ms = None
        self._idle_deadline = None  # a turn is in flight: nobody waits on the user
        self._timing.note_request_start(request.fence, step.now, self.epoch)
        self.lease.in_flight += 1
        self._actions.append(SubmitTurn(request))
        # The response exists as soon as it is accepted (OpenAI sends response.created then,
        # not at the first token), so a cancel right after it still gets its created + done.
        self._fx_begin_response(step)
        # What it holds of its own until it is done counts in the text budget (given back by
        # _emit_response_done, the one place every response ends).
        held = response_text_bytes(words, *self._own_settings(asked))
        response = self._response
        if held and response is not None:
            response.held_text = held
            if self._text_account is not None:
                self._text_account.add(held)
        # And so does the audio its request carries, in the audio budget: the committed turn
        # left the session's buffer (which counted it) for the request, which holds it until
        # the engine is done with it; an out-of-band response's is a copy of the buffer's.
        if audio and response is not None:
            response.held_audio = len(audio)
            if self._audio_account is not None:
                self._audio_account.add(len(audio))

    def _response_words(self, asked: CreateResponse | None) -> str:
        """The words of the response ``asked`` would start (None: one the server starts): its
        own context's, or the pending turn's, as its engine request carries them."""
        if asked is not None and asked.input is not None:
            return self._context_words(asked.input)
        return self._pending_words()

    def _history(self) -> tuple[Item, ...]:
        """The conversation's items a response reads before the pending words: all of them but
        those whose words are pending (they are the request's ``input_text``). The pending ones
        are nearly always the newest, at the end: only a client that inserted one earlier
        (previous_item_id) costs a pass over every item."""
        items = tuple(self._conversation)
        pending = self._pending_text
        if not pending:
            return items
        end = len(items)
        while end and items[end - 1].id in pending:
            end -= 1
        if len(items) - end == len(pending):
            return items[:end]
        return tuple(item for item in items if item.id not in pending)

    def _pending_words(self) -> str:
        """The words of every item the next response answers, in order, one space apart."""
        return " ".join([text for texts in self._pending_text.values() for text in texts])

    @staticmethod
    def _own_settings(asked: CreateResponse | None) -> tuple[str | None, tuple[FunctionTool, ...] | None]:
        """The instructions and tools a response.create set for its response alone."""
        return (None, None) if asked is None else (asked.instructions, asked.tools)

    def _g_response_text_within_budget(self, step: Step) -> bool:
        # Total, as every guard: only a response.create starts a response that may be refused.
        account = self._text_account
        asked = step.command
        if account is None or not isinstance(asked, CreateResponse):
            return True
        held = response_text_bytes(self._response_words(asked), *self._own_settings(asked))
        return not held or account.budget.allows(account, held)

    def _fx_submit_unit(self, step: Step) -> None:
        unit_bytes = self.config.unit_samples * 2
        audio = bytes(self._input[:unit_bytes])
        del self._input[:unit_bytes]
        self._unit_seq += 1
        words = self._words_for_units()
        request = self._request(step, TurnKind.UNIT, audio, unit=self._unit_seq, words=words.text)
        if self._units is None:
            self._units = {}
        # What the request carries counts until the model has decided (unit_holds.py): its
        # audio, which left the buffer that counted it, and its share of the words.
        words.carriers += 1
        self._units[request.request_id] = UnitHold(len(audio), words)
        if self._audio_account is not None:
            self._audio_account.add(len(audio))
        # While the turn is pending, the latest accepted unit owns the request start.
        self._timing.note_request_start(request.fence, step.now, self.epoch)
        self.lease.in_flight += 1
        self._actions.append(SubmitTurn(request))

    def _fx_promote_unit(self, step: Step) -> None:
        rid = cast(EngineOutput, step.output).request_id
        assert self._units is not None  # the chart promotes only a registered unit (model_native)
        # What it holds stays counted, now as the response's (begin_response, in the same row).
        self._promoted_unit = self._units.pop(rid, None)
        self._turn_request = rid
        self._turn_kind = TurnKind.UNIT
        # Other units still deciding would answer for a turn that has already begun; they no
        # longer hold the lease, only the promoted turn does.
        self._fx_abort_units(step)

    def _fx_emit_decision(self, step: Step) -> None:
        out = step.output
        speak = isinstance(out, Decision) and out.speak
        self._emit(ev.DecisionEvent, decision="speak" if speak else "listen", turn_id=self.turn_id)

    def _fx_finish_unit(self, step: Step) -> None:
        rid = cast(EngineOutput, step.output).request_id
        held = None if self._units is None else self._units.pop(rid, None)
        if held is not None:
            self.lease.in_flight -= 1
            self._end_units((held,))

    def _fx_finish_turn(self, step: Step) -> None:
        if self._windows is not None and self._turn_request is not None:
            self._windows.forget(self._turn_request)
        self._timing.prune(self.turn_id)
        self._turn_request = None
        # However the turn ended (a failure may follow an end that waited on held audio), no end
        # waits any more: a stale one would take the next turn's barge-in for ended (no abort).
        self._held_end = None
        self.turn_id += 1
        self.lease.in_flight = max(self.lease.in_flight - 1, 0)
        self._overlap_ms = None

    @property
    def aborted_request_ids(self) -> tuple[str, ...]:
        """The last requests this session aborted: the engine may still hold resources for
        them after the session closed (the runtime keeps the admission slot until it does not)."""
        return tuple(self._aborted_ids or ())

    def _fx_advance_epoch(self, step: Step) -> None:
        self.epoch += 1

    def _abort(self, requests: dict[str, TurnKind], reason: str) -> None:
        """Abort these requests (id -> kind). The kind is kept until each one ends, because
        what counts as its end depends on it (engine_io.is_terminal)."""
        if not requests:
            return
        request_ids = tuple(sorted(requests))
        # Remembered (bounded) so the runtime can keep this session's admission slot until the
        # engine has really let go of what we aborted.
        if self._aborted_ids is None:
            self._aborted_ids = []
        self._aborted_ids.extend(request_ids)
        del self._aborted_ids[:-16]
        if self._aborting is None:
            self._aborting = {}
        self._aborting.update(requests)
        self._actions.append(AbortRequests(request_ids, reason))

    def _fx_abort_units(self, step: Step) -> None:
        # Unregistered first, so their later output classifies as stale; each one's end still
        # settles its abort (engine_io.is_terminal), which is what releases the engine's slot.
        units = self._units
        if not units:
            return
        self._units = None
        self.lease.in_flight = max(self.lease.in_flight - len(units), 0)
        self._end_units(units.values())
        self._abort(dict.fromkeys(units, TurnKind.UNIT), "superseded")

    # -- what units in flight hold (unit_holds.py) ---------------------------------------------

    def _words_for_units(self) -> SharedWords:
        """The pending words, joined once for every unit while they stay the same."""
        words = self._offered_words
        if words is None:
            text = self._pending_words()
            words = self._offered_words = SharedWords(text, response_text_bytes(text, None, None))
            if self._text_account is not None:
                self._text_account.add(words.nbytes)
        return words

    def _withdraw_offered_words(self) -> None:
        """The pending words changed, or the session closed: the next unit joins them anew, and
        the join offered so far counts only while something still carries it."""
        words = self._offered_words
        if words is not None:
            self._offered_words = None
            if not words.carriers:
                self._give_back_words(words)

    def _drop_carrier(self, words: SharedWords) -> None:
        words.carriers -= 1
        if not words.carriers and words is not self._offered_words:
            self._give_back_words(words)

    def _give_back_words(self, words: SharedWords) -> None:
        if words.nbytes and self._text_account is not None:
            self._text_account.add(-words.nbytes)

    def _end_units(self, holds: Iterable[UnitHold]) -> None:
        """Units that ended or were aborted give back what they counted: an aborted one's
        request lets it go as its stream stops, a moment later."""
        audio = 0
        for hold in holds:
            audio += hold.audio_bytes
            self._drop_carrier(hold.words)
        if audio and self._audio_account is not None:
            self._audio_account.add(-audio)

    def _fx_abort_engine_requests(self, step: Step) -> None:
        requests = dict.fromkeys(self._units or (), TurnKind.UNIT)
        if self._units:
            self._end_units(self._units.values())
        if self._held_end is not None:
            # The engine already ended this turn (its end waited on a held response): there is
            # nothing to abort, and no abort would ever be confirmed.
            if self._windows is not None and self._turn_request is not None:
                self._windows.forget(self._turn_request)
        elif self._turn_request:
            requests[self._turn_request] = self._turn_kind
        self._turn_request = None
        self._units = None
        self.lease.in_flight = 0
        self._abort(requests, self._reason(step))

    def _fx_settle_abort(self, step: Step) -> None:
        if self._aborting is not None:
            self._aborting.pop(cast(EngineOutput, step.output).request_id, None)

    def _fx_reset_timing(self, step: Step) -> None:
        self._timing.reset()
        self._overlap_ms = None

    def _fx_count_stale_output(self, step: Step) -> None:
        self.counters.stale_outputs += 1

    def _fx_mark_draining(self, step: Step) -> None:
        self.draining = True
