"""A response as the client sees it: the session core's guards and effects that begin it,
deliver the engine's output into it and end it with exactly one ``response.done``.

The response being assembled is a :class:`~.response.ResponseAssembly`; this module turns it
into server events (output item, content part, deltas, function calls, done) in the order the
Realtime API gives them.
"""

from __future__ import annotations

from typing import Any, cast

import attrs

from . import events as ev
from . import function_events as fev
from .commands import (
    CreateResponse,
)
from .conversation import Item
from .engine_io import (
    AudioPacket,
    EngineOutput,
    FunctionCall,
    FunctionTool,
    SamplingOverrides,
    TextDelta,
    TurnDone,
    TurnKind,
)
from .response import ResponseAssembly
from .session_parts import SessionParts
from .statechart import CLOSED
from .step import Step
from .timing import CumulativeWindow


class ResponseEffects(SessionParts):
    """Guards and effects over the response: begin, deliver, complete, fail, cancel (a part of
    :class:`~.session.SessionCore`)."""

    __slots__ = ()

    def _g_response_begun(self, step: Step) -> bool:
        return self._response is not None

    def _response_options(self, step: Step) -> tuple[tuple[FunctionTool, ...], str, SamplingOverrides]:
        """Tools, tool_choice and sampling for the response being created: the session's,
        unless its response.create set them for itself."""
        config = self.config
        tools, tool_choice, sampling = config.tools, config.tool_choice, config.sampling
        cmd = step.command
        if isinstance(cmd, CreateResponse):
            if cmd.tools is not None:
                tools = cmd.tools
            tool_choice = cmd.tool_choice or tool_choice
            if cmd.max_tokens is not None:
                sampling = attrs.evolve(sampling, max_tokens=cmd.max_tokens or None)
        return tools, tool_choice, sampling

    def _response_modalities(self, step: Step) -> tuple[str, ...]:
        override: tuple[str, ...] | None = getattr(step.command, "modalities", None)
        if isinstance(step.command, CreateResponse) and override:
            return override
        return self.config.modalities

    def _next_response_id(self) -> str:
        return f"resp_{self.session_id[-6:]}_{self.epoch}_{self.turn_id}"

    def _fx_begin_response(self, step: Step) -> None:
        now = step.now
        if self._turn_request is None:  # model-native promotion already set it
            self._turn_request = cast(EngineOutput, step.output).request_id
            self._turn_kind = TurnKind.RESPONSE
        rid = self._next_response_id()
        cmd = step.command
        asked = cmd if isinstance(cmd, CreateResponse) else None
        metadata = asked.metadata if asked is not None else None
        out_of_band = asked is not None and asked.out_of_band
        r = self._response = ResponseAssembly(
            rid,
            self._new_item_id(),
            self.epoch,
            self.turn_id,
            self._response_modalities(step),
            metadata,
            in_conversation=not out_of_band,
        )
        r.max_output_tokens = self._response_options(step)[2].max_tokens
        promoted = self._promoted_unit
        if promoted is not None:
            # A promoted unit's request carries its audio and words until the response is done
            # (turn_effects._fx_promote_unit): given back with the response's.
            self._promoted_unit = None
            r.held_audio = promoted.audio_bytes
            r.held_words = promoted.words
        self._timing.bind(self.turn_id, rid, now)
        self.counters.responses += 1
        self._emit(
            ev.ResponseCreated,
            response_id=rid,
            item_id=r.item_id,
            turn_id=self.turn_id,
            metrics=self._timing.snapshot(),
            modalities=r.modalities,
            metadata=metadata,
            max_output_tokens=r.max_output_tokens,
            out_of_band=out_of_band,
        )

        # The assistant message is opened by its first words or audio (_open_message): a
        # response that only calls functions carries only its function_call items (GA).

    def _open_message(self, r: ResponseAssembly) -> None:
        """Open the response's assistant message as its next output item."""
        r.open_message()
        # Under the response's epoch: a cancel (which moved the session's) may open it.
        ids: dict[str, Any] = {
            "response_id": r.response_id,
            "item_id": r.item_id,
            "output_index": r.message_index,
            "epoch": r.epoch,
        }
        item = r.item("in_progress")
        self._emit(ev.OutputItemAdded, item=item, **ids)
        if r.in_conversation:
            previous = self._conversation.add(item)
            self._emit(ev.ItemAdded, item=item, previous_item_id=previous, epoch=r.epoch)
        self._emit(ev.ContentPartAdded, part_type=r.part_type, **ids)

    def _fx_deliver_text(self, step: Step) -> None:
        out: TextDelta = step.output  # type: ignore[assignment]  # (not typing.cast: a call per delta)
        r = self._response
        assert r is not None  # the chart's deliver rows run only once the response has begun
        if not out.text:
            return
        if r.message_index is None:
            self._open_message(r)
        first = self._timing.on_text(step.now, out.token_count)
        r.output_tokens += out.token_count
        metrics = self._timing.snapshot() if first else None
        # The words of an audio response go out once, as its transcript.
        words, event = (r.transcript, ev.TranscriptDeltaEvent) if r.spoken else (r.text, ev.TextDeltaEvent)
        words.append(out.text)
        self._emit(
            event,
            response_id=r.response_id,
            item_id=r.item_id,
            output_index=r.message_index,
            delta=out.text,
            metrics=metrics,
        )

    def _fx_deliver_audio(self, step: Step) -> None:
        out: AudioPacket = step.output  # type: ignore[assignment]  # (not typing.cast: a call per packet)
        now = step.now
        r = self._response
        assert r is not None  # the chart's deliver rows run only once the response has begun
        if "audio" not in r.modalities:
            return  # a text-only response: audio the engine sent anyway is not the client's
        if r.message_index is None:
            self._open_message(r)
        duration_s = out.duration_s
        first = self._timing.on_audio(now, duration_s)
        r.audio = True
        r.audio_ms += duration_s * 1000.0
        # The client plays packets back to back from the first: the idle timeout counts
        # from the end of what it was sent.
        self._playing_until = max(self._playing_until, now) + duration_s
        self._emit(
            ev.AudioDeltaEvent,
            response_id=r.response_id,
            item_id=r.item_id,
            output_index=r.message_index,
            pcm=out.pcm,
            sample_rate=out.sample_rate,
            metrics=self._timing.snapshot() if first else None,
        )
        if out.transcript and not r.spoken:
            r.transcript.append(out.transcript)
            self._emit(
                ev.TranscriptDeltaEvent,
                response_id=r.response_id,
                item_id=r.item_id,
                output_index=r.message_index,
                delta=out.transcript,
            )

    def _fx_deliver_function_call(self, step: Step) -> None:
        out = cast(FunctionCall, step.output)
        r = self._response
        assert r is not None  # the chart's deliver rows run only once the response has begun
        call = r.add_call(self._new_item_id(), out.call_id, out.name, out.arguments)
        r.output_tokens += out.token_count  # the model's tokens that wrote the call
        self._call_registry().remember(out.call_id, out.name)
        ids: dict[str, Any] = {"response_id": r.response_id, "call": call}
        self._emit(fev.FunctionCallItemAdded, **ids)
        # A call is a conversation item of its own (GA): retrievable, what an output answers,
        # and announced like every item a response adds (conversation.item.added now, .done
        # with its arguments), so a client mirroring the conversation (livekit) knows it. Not
        # an out-of-band response's: its output stays the client's.
        if r.in_conversation:
            previous = self._conversation.add(call.to_item())
            self._emit(ev.ItemAdded, item=call.to_item("in_progress"), previous_item_id=previous)
        if out.arguments:
            self._emit(fev.FunctionArgumentsDelta, delta=out.arguments, **ids)
        self._emit(fev.FunctionArgumentsDone, **ids)
        self._emit(fev.FunctionCallItemDone, **ids)
        if r.in_conversation:
            self._emit(ev.ItemDone, item=call.to_item(), previous_item_id=previous)

    def _close_parts(self, status: str, reason: str | None, stop_latency_s: float | None = None) -> None:
        r = self._response
        if r is None:
            return
        if r.message_index is None:
            if r.calls:  # a call-only response: its function_call items are its whole output
                self._emit_response_done(r, status, reason, stop_latency_s, r.output_items(None))
                return
            self._open_message(r)  # a response with nothing in it still answers with a message
        ids: dict[str, Any] = {
            "response_id": r.response_id,
            "item_id": r.item_id,
            "epoch": r.epoch,
            "output_index": r.message_index,
        }
        if not r.spoken:
            self._emit(ev.TextDone, text="".join(r.text), **ids)
        if r.spoken or r.audio:
            self._emit(ev.AudioDone, **ids)
            self._emit(ev.TranscriptDone, transcript="".join(r.transcript), **ids)
        item_status = "completed" if status == "completed" else "incomplete"
        item = r.item(item_status)
        self._emit(
            ev.ContentPartDone,
            part_type=r.part_type,
            text=item.content[0].transcript or item.content[0].text or "",
            **ids,
        )
        self._emit(ev.OutputItemDone, status=item_status, item=item, **ids)
        self._conversation.replace(item)
        if r.item_id in self._conversation:
            self._emit(
                ev.ItemDone,
                item=item,
                previous_item_id=self._conversation.previous_of(r.item_id),
                epoch=r.epoch,
            )
        self._emit_response_done(r, status, reason, stop_latency_s, r.output_items(item))

    def _emit_response_done(
        self,
        r: ResponseAssembly,
        status: str,
        reason: str | None,
        stop_latency_s: float | None,
        output: tuple[Item, ...],
    ) -> None:
        self._emit(
            ev.ResponseDone,
            status=status,
            reason=reason,
            turn_id=r.turn_id,
            metrics=self._timing.snapshot(stop_latency_s=stop_latency_s),
            modalities=r.modalities,
            metadata=r.metadata,
            output=output,
            output_tokens=r.output_tokens,
            input_usage=r.input_usage,
            max_output_tokens=r.max_output_tokens,
            out_of_band=not r.in_conversation,
            response_id=r.response_id,
            item_id=r.item_id,
            epoch=r.epoch,
        )
        self._response = None
        if r.held_text:  # what it held of its own (turn_effects._fx_submit_model_turn)
            if self._text_account is not None:
                self._text_account.add(-r.held_text)
            r.held_text = 0
        if r.held_audio:  # the audio its request carried (ditto)
            if self._audio_account is not None:
                self._audio_account.add(-r.held_audio)
            r.held_audio = 0
        if r.held_words is not None:  # a promoted unit's words (unit_holds.py)
            self._drop_carrier(r.held_words)
            r.held_words = None

    def _ensure_begun(self, step: Step) -> None:
        # A RESPONSE turn that ends before any output still answers its request: the client
        # gets one created/done pair rather than silence.
        if self._response is None:
            self._fx_begin_response(step)

    def _fx_emit_response_completed(self, step: Step) -> None:
        # The engine's end, or, after a backchannel, the end that waited while audio was held.
        out = self._held_end if step.output is None else step.output
        self._held_end = None
        self._ensure_begun(step)
        if isinstance(out, TurnDone) and out.metrics is not None:
            if self._windows is None:
                self._windows = CumulativeWindow()
            self._timing.on_engine_metrics(self._windows.window(out.request_id, out.metrics))
        if isinstance(out, TurnDone) and self._response is not None:
            self._response.input_usage = out.input
        status = "completed" if getattr(out, "reason", "completed") != "length" else "incomplete"
        self._close_parts(status, None if status == "completed" else "max_output_tokens")

    def _fx_emit_response_failed(self, step: Step) -> None:
        out = step.output
        self._ensure_begun(step)
        self.counters.failed += 1
        message = getattr(out, "message", "the engine ended the request")
        self._close_parts("failed", "engine_error")
        self._emit(
            ev.ErrorEvent,
            code="engine_error",
            message=message,
            error_type="server_error",
            error_class="EngineFailed",
        )

    def _fx_emit_engine_error(self, step: Step) -> None:
        out = step.output
        self._emit(
            ev.ErrorEvent,
            code="engine_error",
            error_type="server_error",
            error_class="EngineFailed",
            message=getattr(out, "message", "engine request ended"),
        )

    def _fx_drop_undelivered_audio(self, step: Step) -> None:
        self._playing_until = 0.0  # a cancelled response stops playing (clients cut it short)
        if self._response is not None:
            self.counters.dropped_audio_events += self._outbox.purge_audio(self._response.response_id)
        # Held audio, of a response begun or not, is never heard: the hold ends with it.
        if self._outbox.holding is not None:
            self.counters.dropped_audio_events += self._outbox.purge_audio(self._outbox.holding)
        self._hold_from = None
        self._held_end = None

    def _fx_emit_response_cancelled(self, step: Step) -> None:
        if self._response is None:
            return
        self.counters.cancelled += 1
        received = step.received_at
        stop = None if received is None else max(self.clock.now() - received, 0.0)
        reason = self._reason(step)
        if self._state == CLOSED and reason not in ("turn_detected", "client_cancelled"):
            reason = "session_closed"
        self._close_parts("cancelled", reason, stop)
