"""Conversation items: the session core's guards and effects over its
:class:`~.conversation.Conversation`.

Items created, deleted, retrieved and truncated by the client, function outputs and the calls
they answer, the words the next response reads, and the playback the client reports (what it
heard of an assistant item).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import cast

import attrs

from ..errors import InvalidItem, ItemNotFound
from . import events as ev
from .actions import TranscribeInput
from .commands import (
    AddFunctionOutput,
    Command,
    CreateItem,
    CreateResponse,
    DeleteItem,
    PlaybackAck,
    RetrieveItem,
    TruncateItem,
)
from .conversation import Item
from .playback import PlaybackLedger
from .session_parts import SessionParts
from .step import Step


class ItemEffects(SessionParts):
    """Guards and effects over the conversation's items, function calls and playback (a part
    of :class:`~.session.SessionCore`)."""

    __slots__ = ()

    def _g_answers_known_call(self, step: Step) -> bool:
        call_id = None if step.command is None else _answered_call(step.command)
        return call_id is None or (self._calls is not None and call_id in self._calls)

    def _facts_answers_known_call(self, step: Step) -> dict[str, object]:
        return {"call_id": None if step.command is None else _answered_call(step.command)}

    def _g_item_audio_within_budget(self, step: Step) -> bool:
        # Total, as every guard: asked on any step, it reads the audio only a created item has.
        account = self._audio_account
        if account is None:
            return True
        audio = getattr(step.command, "audio", None)
        return not audio or account.budget.allows(account, len(audio))

    def _g_item_text_within_budget(self, step: Step) -> bool:
        # Total too: only a created item or a function output carries text to add.
        account = self._text_account
        if account is None:
            return True
        command = step.command
        if isinstance(command, CreateItem):
            nbytes = command.item.held_bytes
        elif isinstance(command, AddFunctionOutput):
            nbytes = sys.getsizeof(command.output)
        else:
            return True
        return account.budget.allows(account, nbytes)

    def _g_input_items_known(self, step: Step) -> bool:
        return self._unknown_input_item(step) is None

    def _facts_input_items_known(self, step: Step) -> dict[str, object]:
        index, item_id = self._unknown_input_item(step) or (None, None)
        return {"index": index, "item_id": item_id}

    def _unknown_input_item(self, step: Step) -> tuple[int, str] | None:
        """The first item id (with its place) the response's own input names that the
        conversation does not hold, if any."""
        cmd = step.command
        if isinstance(cmd, CreateResponse) and cmd.input:
            for i, entry in enumerate(cmd.input):
                if isinstance(entry, str) and entry not in self._conversation:
                    return i, entry
        return None

    def _g_played_ms_monotonic(self, step: Step) -> bool:
        cmd = step.command
        return not (
            isinstance(cmd, PlaybackAck)
            and self._playback is not None
            and cmd.played_ms < self._playback.played_ms(cmd.response_id)
        )

    def _context_words(self, context: tuple[Item | str, ...]) -> str:
        """The words of a response's own context: its items, or the conversation's items by id
        (the chart's ``input_items_known`` refused unknown ids), in order; an assistant's audio by its transcript.

        Within the conversation's bounds, as the pending turn's words are (``_pend_text``): the
        newest entries that fit ``max_conversation_chars``, never fewer than the newest. A
        reference costs its client a few bytes however long its item is: 64 references to an
        item of 260,000 characters made a 64 MiB string from a 3 KB frame, which the engine
        then split into millions of words, holding every session's turn while it did."""
        budget = self.config.max_conversation_chars
        kept: list[tuple[str, ...]] = []
        chars = 0
        for entry in reversed(context):
            item = self._conversation.get(entry) if isinstance(entry, str) else entry
            if item.type == "function_call_output":
                texts: tuple[str, ...] = (item.output,) if item.output else ()
            else:
                texts = tuple(t for p in item.content if (t := p.text or p.transcript))
            if not texts:
                continue
            chars += _chars(texts) + (1 if kept else 0)
            if kept and budget is not None and chars > budget:
                break
            kept.append(texts)
        return " ".join(text for texts in reversed(kept) for text in texts)

    def _fx_record_function_output(self, step: Step) -> None:
        cmd = cast(AddFunctionOutput, step.command)
        item = Item(id=cmd.item_id or "", type="function_call_output", call_id=cmd.call_id, output=cmd.output)
        self._add_item(item, None)

    def _fx_record_playback(self, step: Step) -> None:
        cmd = cast(PlaybackAck, step.command)
        self._playback_ledger().acknowledge(cmd.response_id, cmd.played_ms)

    def _playback_ledger(self) -> PlaybackLedger:
        ledger = self._playback
        if ledger is None:
            ledger = self._playback = PlaybackLedger()
        return ledger

    def _fx_add_item(self, step: Step) -> None:
        cmd = cast(CreateItem, step.command)
        self._add_item(cmd.item, cmd.previous_item_id, cmd.audio)

    def _add_item(self, item: Item, previous_item_id: str | None, audio: bytes = b"") -> None:
        if not item.id:
            item = attrs.evolve(item, id=self._new_item_id())
        if audio:
            # A user's recorded turn: its audio part says how long it is (audio is not kept in
            # the conversation, as a committed turn's is not).
            ms = int(len(audio) / 2 / self.config.sample_rate * 1000)
            parts = tuple(
                attrs.evolve(p, audio_ms=ms) if p.type == "input_audio" else p for p in item.content
            )
            item = attrs.evolve(item, content=parts)
        if item.type == "function_call" and not item.call_id:
            item = attrs.evolve(item, call_id=f"call_{item.id}")
        previous = self._conversation.add(item, previous_item_id)  # checks before changing
        if item.type == "function_call_output":
            # It answers one of this session's calls (``answers_known_call`` refused any other): the next
            # model turn receives it.
            self._call_registry().answer(item.call_id or "", item.output or "", item.id)
        elif item.type == "function_call":
            # A call the client replays (its own history): its output may answer it, as
            # OpenAI accepts an output for any call in the conversation.
            self._call_registry().remember(item.call_id or "", item.name or "")
        elif item.role != "assistant" and (words := _words_of(item)):
            # Words the next response answers (user text, system/developer notes, the
            # transcript a client gave with its audio).
            self._pend_text(item.id, words)
        if audio:
            self._hear_item_audio(item.id, audio)
        if item.role == "assistant" or item.type == "function_call":
            # The model's own words or call, written by the client (history it replays, e.g.
            # livekit after every reconnect): what comes before them was already answered.
            # Otherwise the next response read the whole replayed history as new input, and
            # got function outputs that had been answered long ago.
            self._forget_pending(self._conversation.ids_before(item.id))
        self._emit(ev.ItemAdded, item=item, previous_item_id=previous)
        self._emit(ev.ItemDone, item=item, previous_item_id=previous)

    def _hear_item_audio(self, item_id: str, audio: bytes) -> None:
        """A created item's audio joins the committed audio the next response hears (within
        max_committed_bytes, the newest kept), and is transcribed as a commit is (in a session
        that makes no responses, only transcribed)."""
        if self.config.responses:
            committed = self._committed
            committed += audio
            if len(committed) > self.config.max_committed_bytes:
                committed.keep_last(self.config.max_committed_bytes - self.config.max_committed_bytes % 2)
        if self.config.transcription is not None:
            self._actions.append(
                TranscribeInput(item_id, audio, self.config.sample_rate, self.config.transcription_language)
            )

    def _pend_text(self, item_id: str, texts: tuple[str, ...]) -> None:
        """Keep an item's ``texts`` for the next response, within the conversation's bounds: a
        client that creates items and never asks for a response held every one of their texts
        here, without limit (100 items of 65,536 four-byte characters: +25 MiB, growing)."""
        pending = self._pending_text
        pending[item_id] = texts
        if len(pending) > 1 and self._conversation.last_id != item_id:
            # Inserted before the end (previous_item_id): the words are read in the
            # conversation's order, as the history is, not in the order they came. The insert
            # itself already cost the conversation a pass over its items.
            ordered = {item.id: pending[item.id] for item in self._conversation if item.id in pending}
            if len(ordered) < len(pending):
                # Words of items the conversation's own bounds let go are still pending: the
                # oldest, so first.
                ordered = {**{k: v for k, v in pending.items() if k not in ordered}, **ordered}
            pending = self._pending_text = ordered
        self._pending_chars += _chars(texts)
        self._withdraw_offered_words()
        budget = self.config.max_conversation_chars
        while len(pending) > 1 and (
            len(pending) > self.config.max_items or (budget is not None and self._pending_chars > budget)
        ):
            self._pending_chars -= _chars(pending.pop(next(iter(pending))))

    def _forget_pending(self, item_ids: Iterable[str]) -> None:
        """The next response no longer reads these items (deleted, or already answered)."""
        pending = self._pending_text
        ids = set(item_ids)
        for item_id in ids & pending.keys():
            self._pending_chars -= _chars(pending.pop(item_id))
            self._withdraw_offered_words()
        if self._calls is not None:
            self._calls.withdraw(ids)

    def _held_item(self, item_id: str, operation: str) -> Item:
        """The conversation's item ``item_id``, or the refusal OpenAI gives ``operation``."""
        if item_id not in self._conversation:
            raise ItemNotFound.during(operation, item_id)
        return self._conversation.get(item_id)

    def _fx_remove_item(self, step: Step) -> None:
        item_id = cast(DeleteItem, step.command).item_id
        self._held_item(item_id, "delete")
        item = self._conversation.delete(item_id)
        # A deleted item is not read either: its words, or its function output, stay unsaid.
        self._forget_pending((item.id,))
        self._emit(ev.ItemDeleted, item_id=item.id)

    def _fx_send_item(self, step: Step) -> None:
        self._emit(
            ev.ItemRetrieved,
            item=self._held_item(cast(RetrieveItem, step.command).item_id, "retrieve"),
        )

    def _fx_cut_item_audio(self, step: Step) -> None:
        cmd = cast(TruncateItem, step.command)
        item = self._held_item(cmd.item_id, "truncate")
        r = self._response
        live = r is not None and item.id == r.item_id
        if r is not None and live:
            # The response still streams (a client truncates as soon as the user speaks, before
            # response.done): its stored item is the in_progress snapshot, so range-check against
            # the audio produced so far.
            item = r.streaming_item()
        if item.role != "assistant":
            raise InvalidItem("item_id", "only assistant messages can be truncated")
        if cmd.content_index >= len(item.content):
            raise InvalidItem("content_index", f"the item has {len(item.content)} content part(s)")
        part = item.content[cmd.content_index]
        if part.type != "output_audio":
            raise InvalidItem("content_index", "only audio content can be truncated")
        if cmd.audio_end_ms > part.audio_ms:
            raise InvalidItem("audio_end_ms", f"is past the end of the item's audio ({part.audio_ms} ms)")
        parts = list(item.content)
        parts[cmd.content_index] = attrs.evolve(part, audio_ms=cmd.audio_end_ms)
        self._conversation.replace(attrs.evolve(item, content=tuple(parts)))
        if r is not None and live:
            r.heard_ms = cmd.audio_end_ms  # kept when the response ends (_close_parts)
        self._playback_ledger().truncated(item.id, cmd.audio_end_ms)
        self._emit(
            ev.ItemTruncated, item_id=item.id, content_index=cmd.content_index, audio_end_ms=cmd.audio_end_ms
        )


def _answered_call(command: Command) -> str | None:
    """The call_id a command answers with a function output, if it does."""
    if isinstance(command, AddFunctionOutput):
        return command.call_id
    if isinstance(command, CreateItem) and command.item.type == "function_call_output":
        return command.item.call_id or ""
    return None


def _words_of(item: Item) -> tuple[str, ...]:
    """What an engine reads of an item: its parts' texts, else the transcripts its audio came
    with; the item's own strings, not a copy (joined when a response is asked for)."""
    return tuple([p.text for p in item.content if p.text]) or tuple(
        [p.transcript for p in item.content if p.type == "input_audio" and p.transcript]
    )


def _chars(texts: tuple[str, ...]) -> int:
    """The characters ``texts`` come to once joined one space apart."""
    return sum(map(len, texts)) + len(texts) - 1 if texts else 0
