"""The session's conversation: the ordered items a Realtime client can create, read and edit.

Theory of operation
-------------------
OpenAI's Realtime API keeps a conversation per session: user audio becomes an item when it is
committed, ``conversation.item.create`` adds user text, system or developer messages and
function call outputs, every response adds an assistant item, and clients may retrieve,
delete or truncate items. This module holds those items as frozen values in insertion order,
bounded (the oldest are forgotten first), and knows nothing about the wire, the chart or the
engine. :class:`~duplex_actors.core.session.SessionCore` decides *when* each edit happens
(the statechart's item rows); the server's codec decides how an item looks as JSON.

Audio is not kept: a user audio item records how long it was, an assistant item how much
audio it produced, so truncation can be range-checked without holding megabytes per session.

Text is kept, within two bounds: ``capacity`` items and ``max_chars`` characters over all of
them (oldest items forgotten first, never the one just added). The item bound alone let one
session keep 256 items of 65,536 characters each: 16 MiB of plain text, 64 MiB when every
character needs four bytes (an emoji in each string). Engines read a context window far
smaller than either, as OpenAI's do.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import attrs

from ..errors import InvalidItem, ItemNotFound

if TYPE_CHECKING:
    from .client_budget import ClientAccount

#: Message roles a client may create with conversation.item.create (assistant: history a client
#: replays, e.g. after reconnecting; it is kept but never read as new input).
CREATABLE_ROLES = ("user", "system", "developer", "assistant")


@attrs.frozen(slots=True, kw_only=True)
class ContentPart:
    """One part of a conversation item: text, a transcript, or how much audio it holds."""

    #: input_text | input_audio | input_image (its image not kept) | output_text | output_audio | text
    type: str
    text: str | None = None
    transcript: str | None = None
    #: How much audio the part holds (input_audio, output_audio); 0 for text parts.
    audio_ms: int = 0


#: What a content part takes besides its text: the part itself and its place in its item.
PART_BYTES = sys.getsizeof(ContentPart(type="input_text")) + 8


@attrs.frozen(slots=True, kw_only=True)
class Item:
    """A conversation item as the Realtime API knows it: a message (user, assistant, system,
    developer), a function call or a function call's output.
    """

    id: str
    #: message | function_call | function_call_output
    type: str = "message"
    #: user | assistant | system | developer (messages only)
    role: str | None = None
    #: completed | incomplete | in_progress
    status: str = "completed"
    content: tuple[ContentPart, ...] = ()
    #: function_call and function_call_output
    call_id: str | None = None
    #: function_call_output only
    output: str | None = None
    #: function_call only: the function and its JSON arguments
    name: str | None = None
    arguments: str | None = None

    def strings(self) -> list[str]:
        """Every string of text the item holds (what its memory grows with).

        A list built in one go, not a generator: the journal and the conversation's budget
        ask this of every item event a response sends, and a generator costs a resumption
        per string."""
        texts = []
        for part in self.content:
            if part.text:
                texts.append(part.text)
            if part.transcript:
                texts.append(part.transcript)
        for text in (self.output, self.arguments, self.name):
            if text:
                texts.append(text)
        return texts

    @property
    def chars(self) -> int:
        """The characters this item holds in text: what the conversation's budget counts."""
        return sum(map(len, self.strings()))

    @property
    def held_bytes(self) -> int:
        """The memory this item's text takes (what the runtime's text budget counts): CPython
        stores a string in 1, 2 or 4 bytes a character, by its widest; and each content part
        (the part and its place in the item), which holds no text when it marks an image or
        is empty: items of thousands of such parts held ~0.7 MiB each, counted nowhere."""
        return sum(map(sys.getsizeof, self.strings())) + len(self.content) * PART_BYTES

    @property
    def text(self) -> str:
        """The words of a user or system item, as an engine should read them."""
        if self.type == "function_call_output":
            return self.output or ""
        return " ".join(p.text for p in self.content if p.text)


