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
conversation.py), its settings' text (instructions and tools), and, while a response runs, the
text it holds of its own (:func:`response_text_bytes`): the words of its context, which its
engine request carries as one string, and the instructions and tools its ``response.create``
set for it. Those were held uncounted: 256 sessions, each asking for one out-of-band response
whose own instructions and input filled a frame, held ~1 GB while their responses waited for
the engine (docs/reliability.md). A ``response.create`` is refused by the same rule. A
response the server starts itself (a commit, server VAD) is counted and never refused. The
replay journal's copy of the same events has a budget of its own (journal.py).
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


def response_text_bytes(words: str, instructions: str | None, tools: Iterable[FunctionTool] | None) -> int:
    """The bytes of the text a response holds of its own while it runs: ``words``, the text of
    its context as its engine request carries it, and the ``instructions`` and ``tools`` its
    ``response.create`` set for it (None: the session's, counted with its settings). The words
    count even when they are the very string of a single item the conversation holds: counted
    twice then, which a budget may do (it overestimates, never underestimates)."""
    held = sys.getsizeof(words) if words else 0
    return held + settings_text_bytes(instructions, tools or ())


__all__ = ["TextAccount", "TextBudget", "response_text_bytes", "settings_text_bytes", "text_bytes"]
