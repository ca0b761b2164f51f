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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import attrs

from ..errors import InvalidItem, ItemNotFound

#: Message roles a client may create with conversation.item.create (assistant: history a client
#: replays, e.g. after reconnecting; it is kept but never read as new input).
CREATABLE_ROLES = ("user", "system", "developer", "assistant")


@attrs.frozen(slots=True, kw_only=True)
class ContentPart:
    #: input_text | input_audio | output_text | output_audio | text
    type: str
    text: str | None = None
    transcript: str | None = None
    #: How much audio the part holds (input_audio, output_audio); 0 for text parts.
    audio_ms: int = 0


@attrs.frozen(slots=True, kw_only=True)
class Item:
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

    @property
    def text(self) -> str:
        """The words of a user or system item, as an engine should read them."""
        if self.type == "function_call_output":
            return self.output or ""
        return " ".join(p.text for p in self.content if p.text)


class Conversation:
    """Items in order, at most ``capacity`` of them (oldest forgotten first)."""

    __slots__ = ("_items", "capacity")

    def __init__(self, capacity: int = 256) -> None:
        self._items: OrderedDict[str, Item] = OrderedDict()
        self.capacity = capacity

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
        if item.id in self._items:
            raise InvalidItem("item.id", f"an item {item.id!r} already exists")
        self.check_position(previous_item_id)
        if previous_item_id is None or previous_item_id == self.last_id:
            before = self.last_id
            self._items[item.id] = item
        else:
            order = list(self._items.items())
            at = 0 if previous_item_id == "root" else [k for k, _ in order].index(previous_item_id) + 1
            order.insert(at, (item.id, item))
            self._items = OrderedDict(order)
            before = None if at == 0 else order[at - 1][0]
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return before

    def replace(self, item: Item) -> None:
        if item.id in self._items:
            self._items[item.id] = item

    def delete(self, item_id: str) -> Item:
        self.get(item_id)
        return self._items.pop(item_id)

    def previous_of(self, item_id: str) -> str | None:
        # From the end: the item asked about is nearly always the newest (a response's message
        # when it completes), and a scan from the front walked the whole conversation (up to
        # ``capacity`` items) on every response.done.
        keys = reversed(self._items)
        for key in keys:
            if key == item_id:
                return next(keys, None)
        return None

    def clear(self) -> None:
        self._items.clear()