class Conversation:
    """Items in order, at most ``capacity`` of them and ``max_chars`` characters of text in all
    (oldest forgotten first, never the item just added or replaced). Given a client's account
    in the runtime's text budget (core/text_budget.py), every change of the bytes its text
    takes is reported there."""

    __slots__ = ("_items", "capacity", "max_chars", "_chars", "_bytes", "account", "forgotten")

    def __init__(
        self, capacity: int = 256, max_chars: int | None = None, account: ClientAccount | None = None
    ) -> None:
        # A plain dict: ordered by insertion, which is all the order kept here (an insertion
        # before the end rebuilds it), and cheaper to add to than an OrderedDict.
        self._items: dict[str, Item] = {}
        self.capacity = capacity
        self.max_chars = max_chars
        self._chars = 0  # sum of every held item's ``chars``
        self._bytes = 0  # sum of every held item's ``held_bytes``
        self.account = account
        self.forgotten = 0  # items dropped to keep within the bounds

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def _charge(self, nbytes: int) -> None:
        self._bytes += nbytes
        if self.account is not None:
            self.account.add(nbytes)

    def detach(self) -> None:
        """Give the text's bytes back to the account and stop reporting (the session closed)."""
        if self.account is not None:
            self.account.add(-self._bytes)
            self.account = None

    @property
    def chars(self) -> int:
        return self._chars

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Item]:
        return iter(self._items.values())

    def __contains__(self, item_id: str) -> bool:
        return item_id in self._items

    @property
    def last_id(self) -> str | None:
        return next(reversed(self._items), None)

    def get(self, item_id: str) -> Item:
        item = self._items.get(item_id)
        if item is None:
            raise ItemNotFound(f"no item {item_id!r} in this conversation")
        return item

    def check_position(self, previous_item_id: str | None) -> None:
        """Raise unless ``previous_item_id`` is None, ``"root"`` or a held item."""
        if previous_item_id not in (None, "root") and previous_item_id not in self._items:
            raise InvalidItem("previous_item_id", f"no item {previous_item_id!r} in this conversation")

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Insert ``item`` after ``previous_item_id`` (None: at the end, "root": first).

        Returns the id of the item now before it (None at the start)."""
        items = self._items
        if item.id in items:
            raise InvalidItem("item.id", f"an item {item.id!r} already exists")
        if previous_item_id is not None:
            self.check_position(previous_item_id)
        last = next(reversed(items), None)  # last_id, read once
        if previous_item_id is None or previous_item_id == last:
            before = last
            items[item.id] = item
        else:
            order = list(items.items())
            at = 0 if previous_item_id == "root" else [k for k, _ in order].index(previous_item_id) + 1
            order.insert(at, (item.id, item))
            self._items = dict(order)
            before = None if at == 0 else order[at - 1][0]
        self._chars += item.chars
        self._charge(item.held_bytes)
        self._keep_within_bounds(item.id)
        return before

    def replace(self, item: Item) -> None:
        old = self._items.get(item.id)
        if old is not None:
            self._items[item.id] = item
            self._chars += item.chars - old.chars
            self._charge(item.held_bytes - old.held_bytes)
            self._keep_within_bounds(item.id)

    def delete(self, item_id: str) -> Item:
        self.get(item_id)
        item = self._items.pop(item_id)
        self._chars -= item.chars
        self._charge(-item.held_bytes)
        return item

    def _keep_within_bounds(self, keep: str) -> None:
        """Forget the oldest items, but never ``keep``, until both bounds hold (or only ``keep``
        is left: one item over the character budget alone stays, since it was accepted)."""
        items = self._items
        max_chars = self.max_chars
        while len(items) > self.capacity or (max_chars is not None and self._chars > max_chars):
            oldest = next(iter(items))
            if oldest == keep:
                if len(items) == 1:
                    return
                # The item kept was inserted first ("root"): forget the oldest after it.
                oldest = next(k for k in items if k != keep)
            forgotten = items.pop(oldest)
            self._chars -= forgotten.chars
            self._charge(-forgotten.held_bytes)
            self.forgotten += 1

    def previous_of(self, item_id: str) -> str | None:
        # From the end: the item asked about is nearly always the newest (a response's message
        # when it completes), and a scan from the front walked the whole conversation (up to
        # ``capacity`` items) on every response.done.
        keys = reversed(self._items)
        for key in keys:
            if key == item_id:
                return next(keys, None)
        return None

    def ids_before(self, item_id: str) -> list[str]:
        """The ids of the items before ``item_id``, oldest first (all of them if it is not held)."""
        ids = []
        for key in self._items:
            if key == item_id:
                break
            ids.append(key)
        return ids

    def clear(self) -> None:
        self._items.clear()
        self._chars = 0
        self._charge(-self._bytes)
