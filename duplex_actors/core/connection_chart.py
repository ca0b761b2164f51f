"""The connection chart: what one websocket connection is to the session it carries.

Theory of operation
-------------------
A connection of the Realtime server (:mod:`duplex_actors.server.app`) carries at most one
session, and a session is carried by at most one connection at a time. Whether a connection
that ends closes its session or leaves it waiting for a resume, whether a resume pushes an
older connection out, and with which close code a connection ends, are decided here, as data,
in the same table form as the session chart (:mod:`duplex_actors.core.statechart`): states,
rows of (trigger, source, dest, effects, guards), tried in order for a (state, trigger), the
first whose guards hold winning.

Nothing here does I/O. The server feeds each connection's triggers into its
:class:`ConnectionLifecycle`, with the :class:`Facts` its guards read, and performs the named
effects it gets back (``server/session_connection.py``); the chart is exported and
drift-checked like the others (``duplex-actors statechart --machine connection``).

A connection enters the chart once it holds a session (a new one, or a resume the session's
chart accepted); refusals before that (admission, a bad resume) are no lifecycle.

States
  attached     the connection carries its session: the reader hands the client's frames on,
               the writer sends the session's events.
  draining     attached while the server shuts down: the session finishes the responses in
               flight and closes; the connection then ends with 1001 (going away).
  superseded   a resume on a newer connection took the session over: this one is closed with
               4001 and its end changes nothing of the session.
  detached     the connection was lost without the client's goodbye: its session waits out
               its disconnect grace for a resume on a new connection.
  closed       absorbing: the session ended (the client's goodbye, a policy, expiry, shutdown)
               and the connection closes after delivering session.closed.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import attrs
from transitions import Machine

from ..errors import IllegalTransition
from .chart_rows import row as _row


class ConnectionState(str, enum.Enum):
    """The five states of a connection's chart (the module docstring says what each means)."""

    ATTACHED = "attached"
    DRAINING = "draining"
    SUPERSEDED = "superseded"
    DETACHED = "detached"
    CLOSED = "closed"

    def __repr__(self) -> str:  # readable in hypothesis failure reports
        return self.value


ATTACHED, DRAINING, SUPERSEDED, DETACHED, CLOSED = (s.value for s in ConnectionState)
#: The states in which the connection carries its session (at most one connection per session).
CARRYING = (ATTACHED, DRAINING)
SAME = None  # an internal transition: state unchanged


CARRYING_ROWS = list(CARRYING)

# Rows are tried in order for a (state, trigger): the first whose guards hold wins.
TRANSITIONS = [
    _row("drain", ATTACHED, DRAINING),
    _row("drain", [DRAINING, SUPERSEDED, DETACHED], SAME),  # nothing left to drain here
    # A resume on a newer connection, accepted by the session's chart: this one stops reading
    # and is closed; the session stays open for the newer one.
    _row("takeover", CARRYING_ROWS, SUPERSEDED, ["vacate_session", "wake_reader", "close_superseded"]),
    # The client sent too many invalid frames: the declared policy closes its session.
    _row(
        "flood",
        CARRYING_ROWS,
        SAME,
        ["choose_policy_close_code", "force_close_session", "close_after_writer"],
    ),
    # A send did not drain within the write timeout: the connection goes, its session detaches
    # when the reader sees the socket gone (socket_lost).
    _row("slow_consumer", [*CARRYING, SUPERSEDED], SAME, ["count_slow_consumer", "drop_socket"]),
    # The writer delivered session.closed: the session is over, and so is the connection.
    _row("session_closed", ATTACHED, CLOSED, ["forget_session", "close_socket"]),
    _row(
        "session_closed",
        DRAINING,
        CLOSED,
        ["forget_session", "close_going_away"],
        unless=["policy_close_code"],
    ),
    _row("session_closed", DRAINING, CLOSED, ["forget_session", "close_socket"]),
    _row("session_closed", SUPERSEDED, SAME, ["forget_session", "close_socket"]),
    # The reader ended: the socket is gone (or going). Checked in this order: a session that
    # closed meanwhile has nothing to keep; a clean close by the client is its goodbye.
    _row(
        "socket_lost",
        CARRYING_ROWS,
        CLOSED,
        ["vacate_session", "forget_session", "count_closed"],
        conditions=["session_closed"],
    ),
    _row(
        "socket_lost",
        CARRYING_ROWS,
        CLOSED,
        ["vacate_session", "close_session", "forget_if_closed"],
        conditions=["client_said_goodbye"],
    ),
    _row(
        "socket_lost",
        CARRYING_ROWS,
        DETACHED,
        ["vacate_session", "detach_session", "forget_if_closed"],
    ),
    _row("socket_lost", SUPERSEDED, SAME, ["count_superseded"]),
    _row("socket_lost", CLOSED, SAME, ["vacate_session", "forget_session", "count_closed"]),
    # Closed is absorbing: whatever still arrives is consumed without effect.
    *(_row(t, CLOSED, SAME) for t in ("drain", "takeover", "flood", "slow_consumer", "session_closed")),
]

