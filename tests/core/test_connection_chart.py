"""The connection chart's invariants, over every sequence of triggers the server can fire.

The server fires a connection's triggers in a known order: any of drain, takeover, flood,
slow_consumer and session_closed while the connection lives, socket_lost once, last (its
reader has ended and its writer with it). Over all such sequences the chart never refuses,
closed is absorbing, nothing returns to carrying the session, a session is released (closed or
detached) at most once per connection and never by one that was taken over, and a session
resumed again and again is carried by one connection at a time.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.core import connection_chart as chart
from duplex_actors.core.connection_chart import (
    ATTACHED,
    CARRYING,
    CLOSED,
    DETACHED,
    DRAINING,
    SUPERSEDED,
    ConnectionLifecycle,
    Facts,
)
from duplex_actors.errors import IllegalTransition

ALL_FACTS = [Facts(*values) for values in itertools.product((False, True), repeat=3)]
facts = st.sampled_from(ALL_FACTS)
#: What a live connection may fire, before its reader ends.
LIVE_TRIGGERS = ("drain", "takeover", "flood", "slow_consumer", "session_closed")
#: What ends a session's life from this connection.
RELEASES = {"close_session", "detach_session"}


def _possible(lifecycle: ConnectionLifecycle, trigger: str) -> bool:
    """Whether the server can fire ``trigger`` now: a takeover only pushes out a connection
    that carries the session; a flood is seen only by a reader still handling frames."""
    if trigger == "takeover":
        return lifecycle.carrying
    if trigger == "flood":
        return lifecycle.state != SUPERSEDED
    return True


lives = st.lists(st.tuples(st.sampled_from(LIVE_TRIGGERS), facts), max_size=8)


@settings(max_examples=300, deadline=None)
@given(lives, facts)
def test_every_sequence_the_server_can_fire_is_answered(life, end_facts):
    lifecycle = ConnectionLifecycle()
    effects: list[str] = []
    taken_over = False
    for trigger, fact in life:
        if not _possible(lifecycle, trigger):
            continue
        before = lifecycle.state
        effects += lifecycle.fire(trigger, fact)
        taken_over = taken_over or trigger == "takeover"
        if before == CLOSED:
            assert lifecycle.state == CLOSED  # absorbing
        if before not in CARRYING:
            assert lifecycle.state not in CARRYING  # nothing carries the session again
    before = lifecycle.state
    effects += lifecycle.fire("socket_lost", end_facts)
    assert lifecycle.state in (SUPERSEDED, DETACHED, CLOSED)
    assert len([e for e in effects if e in RELEASES]) <= 1
    if taken_over:
        # A pushed-out connection's end changes nothing of the session the newer one carries.
        assert not RELEASES & set(effects[effects.index("close_superseded") :])
        assert lifecycle.state == SUPERSEDED
    if before in CARRYING:
        # The first loss of a carrying connection: a closed session is only forgotten, a
        # goodbye closes it, anything else detaches it.
        if end_facts.session_closed:
            assert lifecycle.state == CLOSED and not RELEASES & set(effects)
        elif end_facts.client_said_goodbye:
            assert lifecycle.state == CLOSED and "close_session" in effects
        else:
            assert lifecycle.state == DETACHED and "detach_session" in effects


@pytest.mark.parametrize("trigger", chart.TRIGGERS)
@pytest.mark.parametrize("fact", ALL_FACTS)
def test_closed_is_absorbing_and_never_touches_the_session(trigger, fact):
    lifecycle = ConnectionLifecycle(CLOSED)
    effects = lifecycle.fire(trigger, fact)
    assert lifecycle.state == CLOSED
    assert not RELEASES & set(effects) and "force_close_session" not in effects


@pytest.mark.parametrize("state", [SUPERSEDED, DETACHED])
@pytest.mark.parametrize("trigger", chart.TRIGGERS)
@pytest.mark.parametrize("fact", ALL_FACTS)
def test_an_ended_connection_never_carries_the_session_again(state, trigger, fact):
    lifecycle = ConnectionLifecycle(state)
    try:
        effects = lifecycle.fire(trigger, fact)
    except IllegalTransition:
        assert lifecycle.state == state  # refused: left untouched
        return
    assert lifecycle.state == state
    assert not RELEASES & set(effects) and "vacate_session" not in effects


def test_a_pair_without_a_row_is_refused_with_the_declared_error():
    with pytest.raises(chart.DEFAULT_REFUSAL):
        chart.resolve(DETACHED, "socket_lost")
    with pytest.raises(chart.DEFAULT_REFUSAL):
        chart.resolve(SUPERSEDED, "takeover")


def test_the_close_code_follows_the_state_the_session_closed_in():
    assert "close_going_away" in chart.resolve(DRAINING, "session_closed").effects
    # A policy's code (the flood's 1008) stands even while draining.
    assert "close_socket" in chart.resolve(DRAINING, "session_closed", Facts(policy_close_code=True)).effects
    assert "close_socket" in chart.resolve(ATTACHED, "session_closed").effects


# --- one session, many connections ------------------------------------------------------------

session_ops = st.lists(
    st.one_of(
        st.tuples(st.just("resume"), st.integers(0, 0)),
        st.tuples(
            st.sampled_from(["drain", "flood", "slow_consumer", "session_closed", "socket_lost"]),
            st.integers(0, 5),
        ),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(session_ops, facts)
def test_a_session_is_carried_by_at_most_one_connection(ops, end_facts):
    """The server's attach: a resume fires takeover on the connection that carries the session
    (vacate_session frees the seat), then the new connection takes it."""
    connections = [ConnectionLifecycle()]
    seat: ConnectionLifecycle | None = connections[0]
    lost: set[int] = set()
    for op, index in ops:
        if op == "resume":
            if seat is not None and seat.carrying and "vacate_session" in seat.fire("takeover"):
                seat = None
            assert seat is None or not seat.carrying
            seat = ConnectionLifecycle()
            connections.append(seat)
        else:
            i = index % len(connections)
            lifecycle = connections[i]
            if i in lost or not _possible(lifecycle, op):
                continue
            if op == "socket_lost":
                lost.add(i)
                effects = lifecycle.fire(op, end_facts)
                if "vacate_session" in effects and seat is lifecycle:
                    seat = None
            else:
                lifecycle.fire(op, end_facts)
        carrying = [c for c in connections if c.carrying]
        assert len(carrying) <= 1
        assert not carrying or carrying[0] is seat


# --- the table agrees with the exported spec --------------------------------------------------


def test_the_compiled_table_agrees_with_the_exported_spec():
    from duplex_actors.tooling import statechart_export as export

    spec = export.spec("connection")
    assert set(spec.states) == {s.value for s in chart.ConnectionState}
    assert spec.initial == ATTACHED and set(spec.absorbing) == {SUPERSEDED, DETACHED, CLOSED}
    for state in spec.states:
        for trigger in spec.triggers:
            for fact in ALL_FACTS:
                edge = spec.resolve(state, trigger, attrs_dict(fact))
                try:
                    step = chart.resolve(state, trigger, fact)
                except IllegalTransition:
                    assert edge is None
                    continue
                assert edge is not None and (edge.dest, edge.effects) == (step.dest, step.effects)


def attrs_dict(fact: Facts) -> dict[str, bool]:
    import attrs

    return attrs.asdict(fact)
