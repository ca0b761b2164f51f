"""What all sessions' text may hold together, shared by client: conversations and settings.

Each session bounds its own text: its conversation keeps ``max_conversation_chars`` (262,144
characters, 1 MiB when each needs four bytes), its ``instructions`` are at most 65,536
characters and its 128 tools as much as a frame holds (1 MiB). A client multiplies that by
opening sessions (an address may hold 256), many clients multiply it again, and
permessage-deflate makes it cheap to send: a message may inflate to 2 MiB however small it was
on the wire (server/inflate.py keeps that floor so that honest chunks of digital silence, which
compress hundreds of times, are not refused), so an item of 65,536 emoji costs a few hundred bytes
on the wire. The figures are in docs/reliability.md.

With a budget (a :class:`~.client_budget.ClientBudget` counting the bytes Python holds the
strings in), a created item (or function output) and a ``session.update`` that would add text
are refused with ``resource_exhausted`` while the text held in all is over the budget *and* the
client holds more than its share of it. A client within its share is never refused. What the
server itself adds (a response's items, a transcript) is counted and never refused: a session
bounds it. Nothing already accepted is dropped; a refused client deletes items, closes
sessions or sends less.

What counts, per session: the text of every item its conversation holds (``Item.held_bytes``,
conversation.py), and its settings' text (instructions and tools). The replay journal's copy of the same events has a budget of its
own (journal.py).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from .client_budget import ClientAccount, ClientBudget
from .engine_io import FunctionTool

#: The text budget is a :class:`ClientBudget` counting the bytes of the strings held.
TextBudget = ClientBudget
TextAccount = ClientAccount


def text_bytes(strings: Iterable[str]) -> int:
    """The memory ``strings`` take: CPython stores a string in 1, 2 or 4 bytes a character (by
    its widest), so an emoji costs four times an ASCII letter on the server, whatever it took on
    the wire."""
    return sum(map(sys.getsizeof, strings))


def settings_text_bytes(instructions: str | None, tools: Iterable[FunctionTool]) -> int:
    """The bytes of a session's settings' text: its instructions and its tools."""
    held = sys.getsizeof(instructions) if instructions else 0
    for tool in tools:
        held += text_bytes((tool.name, tool.description, tool.parameters))
    return held


__all__ = ["TextAccount", "TextBudget", "settings_text_bytes", "text_bytes"]
