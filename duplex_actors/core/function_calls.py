"""FunctionCallRegistry: which function calls a session may still be answered for.

A ``function_call_output`` (the client's ``conversation.item.create``, or the embedder's
``AddFunctionOutput``) answers a call this session knows: one its model made, or one the
client replayed into the conversation as its own history. The answers wait here until the
next model turn takes them. The registry does not check commands itself:
:class:`~duplex_actors.core.session.SessionCore` refuses an unknown ``call_id`` before any
effect runs, so a refused output changes nothing.
"""

from __future__ import annotations

from .engine_io import FunctionResult

#: Only recent calls get answered: a session that calls tools forever keeps a bounded registry.
RECENT_CALLS = 64


class FunctionCallRegistry:
    """Recent calls (call_id -> function name) and the outputs received since the last turn.

    ``max_chars`` bounds the waiting outputs' text together, as the conversation's character
    budget bounds its items (None: only RECENT_CALLS bounds them)."""

    __slots__ = ("_names", "_results", "_items", "_chars", "max_chars")

    def __init__(self, max_chars: int | None = None) -> None:
        self._names: dict[str, str] = {}
        self._results: list[FunctionResult] = []
        self._items: dict[str, str] = {}  # waiting output's call_id -> the item that carried it
        self._chars = 0  # the waiting outputs' length in all
        self.max_chars = max_chars

    def __contains__(self, call_id: str) -> bool:
        return call_id in self._names

    def remember(self, call_id: str, name: str) -> None:
        """A call a function_call_output may now answer (the name goes to the engine with it)."""
        names = self._names
        names[call_id] = name
        if len(names) > RECENT_CALLS:
            names.pop(next(iter(names)))

    def answer(self, call_id: str, output: str, item_id: str = "") -> None:
        """The client's output for ``call_id``: the next model turn receives it. A later output
        for the same call replaces the earlier one, and at most RECENT_CALLS outputs wait (the
        oldest go first): a client answering over and over without asking for a response held
        every output here, without limit. Past ``max_chars`` the oldest go too, never the newest:
        64 outputs at the item limit (65,536 characters) were 4.2 M characters a session, 16.8 MB
        as emoji, outside the conversation's budget."""
        results = self._results
        results[:] = [r for r in results if r.call_id != call_id]
        results.append(FunctionResult(call_id, output, self._names.get(call_id)))
        self._items[call_id] = item_id
        self._chars = sum(len(r.output) for r in results)
        budget = self.max_chars
        while len(results) > 1 and (
            len(results) > RECENT_CALLS or (budget is not None and self._chars > budget)
        ):
            dropped = results.pop(0)
            self._chars -= len(dropped.output)
            self._items.pop(dropped.call_id, None)

    def withdraw(self, item_ids: set[str]) -> None:
        """Outputs carried by these items no longer wait: the items were deleted, or the model
        already answered them. An output that replaced one of them for the same call stays."""
        if not self._results or not item_ids:
            return
        items = self._items
        kept = []
        for r in self._results:
            if items.get(r.call_id) in item_ids:
                del items[r.call_id]
            else:
                kept.append(r)
        self._results = kept
        self._chars = sum(len(r.output) for r in kept)

    def take_results(self) -> tuple[FunctionResult, ...]:
        """The outputs received since the last call, oldest first; the registry forgets them."""
        results = tuple(self._results)
        self._results.clear()
        self._items.clear()
        self._chars = 0
        return results
