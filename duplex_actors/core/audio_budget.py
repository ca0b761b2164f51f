"""What all sessions' input audio may hold together, shared by client.

Each session bounds its own input audio: ``max_input_bytes`` buffered and
``max_committed_bytes`` committed, 120 s each at 16 kHz by default. A client multiplies that by
opening sessions (an address may hold hundreds), many clients multiply it again, and G.711
makes it cheap: 8 kHz mu-law is a byte a sample on the wire and two at 16 kHz once converted.
The figures are in docs/reliability.md.

With a budget, an append (or a created item's audio) is refused as ``input_backpressure``
while the audio held in all is over the budget *and* the client holds more than its fair
share of it (the budget split evenly among the clients with a session open). The clients
that hold the most are refused first; a client holding less than its share is never refused,
however much the others hold, so the clients within their shares hold at most the budget
between them, and the total stays under twice the budget (plus an append). Nothing already
accepted is dropped: a refused client commits, clears or waits for a response to take its
committed audio, as with its own bound.

Turns waiting for the recogniser hold a copy of their audio of their own, so they count in
the same account while they wait (actors/transcription_queue.py), and a turn that would take a
client over its share of a full budget is refused there: the turn's transcription fails with
a message saying so, the turn itself is not touched.

A client is what the runtime shares by (a session's ``tenant``: an API key, else an address);
a session with no tenant is a client of its own.
"""

from __future__ import annotations


class AudioBudget:
    """The runtime-wide bound, and the accounts of the clients holding audio under it."""

    __slots__ = ("max_bytes", "total", "_accounts")

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("need max_bytes > 0")
        self.max_bytes = max_bytes
        self.total = 0  # bytes held by every account's buffers
        self._accounts: dict[object, AudioAccount] = {}

    @property
    def clients(self) -> int:
        """Clients with at least one session open: the budget's fair share is split by them."""
        return len(self._accounts)

    def join(self, client: object) -> AudioAccount:
        """The account a new session of ``client`` holds its audio in (shared by its sessions)."""
        account = self._accounts.get(client)
        if account is None:
            account = self._accounts[client] = AudioAccount(self, client)
        account.sessions += 1
        return account

    def allows(self, account: AudioAccount, nbytes: int) -> bool:
        """Whether ``account`` may take ``nbytes`` more: the total stays within the budget, or
        the account stays within its share of it. Pure (the chart's checks are asked again)."""
        return (
            self.total + nbytes <= self.max_bytes
            or (account.held + nbytes) * len(self._accounts) <= self.max_bytes
        )

    def _leave(self, account: AudioAccount) -> None:
        account.sessions -= 1
        if account.sessions <= 0 and self._accounts.get(account.client) is account:
            del self._accounts[account.client]


class AudioAccount:
    """One client's audio under an :class:`AudioBudget`: its sessions' buffers add and give
    back as their bytes change (``InputBuffer`` calls :meth:`add`)."""

    __slots__ = ("budget", "client", "held", "sessions")

    def __init__(self, budget: AudioBudget, client: object) -> None:
        self.budget = budget
        self.client = client
        self.held = 0  # bytes this client's buffers hold
        self.sessions = 0

    def add(self, nbytes: int) -> None:
        """``nbytes`` more held (negative: given back)."""
        self.held += nbytes
        self.budget.total += nbytes

    def leave(self) -> None:
        """One of the client's sessions closed (its buffers gave their bytes back first)."""
        self.budget._leave(self)


__all__ = ["AudioAccount", "AudioBudget"]
