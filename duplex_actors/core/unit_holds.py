"""What a model-native session's units in flight hold: their audio and the words they share.

Each unit request carries a unit of the user's audio and the words of the items its session has
pending (the model reads them to decide, and a unit promoted to the turn answers them). Both
stay with the request until the model has decided on it, and an engine that decides slower than
a client streams keeps many waiting. So both count in the runtime's budgets while they wait:

- the audio in the audio budget, per unit (it left the session's buffer, which counted it);
- the words in the text budget, once. Joined afresh for each unit, a session with four items of
  65,000 emoji pending held a megabyte a unit waiting, uncounted. A session now joins them once,
  when a unit first asks for them, and offers that one string to every unit after it while its
  pending words stay the same (:class:`SharedWords`). It counts from the join until the session
  no longer offers it (its pending words changed, or it closed) and no unit in flight, nor the
  response a unit became, carries it.

The session (turn_effects.py) keeps the ledger; these are its entries.
"""

from __future__ import annotations


class SharedWords:
    """One join of a session's pending words, carried by its units."""

    __slots__ = ("text", "nbytes", "carriers")

    def __init__(self, text: str, nbytes: int) -> None:
        self.text = text
        #: What it counts in the text budget (text_budget.response_text_bytes of its text).
        self.nbytes = nbytes
        #: Units in flight, and the response a unit became, that carry it.
        self.carriers = 0


class UnitHold:
    """A unit in flight: the bytes of audio its request carries, and its words."""

    __slots__ = ("audio_bytes", "words")

    def __init__(self, audio_bytes: int, words: SharedWords) -> None:
        self.audio_bytes = audio_bytes
        self.words = words


__all__ = ["SharedWords", "UnitHold"]
