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
    """Recent calls (call_id -> function name) and the outputs received since the last turn."""

    __slots__ = ("_names", "_results")

    def __init__(self) -> None:
        self._names: dict[str, str] = {}
        self._results: list[FunctionResult] = []

    def __contains__(self, call_id: str) -> bool:
        return call_id in self._names

    def remember(self, call_id: str, name: str) -> None:
        """A call a function_call_output may now answer (the name goes to the engine with it)."""
        names = self._names
        names[call_id] = name
        if len(names) > RECENT_CALLS:
            names.pop(next(iter(names)))

    def answer(self, call_id: str, output: str) -> None:
        """The client's output for ``call_id``: the next model turn receives it. A later output
        for the same call replaces the earlier one, and at most RECENT_CALLS outputs wait (the
        oldest go first): a client answering over and over without asking for a response held
        every output here, without limit."""
        results = self._results
        results[:] = [r for r in results if r.call_id != call_id]
        results.append(FunctionResult(call_id, output, self._names.get(call_id)))
        if len(results) > RECENT_CALLS:
            del results[0]

    def take_results(self) -> tuple[FunctionResult, ...]:
        """The outputs received since the last call, oldest first; the registry forgets them."""
        results = tuple(self._results)
        self._results.clear()
        return results
