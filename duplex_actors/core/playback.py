"""PlaybackLedger: how much of each response's audio the user really heard.

Two things tell it: the client's playback acknowledgements (``PlaybackAck``: ``played_ms`` of a
response so far) and truncations (``conversation.item.truncate``: the assistant item's audio
cut at ``audio_end_ms``). An acknowledgement may not go backwards;
:class:`~duplex_actors.core.session.SessionCore` checks that before any effect runs, so a
refused one changes nothing.
"""

from __future__ import annotations

#: Only recent responses matter for truncation: older acknowledgements are forgotten.
RECENT_RESPONSES = 64


class PlaybackLedger:
    """Heard audio in ms, by response id (acknowledgements) and by item id (truncations)."""

    __slots__ = ("_heard_ms",)

    def __init__(self) -> None:
        self._heard_ms: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._heard_ms)

    def played_ms(self, response_id: str) -> int:
        """The most the client has acknowledged for ``response_id`` (0 if nothing yet)."""
        return self._heard_ms.get(response_id, 0)

    def acknowledge(self, response_id: str, played_ms: int) -> None:
        self._record(response_id, played_ms)

    def truncated(self, item_id: str, audio_end_ms: int) -> None:
        """The user heard ``audio_end_ms`` of the item's audio: the rest was cut."""
        self._record(item_id, audio_end_ms)

    def _record(self, key: str, heard_ms: int) -> None:
        # Evicted on both paths, oldest first: evicted on acknowledgements only, a client that
        # truncated its answers and never acknowledged one grew the ledger by a record a
        # response for as long as the session lived.
        heard = self._heard_ms
        heard[key] = heard_ms
        while len(heard) > RECENT_RESPONSES:
            heard.pop(next(iter(heard)))

    def snapshot(self) -> dict[str, int]:
        """A copy of what is recorded, oldest first (for tests and diagnostics)."""
        return dict(self._heard_ms)
