"""ResponseAssembly: the one response in progress, and the item it becomes.

A response collects what the engine streams for it (text, the audio's transcript, audio
duration, function calls) between ``response.created`` and ``response.done``. This module
knows how those pieces make up the assistant message and the response's output items; it
does not know when a response begins or ends, which events announce it, or the conversation
it is stored in: :class:`~duplex_actors.core.session.SessionCore` decides all of that (the
statechart names the effects).

Its fields are plain attributes, appended to in place by the core while a response streams:
a delta must not cost an allocation beyond the words it carries.
"""

from __future__ import annotations

import math

import attrs

from .conversation import ContentPart, Item
from .engine_io import InputUsage
from .function_events import CallRecord
from .unit_holds import SharedWords


class ResponseAssembly:
    """The one response in progress (created, not yet done)."""

    __slots__ = (
        "response_id",
        "item_id",
        "epoch",
        "turn_id",
        "text",
        "transcript",
        "audio",
        "modalities",
        "metadata",
        "max_output_tokens",
        "audio_ms",
        "output_tokens",
        "input_usage",
        "calls",
        "message_index",
        "heard_ms",
        "in_conversation",
        "held_text",
        "held_audio",
        "held_words",
    )

    def __init__(
        self,
        response_id: str,
        item_id: str,
        epoch: int,
        turn_id: int,
        modalities: tuple[str, ...],
        metadata: dict[str, str] | None,
        in_conversation: bool = True,
    ) -> None:
        self.response_id = response_id
        #: False for an out-of-band response (GA response.conversation "none"): its items are
        #: the client's, never written into the session's conversation.
        self.in_conversation = in_conversation
        #: The bytes of text the response holds of its own while it runs, counted in the
        #: runtime's text budget until it is done (text_budget.response_text_bytes).
        self.held_text = 0
        #: The bytes of the user's audio its engine request carries (the committed turn it
        #: took), counted in the runtime's audio budget until it is done.
        self.held_audio = 0
        #: A promoted unit's words (unit_holds.SharedWords), carried until it is done.
        self.held_words: SharedWords | None = None
        #: The assistant message's id (output item 0); function calls get their own.
        self.item_id = item_id
        #: The fence it was created under: its closing events carry this epoch, even when the
        #: cancel that ends it has already moved the session's.
        self.epoch = epoch
        self.turn_id = turn_id
        self.text: list[str] = []
        self.transcript: list[str] = []
        #: Whether any audio was delivered (a text+audio response may end without any).
        self.audio = False
        self.calls: list[CallRecord] | None = None  # None until the first call: most have none
        #: The assistant message's output index, once its first words or audio opened it
        #: (None: not opened; a response that only calls functions never opens it).
        self.message_index: int | None = None
        self.modalities = modalities
        self.max_output_tokens: int | None = None  # the token limit it runs under (None: none)
        self.metadata = metadata
        self.audio_ms = 0.0
        self.output_tokens = 0
        #: What the engine says the model read for it (its TurnDone's), None until then.
        self.input_usage: InputUsage | None = None
        #: Set by a truncation while the response still streams: what the user heard of it.
        self.heard_ms: int | None = None

    @property
    def spoken(self) -> bool:
        """OpenAI's audio response: the words travel as the audio's transcript only."""
        return "audio" in self.modalities and "text" not in self.modalities

    @property
    def part_type(self) -> str:
        return "audio" if "audio" in self.modalities else "text"

    def item(self, status: str) -> Item:
        """The assistant message as it stands, with ``status``."""
        words = "".join(self.transcript if self.spoken or "text" not in self.modalities else self.text)
        if self.part_type == "audio":
            heard = int(self.audio_ms) if self.heard_ms is None else self.heard_ms
            part = ContentPart(type="output_audio", transcript=words, audio_ms=heard)
        else:
            part = ContentPart(type="output_text", text=words)
        return Item(id=self.item_id, type="message", role="assistant", status=status, content=(part,))

    def streaming_item(self) -> Item:
        """The message while it still streams, as a truncation must range-check it.

        Its audio length is rounded up: the client counts the ms it received in its own output
        format, which resampling may round the other way."""
        item = self.item("in_progress")
        return attrs.evolve(item, content=(attrs.evolve(item.content[0], audio_ms=math.ceil(self.audio_ms)),))

    @property
    def item_count(self) -> int:
        """Output items so far: the calls, and the message once opened."""
        return len(self.calls or ()) + (self.message_index is not None)

    def open_message(self) -> None:
        """The assistant message becomes the next output item."""
        self.message_index = self.item_count

    def add_call(self, item_id: str, call_id: str, name: str, arguments: str) -> CallRecord:
        """Record a function call as the response's next output item (``item_id`` is its own)."""
        call = CallRecord(
            item_id=item_id, call_id=call_id, name=name, arguments=arguments, output_index=self.item_count
        )
        if self.calls is None:
            self.calls = []
        self.calls.append(call)
        return call

    def output_items(self, message: Item | None) -> tuple[Item, ...]:
        """``response.done``'s output, in the order the items were added: every call,
        completed, and the final ``message`` at its index (None: it was never opened)."""
        items = [c.to_item() for c in self.calls or ()]
        if message is not None and self.message_index is not None:
            items.insert(self.message_index, message)
        return tuple(items)
