"""The front's ledger of ``serve --workers`` (front_ledger.py), without sockets: what a dead
worker's clients are told is built from what the worker reported, and from nothing else.

The same over real processes (a worker killed by its pid) is in test_workers.py and in the wire
soak that kills a worker (tests/reliability/test_soak_wire_short.py)."""

from __future__ import annotations

import json
import struct

from hypothesis import given
from hypothesis import strategies as st

from duplex_actors.server.front_ledger import CLOSE_WORKER_LOST, FrontLedger

from .conftest import server_frames


def _told(data: bytes) -> tuple[list[dict], int]:
    """The events of a farewell, and its close code."""
    frames = server_frames(data)
    assert [opcode for opcode, _ in frames[:-1]] == [0x1] * (len(frames) - 1)
    assert frames[-1][0] == 0x8, "a farewell ends with the close frame"
    return [json.loads(payload) for _, payload in frames[:-1]], struct.unpack("!H", frames[-1][1][:2])[0]


# A worker's reports on one session, as a hypothesis strategy: responses start and end in any
# order the worker could send them (an end without a start, twice, or for another response).
_reports = st.lists(
    st.tuples(st.sampled_from(["r", "d"]), st.sampled_from(["resp_a", "resp_b", "resp_c"])),
    max_size=30,
)


@given(_reports, st.booleans(), st.booleans(), st.sampled_from([None, "sess_w0g0_x"]))
def test_a_dead_workers_client_is_told_of_exactly_the_responses_started_and_not_ended(
    reports, answered, attached, resuming
):
    ledger = FrontLedger()
    connection = ledger.handed(0, resuming=resuming)
    other = ledger.handed(1)  # another worker's connection: untouched by worker 0's death
    open_: list[str] = []  # the model: started and not ended, in order of start
    if answered:
        ledger.answering(connection)
    if attached:
        ledger.attached(connection, "sess_w0g0_x")
    for kind, rid in reports:
        if kind == "r":
            ledger.response_started("sess_w0g0_x", rid)
            if rid not in open_:
                open_.append(rid)
        else:
            ledger.response_ended("sess_w0g0_x", rid)
            if rid in open_:
                open_.remove(rid)
    farewells = ledger.worker_lost(0)
    assert list(farewells) == [connection]
    if not (answered or attached):
        # Its client still waits for the handshake's answer: an HTTP one, saying to try again.
        assert farewells[connection].startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert b"Retry-After: 1\r\n" in farewells[connection]
        if resuming is not None:
            assert ledger._responses == {}  # nothing kept of a session that is gone
        assert ledger.worker_lost(0) == {}
        return
    events, code = _told(farewells[connection])
    if attached:
        assert [(e["type"], e.get("response", {}).get("id")) for e in events] == [
            *(("response.done", rid) for rid in open_),
            ("session.closed", None),
        ]
        assert all(e["response"]["status"] == "failed" for e in events[:-1])
        assert events[-1]["reason"] == "worker_lost" and code == CLOSE_WORKER_LOST
    elif resuming is not None:
        # A resume the worker had not answered: refused as a resume after the death would be.
        assert [(e["type"], e["error"]["code"]) for e in events] == [("error", "session_lost")]
        assert events[0]["server_event_seq"] is None and code == 4404
    else:
        # No session was reported on it: nothing to end but the connection.
        assert events == [] and code == CLOSE_WORKER_LOST
    assert ledger.of_worker(0) == [] and ledger.of_worker(1) == [other]
    if attached or resuming is not None:
        assert ledger._responses == {}  # nothing kept of a session that is gone
    assert ledger.worker_lost(0) == {}  # told once


def test_a_session_that_closed_has_nothing_left_to_end():
    ledger = FrontLedger()
    connection = ledger.handed(0)
    ledger.attached(connection, "sess_w0g0_x")
    ledger.response_started("sess_w0g0_x", "resp_a")
    ledger.session_ended("sess_w0g0_x")
    events, _ = _told(ledger.worker_lost(0)[connection])
    assert [e["type"] for e in events] == ["session.closed"]


def test_a_connection_the_worker_released_gets_no_farewell():
    ledger = FrontLedger()
    connection = ledger.handed(0, resuming="sess_w0g0_x")
    assert ledger.released(connection)
    assert not ledger.released(connection)
    assert ledger.worker_lost(0) == {}