TRIGGERS = tuple(dict.fromkeys(row["trigger"] for row in TRANSITIONS))

WHY: Mapping[str, str] = {
    "drain": "the server is shutting down (SIGTERM): the connection ends with 1001 once its session closes",
    "takeover": "a resume on a newer connection was accepted: this connection is pushed out with 4001",
    "flood": "too many refused frames (invalid ones, or valid ones sent on through backpressure): the declared policy closes the session, then the connection with 1008",
    "slow_consumer": "a send did not drain within the write timeout: the socket is cut, the session detaches",
    "session_closed": "the writer delivered session.closed: the connection closes with its code",
    "socket_lost": "the reader ended: a goodbye closes the session, any other loss detaches it",
}

STATE_DOCS: Mapping[str, str] = {
    ATTACHED: "the connection carries its session: frames in, events out",
    DRAINING: "attached while the server shuts down: ends with 1001 once the session closes",
    SUPERSEDED: "a newer connection resumed the session: closed with 4001, its end changes nothing",
    DETACHED: "lost without a goodbye: the session waits out its disconnect grace for a resume",
    CLOSED: "the session ended and the connection closes after session.closed (absorbing)",
}

GUARD_DOCS: Mapping[str, str] = {
    "policy_close_code": "a policy (the refused-frame flood) chose the connection's close code",
    "session_closed": "the session is closed already (expiry, shutdown, a policy)",
    "client_said_goodbye": "the client started a clean close with code 1000 and the server answered it",
}

#: Pairs with no row are refused with this error: the server never fires them (tests hold it).
DEFAULT_REFUSAL = IllegalTransition

MACHINE = Machine(
    model=None,
    states=[s.value for s in ConnectionState],
    transitions=TRANSITIONS,
    initial=ATTACHED,
    auto_transitions=False,
    send_event=False,
    ignore_invalid_triggers=False,
)


# --- the compiled table and one connection's lifecycle -----------------------------------------


@attrs.frozen(slots=True)
class Facts:
    """What the guards of one trigger read, as the server saw it when it fired the trigger."""

    session_closed: bool = False
    client_said_goodbye: bool = False
    policy_close_code: bool = False


NO_FACTS = Facts()


@attrs.frozen(slots=True)
class Step:
    """One transition taken: from ``source`` on ``trigger`` to ``dest``, performing ``effects``."""

    source: str
    trigger: str
    dest: str
    effects: tuple[str, ...]


def _compile(
    machine: Machine,
) -> dict[tuple[str, str], tuple[tuple[tuple[tuple[str, bool], ...], Step], ...]]:
    table: dict[tuple[str, str], list[tuple[tuple[tuple[str, bool], ...], Step]]] = {}
    for trigger, event in machine.events.items():
        for source, transitions in event.transitions.items():
            for t in transitions:
                guards = tuple((str(c.func), bool(c.target)) for c in t.conditions)
                dest = source if t.dest is None else t.dest
                step = Step(source, trigger, dest, tuple(str(e) for e in t.after))
                table.setdefault((source, trigger), []).append((guards, step))
    return {key: tuple(branches) for key, branches in table.items()}


#: ``{(state, trigger): ((guards, step), ...)}`` in row order, read back from :data:`MACHINE`.
TABLE = _compile(MACHINE)
GUARDS = tuple(sorted({name for branches in TABLE.values() for guards, _ in branches for name, _ in guards}))
EFFECTS = tuple(sorted({e for branches in TABLE.values() for _, step in branches for e in step.effects}))


def resolve(state: str, trigger: str, facts: Facts = NO_FACTS) -> Step:
    """The step the chart takes on ``trigger`` in ``state`` given ``facts``; raises
    :data:`DEFAULT_REFUSAL` for a pair the chart has no row for."""
    for guards, step in TABLE.get((state, trigger), ()):
        if all(getattr(facts, name) is want for name, want in guards):
            return step
    raise DEFAULT_REFUSAL(state, trigger)


class ConnectionLifecycle:
    """One connection's place in the chart: :meth:`fire` a trigger, perform the effects."""

    __slots__ = ("state",)

    def __init__(self, state: str = ATTACHED) -> None:
        self.state = state

    @property
    def carrying(self) -> bool:
        """Whether the connection carries its session (attached or draining)."""
        return self.state in CARRYING

    def fire(self, trigger: str, facts: Facts = NO_FACTS) -> tuple[str, ...]:
        """Take the chart's step for ``trigger``; returns the effects, in order, to perform."""
        step = resolve(self.state, trigger, facts)
        self.state = step.dest
        return step.effects

    def __repr__(self) -> str:
        return f"ConnectionLifecycle({self.state})"
