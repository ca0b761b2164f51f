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
        heard = self._heard_ms
        heard[response_id] = played_ms
        # Evicted here only, oldest first, so truncations recorded since count towards the
        # bound at the next acknowledgement (as the session did before the ledger had a class).
        if len(heard) > RECENT_RESPONSES:
            heard.pop(next(iter(heard)))

    def truncated(self, item_id: str, audio_end_ms: int) -> None:
        """The user heard ``audio_end_ms`` of the item's audio: the rest was cut."""
        self._heard_ms[item_id] = audio_end_ms

    def snapshot(self) -> dict[str, int]:
        """A copy of what is recorded, oldest first (for tests and diagnostics)."""
        return dict(self._heard_ms)
