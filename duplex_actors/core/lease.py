"""The session lease: idle TTL, disconnect grace, detach and resume (domain doc section 3).

Sans-IO: every method takes ``now``. Every activity touches the lease; an in-flight model turn
blocks idle expiry (a long answer is not idleness). Resume is a compare-and-swap on
``generation`` plus a rotating token; the same resume replayed (same ``control_id``) gets the
same answer instead of a conflict, so a client that retries after a lost reply is safe.

Idempotency never skips authentication: a replay is answered from the cache only when it
presents the very generation and token the original resume presented (its digest is kept,
not the token). A ``control_id`` alone is not a credential: it travels in clear and may be
guessed or replayed, and answering it would hand the new token to whoever sent it.

Nor do those old credentials stay good: a retry is for an answer that never arrived, so the
cached answer is given only while nothing shows that the client has it. It is dropped by any
later resume (with a control_id or without), by the first command the client sends after the
resume (a client waits for ``session.resumed`` before it sends on a resumed connection), and
after :data:`REPLAY_WINDOW_S`; and a replay may not ask for more of the journal than the
original did (``last_seq`` no lower). Until then a captured resume frame, replayed while the
session was detached, took the session over for as long as it lived, and was handed the
journal with the client's later items and, after a later resume, its current token.

The lease is a ledger, not the authority: whether a resume is accepted is the statechart's
decision (core/statechart.py, the ``resume`` rows), made with the pure predicates below
(:meth:`Lease.replays`, :meth:`Lease.owned_by`, ...). :meth:`Lease.resume` then performs the
compare-and-swap and rotates the token; it still refuses credentials that do not match, so
the ledger stays safe even for a caller that skipped the chart.
"""

from __future__ import annotations

import hashlib
import secrets

from ..errors import ResumeConflict

#: How long after a resume its exact retry is still answered from the cache (seconds): a
#: client retries within its reconnect backoff (DuplexClient: 8 attempts, under 8 s in all).
REPLAY_WINDOW_S = 15.0

IDLE_TTL_EXPIRED = "idle_ttl_expired"
DISCONNECT_GRACE_EXPIRED = "disconnect_grace_expired"


class Lease:
    __slots__ = (
        "idle_ttl",
        "grace",
        "last_activity",
        "detached_at",
        "generation",
        "token",
        "in_flight",
        "owner",
        "last_resume",
    )

    def __init__(
        self, now: float, idle_ttl: float = 300.0, grace: float = 30.0, owner: bytes | None = None
    ) -> None:
        self.idle_ttl = idle_ttl
        self.grace = grace
        self.last_activity = now
        self.detached_at: float | None = None
        self.generation = 0
        self.token = secrets.token_urlsafe(12)
        self.in_flight = 0
        #: Digest of the API key that opened the session: resumes must present it (None: the
        #: session was opened without authentication, and any key resumes it).
        self.owner = owner
        #: The last resume while its answer may still be lost: control_id, the digest of the
        #: credentials it presented, its last_seq, when it was accepted, and the (generation,
        #: token) it got. None once anything shows the client has the answer (read by the core
        #: on every command, so that the common case costs one attribute read).
        self.last_resume: tuple[str, bytes, int, float, int, str] | None = None

    def touch(self, now: float) -> None:
        if now > self.last_activity:
            self.last_activity = now

    @property
    def detached(self) -> bool:
        return self.detached_at is not None

    def detach(self, now: float) -> None:
        if self.detached_at is None:
            self.detached_at = now

    # --- pure predicates (the chart's resume guards read these) ------------------------------

    def owned_by(self, key: bytes | None) -> bool:
        """Whether a client presenting API key digest ``key`` may resume this session."""
        return self.owner is None or secrets.compare_digest(self.owner, key or b"")

    def replays(self, control_id: str | None, generation: int, token: str, last_seq: int, now: float) -> bool:
        """Whether this is the last accepted resume again, retried because its answer was lost:
        the credentials it presented, a journal position no earlier than its own, within
        :data:`REPLAY_WINDOW_S`, and nothing since showing that the client has the answer."""
        last = self.last_resume
        return (
            control_id is not None
            and last is not None
            and last[0] == control_id
            and last_seq >= last[2]
            and now - last[3] <= REPLAY_WINDOW_S
            and secrets.compare_digest(_credentials_digest(generation, token), last[1])
        )

    def answered(self) -> None:
        """The client has acted since its resume (it sent a command): it has the answer, so
        the old credentials are no longer a retry's."""
        self.last_resume = None

    def token_matches(self, token: str) -> bool:
        # As bytes: compare_digest refuses a str with a character past ASCII (TypeError), and
        # a client's token may hold any (ours are URL-safe base64, so such a token never matches).
        return secrets.compare_digest(token.encode("utf-8", "surrogatepass"), self.token.encode("ascii"))

    # --- the ledger ---------------------------------------------------------------------------

    def resume(
        self, now: float, generation: int, token: str, control_id: str | None = None, last_seq: int = 0
    ) -> tuple[int, str]:
        """Attach again; returns the new (generation, token). Raises ResumeConflict."""
        last = self.last_resume
        if last is not None and self.replays(control_id, generation, token, last_seq, now):
            # The same resume again (its answer was lost): same answer, and the client is
            # evidently attached, so the grace timer stops. Other credentials with this
            # control_id are no replay: they face the compare-and-swap below like any resume.
            self.detached_at = None
            self.touch(now)
            return last[4], last[5]
        if generation != self.generation:
            raise ResumeConflict(f"lease generation is {self.generation}, resume named {generation}")
        if not self.token_matches(token):
            raise ResumeConflict("resume token does not match")
        presented = _credentials_digest(generation, token)
        self.generation += 1
        self.token = secrets.token_urlsafe(12)
        self.detached_at = None
        self.touch(now)
        # Every resume replaces the last one's cached answer: a retry of an older one would
        # present credentials that a later resume has already used.
        self.last_resume = (
            None
            if control_id is None
            else (control_id, presented, last_seq, now, self.generation, self.token)
        )
        return self.generation, self.token

    def expiry(self, now: float) -> str | None:
        """The reason this lease has expired at ``now``, or None while it holds."""
        if self.detached_at is not None and now - self.detached_at >= self.grace:
            return DISCONNECT_GRACE_EXPIRED
        if self.in_flight == 0 and now - self.last_activity >= self.idle_ttl:
            return IDLE_TTL_EXPIRED
        return None


def _credentials_digest(generation: int, token: str) -> bytes:
    return hashlib.sha256(f"{generation}:{token}".encode("utf-8", "surrogatepass")).digest()
