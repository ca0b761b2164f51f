"""Server events of function calling, named as in the OpenAI Realtime API (GA).

A function call is an output item of its own (``type: "function_call"``) inside a response,
next to the assistant message (output index 0). Its events, in order:
``response.output_item.added`` → ``conversation.item.added`` (a call is a conversation item,
GA) → ``response.function_call_arguments.delta`` → ``response.function_call_arguments.done`` →
``response.output_item.done`` → ``conversation.item.done``; the item is listed
again in ``response.done``'s ``response.output``. The client runs the function and answers
with a ``function_call_output`` item, acknowledged by ``conversation.item.added`` and
``conversation.item.done`` like any item. These are typed values; server/codec.py gives them
their wire shape.
"""

from __future__ import annotations

import attrs

from .conversation import Item
from .events import ServerEvent


@attrs.frozen(slots=True)
class CallRecord:
    """One function call of a response, as it appears in its output items."""

    item_id: str
    call_id: str
    name: str
    arguments: str
    output_index: int

    def to_item(self, status: str = "completed") -> Item:
        # Arguments are only whole once the call is done (GA streams them in between).
        return Item(
            id=self.item_id,
            type="function_call",
            status=status,
            call_id=self.call_id,
            name=self.name,
            arguments=self.arguments if status == "completed" else "",
        )


@attrs.frozen(slots=True, kw_only=True)
class _CallEvent(ServerEvent):
    response_id: str
    call: CallRecord


@attrs.frozen(slots=True, kw_only=True)
class FunctionCallItemAdded(_CallEvent):
    TYPE = "response.output_item.added"


@attrs.frozen(slots=True, kw_only=True)
class FunctionArgumentsDelta(_CallEvent):
    TYPE = "response.function_call_arguments.delta"
    delta: str


@attrs.frozen(slots=True, kw_only=True)
class FunctionArgumentsDone(_CallEvent):
    TYPE = "response.function_call_arguments.done"


@attrs.frozen(slots=True, kw_only=True)
class FunctionCallItemDone(_CallEvent):
    TYPE = "response.output_item.done"
