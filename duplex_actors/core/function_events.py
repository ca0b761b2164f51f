"""Server events of function calling, named as in the OpenAI Realtime API (GA).

A function call is an output item of its own (``type: "function_call"``) inside a response,
next to the assistant message (output index 0). Its events, in order:
``response.output_item.added`` → ``response.function_call_arguments.delta`` →
``response.function_call_arguments.done`` → ``response.output_item.done``; the item is listed
again in ``response.done``'s ``response.output``. The client runs the function and answers
with a ``function_call_output`` item, acknowledged by ``conversation.item.added`` and
``conversation.item.done``.
"""

from __future__ import annotations

import attrs

from .events import ServerEvent


@attrs.frozen(slots=True)
class CallRecord:
    """One function call of a response, as it appears in its output items."""

    item_id: str
    call_id: str
    name: str
    arguments: str
    output_index: int

    def item(self, status: str) -> dict:
        return {"id": self.item_id, "object": "realtime.item", "type": "function_call",
                "status": status, "call_id": self.call_id, "name": self.name,
                "arguments": self.arguments if status == "completed" else ""}


@attrs.frozen(slots=True, kw_only=True)
class _CallEvent(ServerEvent):
    response_id: str
    call: CallRecord

    def _ids(self) -> dict:
        return {"response_id": self.response_id, "item_id": self.call.item_id,
                "output_index": self.call.output_index, "call_id": self.call.call_id}


@attrs.frozen(slots=True, kw_only=True)
class FunctionCallItemAdded(_CallEvent):
    TYPE = "response.output_item.added"

    def body(self):
        return {"response_id": self.response_id, "output_index": self.call.output_index,
                "item": self.call.item("in_progress")}


@attrs.frozen(slots=True, kw_only=True)
class FunctionArgumentsDelta(_CallEvent):
    TYPE = "response.function_call_arguments.delta"
    delta: str

    def body(self):
        return {**self._ids(), "delta": self.delta}


@attrs.frozen(slots=True, kw_only=True)
class FunctionArgumentsDone(_CallEvent):
    TYPE = "response.function_call_arguments.done"

    def body(self):
        return {**self._ids(), "name": self.call.name, "arguments": self.call.arguments}


@attrs.frozen(slots=True, kw_only=True)
class FunctionCallItemDone(_CallEvent):
    TYPE = "response.output_item.done"

    def body(self):
        return {"response_id": self.response_id, "output_index": self.call.output_index,
                "item": self.call.item("completed")}


@attrs.frozen(slots=True, kw_only=True)
class FunctionOutputItem(ServerEvent):
    """``conversation.item.added`` / ``.done`` for a client's ``function_call_output`` item."""

    TYPE = "conversation.item.added"
    item_id: str
    call_id: str
    output: str
    previous_item_id: str | None = None

    def body(self):
        return {"previous_item_id": self.previous_item_id,
                "item": {"id": self.item_id, "object": "realtime.item",
                         "type": "function_call_output", "status": "completed",
                         "call_id": self.call_id, "output": self.output}}


@attrs.frozen(slots=True, kw_only=True)
class FunctionOutputItemDone(FunctionOutputItem):
    TYPE = "conversation.item.done"