def test_every_connection_of_a_session_is_told_its_open_responses_not_only_the_oldest():
    # Found by random walks through serve --workers 2 with a worker killed mid-walk: the client
    # dropped its connection and resumed on a new one, the worker had not yet released the old
    # one, and the old one (first in the ledger) took the session's open responses. The client,
    # on the new connection, got session.closed with its response never ended.
    ledger = FrontLedger()
    old = ledger.handed(0)
    ledger.attached(old, "sess_w0g0_x")
    new = ledger.handed(0, resuming="sess_w0g0_x")
    ledger.attached(new, "sess_w0g0_x")
    ledger.response_started("sess_w0g0_x", "resp_a")
    farewells = ledger.worker_lost(0)
    for connection in (old, new):
        events, code = _told(farewells[connection])
        assert [(e["type"], e.get("response", {}).get("id")) for e in events] == [
            ("response.done", "resp_a"),
            ("session.closed", None),
        ]
        assert code == CLOSE_WORKER_LOST
    assert ledger._responses == {}


def test_a_client_still_waiting_for_its_handshakes_answer_gets_an_http_503_not_frames():
    # Found by random walks with a worker killed mid-walk: a resume's connection handed to the
    # worker just before it died got the session_lost frames while its client still read the
    # HTTP status line ("stream ends after 301 bytes, before end of line").
    ledger = FrontLedger()
    fresh = ledger.handed(0)
    resume = ledger.handed(0, resuming="sess_w0g0_x")
    answered = ledger.handed(0, resuming="sess_w0g0_x")
    ledger.answering(answered)
    farewells = ledger.worker_lost(0)
    for connection in (fresh, resume):
        head, _, body = farewells[connection].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"Connection: close" in head
        assert b"try again" in body
    events, code = _told(farewells[answered])
    assert [e["error"]["code"] for e in events] == ["session_lost"] and code == 4404


# What happens to connections: handed to a worker (counting for a client, or not), released by
# their worker, or lost with it.
_lives = st.lists(
    st.one_of(
        st.tuples(st.just("hand"), st.integers(0, 2), st.sampled_from([None, "10.0.0.1", "10.0.0.2"])),
        st.tuples(st.just("release"), st.integers(1, 12), st.none()),
        st.tuples(st.just("lose"), st.integers(0, 2), st.none()),
    ),
    max_size=40,
)


@given(_lives)
def test_a_clients_sessions_are_its_connections_handed_and_not_yet_released_or_lost(lives):
    # The session quota the front keeps over every worker (front_door.SessionQuota) reads
    # sessions_of: each connection counts from its hand-off until its worker releases it or
    # dies, once, whatever order the reports come in.
    ledger = FrontLedger()
    live: dict[int, tuple[int, str | None]] = {}
    for op, number, client in lives:
        if op == "hand":
            live[ledger.handed(number, None, client)] = (number, client)
        elif op == "release":
            assert ledger.released(number) == (live.pop(number, None) is not None)
        else:
            ledger.worker_lost(number)
            live = {c: held for c, held in live.items() if held[0] != number}
        for client_ in ("10.0.0.1", "10.0.0.2"):
            assert ledger.sessions_of(client_) == sum(1 for _, c in live.values() if c == client_)
    assert not ledger._by_client or all(ledger._by_client.values())  # no zero left behind


def test_a_dead_workers_sessions_without_a_connection_are_forgotten_with_it():
    # A session detached mid-response (its client dropped) is on no connection: worker_lost
    # forgot only the sessions of the connections it held, so a dead worker's detached sessions
    # stayed in the front's ledger for good.
    from duplex_actors.server.front_door import owner_of, worker_session_id

    ledger = FrontLedger(owner=owner_of)
    detached, other, attached = worker_session_id(1), worker_session_id(0), worker_session_id(1)
    for sid in (detached, other, attached):
        ledger.response_started(sid, "resp_" + sid[-4:])
    ledger.attached(ledger.handed(1), attached)
    farewells = ledger.worker_lost(1)
    assert len(farewells) == 1  # the one connection it held is told
    assert list(ledger._responses) == [other]  # worker 0's session is still in flight
