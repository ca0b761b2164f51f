"""A bounded replay journal of delivered server events, by ``server_event_seq``.

After a reconnect the client names the last seq it received; the journal hands back every later
event in order, exactly once. It keeps at most ``max_events`` / ``max_bytes`` / ``max_age_s``;
when what the client needs has been evicted, it says so (``ResyncRequired``) rather than
replaying a stream with a hole in it.

Memory: the journal holds what the session delivered in the last ``max_age_s`` (and never more
than ``max_events``), so across a runtime it grows with the event *rate*, not with time: about
sessions x min(events per second x max_age_s, max_events) entries of a few hundred bytes each
(plus audio that is not shared; docs/reliability.md section 5 has the measured size).
Eviction runs when something is recorded or replayed, and on :meth:`expire`, which the runtime's
reaper calls, so a session that has gone quiet lets go of its last events once they are older
than ``max_age_s`` instead of keeping them for as long as it stays open.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ResyncRequired
from . import events as ev
from .conversation import Item
from .events import ServerEvent


def _str_bytes(text: str | None) -> int:
    """What a string costs to hold, at most: CPython stores 1, 2 or 4 bytes a character, and
    ``isascii`` is a flag it already keeps (no scan), so only non-ASCII text is over-counted."""
    if not text:
        return 0
    return len(text) if text.isascii() else 4 * len(text)


def _item_bytes(item: Item) -> int:
    return sum(map(_str_bytes, item.strings()))


def _config_bytes(event: ev.SessionCreated | ev.SessionUpdated) -> int:
    # Instructions and tool schemas, up to a frame's worth each time: rare events, so the
    # serialisation is affordable, and it counts what nested dicts hold without a walker.
    return _str_bytes(json.dumps(event.config, ensure_ascii=False, default=str))


def _metadata_bytes(metadata: Mapping[str, object] | None) -> int:
    # A response's metadata (16 pairs of up to 64 + 512 characters) rides on its created and
    # done events: uncounted, sessions creating and cancelling responses with long metadata
    # held several times what the journal counted.
    if not metadata:
        return 0
    return sum(_str_bytes(k) + _str_bytes(v) for k, v in metadata.items() if isinstance(v, str))


#: The payload each event class holds beyond its fixed fields. Only pcm used to be counted, so
#: a client that filled its conversation with long texts (or repeated a session.update carrying
#: large tool schemas) had them journaled at 128 bytes an event, far under what they held.
_PAYLOAD: dict[type[ServerEvent], Callable[[Any], int]] = {
    ev.AudioDeltaEvent: lambda e: len(e.pcm),
    ev.ItemAdded: lambda e: _item_bytes(e.item),
    ev.ItemDone: lambda e: _item_bytes(e.item),
    ev.ItemRetrieved: lambda e: _item_bytes(e.item),
    ev.OutputItemAdded: lambda e: _item_bytes(e.item),
    ev.OutputItemDone: lambda e: _item_bytes(e.item),
    ev.ResponseCreated: lambda e: _metadata_bytes(e.metadata),
    ev.ResponseDone: lambda e: sum(map(_item_bytes, e.output)) + _metadata_bytes(e.metadata),
    ev.TextDone: lambda e: _str_bytes(e.text),
    ev.TranscriptDone: lambda e: _str_bytes(e.transcript),
    ev.ContentPartDone: lambda e: _str_bytes(e.text),
    ev.SessionCreated: _config_bytes,
    ev.SessionUpdated: _config_bytes,
    ev.ErrorEvent: lambda e: _str_bytes(e.message) + _str_bytes(e.client_event_id) + _str_bytes(e.param),
}


def event_size(event: ServerEvent) -> int:
    """Bytes the journal charges for ``event``: 128 for the event itself (less than it holds
    with its fields, most of which are shared or interned), plus the payload it holds."""
    payload = _PAYLOAD.get(type(event))
    return 128 if payload is None else 128 + payload(event)


class JournalBudget:
    """What all the replay journals of a runtime may hold together, in the bytes they count.

    Each journal has its own bound (``max_bytes``, 8 MiB by default), which a client multiplies
    by opening sessions: one client's many sessions, each journaling long items, held far more
    than any single bound (``flood_bench --journals``). With a budget, a
    journal that records while the total is over it and while it holds more than its fair share
    (``max_bytes / journals``) evicts its own oldest events until one of the two is no longer
    true. The sessions that journal the most lose the oldest part of their replay (a resume
    that reaches into it gets ``ResyncRequired``, as after the age limit); the others keep
    theirs. Journals also give back on :meth:`ReplayJournal.expire`, which the runtime's reaper
    calls on every session each pass (0.5 s): after a pass the total is within ``max_bytes``
    (each journal is within its share, or the total already was), and between passes it stays
    under about twice that whatever the number of sessions.
    """

    __slots__ = ("max_bytes", "total", "journals", "trimmed")

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("need max_bytes > 0")
        self.max_bytes = max_bytes
        self.total = 0  # bytes the member journals count
        self.journals = 0  # member journals (each session's, until it closes)
        self.trimmed = 0  # events evicted because of the budget

    def over_share(self, held: int) -> bool:
        """Whether a journal holding ``held`` bytes gives some back now."""
        return self.total > self.max_bytes and held * self.journals > self.max_bytes


class ReplayJournal:
    __slots__ = ("max_events", "max_bytes", "max_age_s", "_items", "_bytes", "_evicted_through", "_budget")

    def __init__(
        self,
        max_events: int = 4096,
        max_bytes: int = 8 << 20,
        max_age_s: float = 60.0,
        budget: JournalBudget | None = None,
    ):
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._items: deque[tuple[float, int, ServerEvent]] | None = None  # allocated on first use
        self._bytes = 0
        self._evicted_through = 0  # highest seq no longer held
        self._budget = budget
        if budget is not None:
            budget.journals += 1

    def record(self, event: ServerEvent, now: float) -> None:
        if self._items is None:
            self._items = deque()
        size = event_size(event)
        self._items.append((now, size, event))
        self._bytes += size
        if self._budget is not None:
            self._budget.total += size
        self._evict(now)

    def record_all(self, events: list[ServerEvent], now: float) -> None:
        """:meth:`record` each of ``events`` (one take's), evicting once at the end: the bounds
        only ever drop the oldest entries, so the journal ends as it would record by record."""
        items = self._items
        if items is None:
            items = self._items = deque()
        sizes = _PAYLOAD
        total = 0
        for event in events:
            payload = sizes.get(type(event))
            size = 128 if payload is None else 128 + payload(event)
            items.append((now, size, event))
            total += size
        self._bytes += total
        if self._budget is not None:
            self._budget.total += total
        self._evict(now)

    def release(self) -> None:
        """Leave the budget (the session has closed): what this journal holds stops counting
        against it, and so does the journal. Recording afterwards is not charged."""
        budget, self._budget = self._budget, None
        if budget is not None:
            budget.total -= self._bytes
            budget.journals -= 1

    def _evict(self, now: float, *, share: bool = True) -> None:
        """Evict what is over a bound; ``share=False`` leaves the budget's share alone (a
        resume's replay: the chart asked :meth:`holds_after` first, which does not foresee it)."""
        items = self._items
        budget = self._budget
        while items:
            over_budget = share and budget is not None and budget.over_share(self._bytes)
            if not (
                over_budget
                or len(items) > self.max_events
                or self._bytes > self.max_bytes
                or now - items[0][0] > self.max_age_s
            ):
                break
            _, size, ev = items.popleft()
            self._bytes -= size
            if budget is not None:
                budget.total -= size
                budget.trimmed += over_budget
            self._evicted_through = ev.seq

    def expire(self, now: float) -> int:
        """Drop what is older than ``max_age_s`` without recording anything; returns how many.

        An emptied journal also gives back its deque (an idle session keeps none)."""
        items = self._items
        if not items:
            return 0
        before = len(items)
        self._evict(now)
        if not items:
            self._items = None
        return before - len(items)

    def holds_after(self, last_seq: int, now: float) -> bool:
        """Whether :meth:`since` would find every event after ``last_seq`` at ``now``.

        A pure question (nothing is evicted): the chart asks it before a resume is accepted."""
        floor = self._evicted_through
        if self._items is not None:
            # What since() would age out first: the oldest entries past max_age_s (entries are
            # in time order, so they are a prefix).
            for recorded, _, event in self._items:
                if now - recorded <= self.max_age_s:
                    break
                floor = event.seq
        return last_seq >= floor

    def since(self, last_seq: int, now: float) -> list[ServerEvent]:
        """Every held event with seq > last_seq, or ResyncRequired if some were evicted."""
        if self._items is not None:
            self._evict(now, share=False)
        if last_seq < self._evicted_through:
            raise ResyncRequired(
                f"events after seq {last_seq} are gone (journal holds seq > {self._evicted_through})"
            )
        if not self._items:
            return []
        return [ev for _, _, ev in self._items if ev.seq > last_seq]

    def __len__(self) -> int:
        return 0 if self._items is None else len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes
