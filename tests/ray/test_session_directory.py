"""The Serve app's session directory as a plain object (no Ray needed): affinity by token,
least-loaded assignment that counts each new session at once, and forgetting silent replicas."""

from __future__ import annotations

from duplex_actors.scaleout import ray_serve
from duplex_actors.scaleout.ray_serve import SessionDirectory, _ReplicaSessionIds, replica_of


def test_a_replica_token_round_trips_through_its_session_ids():
    ids = _ReplicaSessionIds("1a2b3c4d")
    sid = ids()
    assert replica_of(sid) == "1a2b3c4d" and ids() != sid
    assert replica_of("sess_w0_abcd") is None and replica_of("sess_rXYZ_00") is None


def test_new_sessions_spread_over_replicas_before_their_next_report():
    directory = SessionDirectory()
    directory.report("aaaaaaaa", "ws://a", 0)
    directory.report("bbbbbbbb", "ws://b", 0)
    assigned = [directory.assign_new() for _ in range(6)]
    assert sorted(assigned) == ["ws://a"] * 3 + ["ws://b"] * 3
    directory.report("aaaaaaaa", "ws://a", 10)  # a report replaces the estimate
    assert directory.assign_new() == "ws://b"


def test_a_replica_that_stops_reporting_is_forgotten(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(ray_serve.time, "monotonic", lambda: now[0])
    directory = SessionDirectory(stale_after_s=30.0)
    directory.report("aaaaaaaa", "ws://a", 0)
    assert directory.owner("aaaaaaaa") == "ws://a"
    now[0] += 31
    assert directory.owner("aaaaaaaa") is None and directory.assign_new() is None
    directory.report("aaaaaaaa", "ws://a", 0)
    directory.forget("aaaaaaaa")
    assert directory.owner("aaaaaaaa") is None
