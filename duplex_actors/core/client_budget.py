"""A runtime-wide bound on what all sessions hold of one kind, shared by client.

A session bounds what it holds itself (its input audio, its conversation's text); a client
multiplies that by the sessions it opens, and many clients multiply it again. A
:class:`ClientBudget` bounds the sum, fairly: each client (a session's tenant: an API key, else
an address; a session with no tenant is a client of its own) holds its bytes in one
:class:`ClientAccount`, and more is refused only while the total is over the budget *and* the
client holds more than its share (the budget split evenly among the clients with a session
open). The clients that hold the most are refused first; a client within its share never is,
however much the others hold, so the clients within their shares hold at most the budget
between them and the total stays under twice the budget (plus one request). What is refused is
the client's next request; nothing already accepted is dropped.

The runtime keeps one for input audio (audio_budget.py) and one for conversation text
(text_budget.py); the session's chart asks :meth:`ClientBudget.allows` in its checks.
"""

from __future__ import annotations


class ClientBudget:
    """A runtime-wide bound, and the accounts of the clients holding bytes under it."""

    __slots__ = ("max_bytes", "total", "_accounts")

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("need max_bytes > 0")
        self.max_bytes = max_bytes
        self.total = 0  # bytes held by every account's buffers
        self._accounts: dict[object, ClientAccount] = {}

    @property
    def clients(self) -> int:
        """Clients with at least one session open: the budget's fair share is split by them."""
        return len(self._accounts)

    def join(self, client: object) -> ClientAccount:
        """The account a new session of ``client`` holds its audio in (shared by its sessions)."""
        account = self._accounts.get(client)
        if account is None:
            account = self._accounts[client] = ClientAccount(self, client)
        account.sessions += 1
        return account

    def allows(self, account: ClientAccount, nbytes: int) -> bool:
        """Whether ``account`` may take ``nbytes`` more: the total stays within the budget, or
        the account stays within its share of it. Pure (the chart's checks are asked again)."""
        return (
            self.total + nbytes <= self.max_bytes
            or (account.held + nbytes) * len(self._accounts) <= self.max_bytes
        )

    def _leave(self, account: ClientAccount) -> None:
        account.sessions -= 1
        if account.sessions <= 0 and self._accounts.get(account.client) is account:
            del self._accounts[account.client]


class ClientAccount:
    """One client's bytes under a :class:`ClientBudget`: what its sessions hold adds and gives
    back as it changes."""

    __slots__ = ("budget", "client", "held", "sessions")

    def __init__(self, budget: ClientBudget, client: object) -> None:
        self.budget = budget
        self.client = client
        self.held = 0  # bytes this client's sessions hold
        self.sessions = 0

    def add(self, nbytes: int) -> None:
        """``nbytes`` more held (negative: given back)."""
        self.held += nbytes
        self.budget.total += nbytes

    def leave(self) -> None:
        """One of the client's sessions closed (it gave its bytes back first)."""
        self.budget._leave(self)


__all__ = ["ClientAccount", "ClientBudget"]
