"""The soak over the wire, short form: 30 websocket clients (a sixth of them hostile) for 20 s
against a real `duplex-actors serve` subprocess, with barge-ins, dropped sockets and resumes.
Zero events lost or duplicated, every terminal exactly once, every hostile client refused, the
server back at 0 sessions and exiting 0 on SIGTERM, its RSS level after warm-up (1.5x the
6 s journal age). 20 s locally; CI (CI=true) runs the 60 s form; DUPLEX_WIRE_SOAK_S overrides."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("websockets")

from duplex_actors.bench import wire_soak

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_wire_soak_short_form_loses_nothing_duplicates_nothing_and_refuses_every_hostile_client():
    default = "60" if os.environ.get("CI") == "true" else "20"
    seconds = float(os.environ.get("DUPLEX_WIRE_SOAK_S", default))
    report = wire_soak.run(sessions=30, seconds=seconds, seed=3, hostile=1 / 6, journal_max_age_s=6.0)
    print(wire_soak.summary(report))
    c = report["counts"]
    assert report["lost"] == 0 and report["duplicates"] == 0 and report["terminal_violations"] == 0
    assert report["defence_failures"] == 0 and report["client_failures"] == 0, c
    assert c.get("errors_unexpected", 0) == 0, c
    assert report["sessions_left"] == 0 and report["server_exit_code"] == 0
    # The run really did what it claims to exercise.
    assert c["drops"] >= 5 and c["resumes"] >= 5 and c["barge_ins"] >= 10, c
    assert c["hostile_flood"] >= 1 and c["hostile_forge"] >= 1 and c["hostile_poke"] >= 1, c
    assert c["responses_completed"] >= 100, c
    assert report["rss_mb"]["after_warmup"] is not None
    # The server's own read-out was taken: journals held events while clients talked, and once
    # every session was gone no record and no extra task was left.
    inside, idle = report["server_inside"], report["server_idle"]
    assert inside["after_warmup"]["journal_events"] > 0 and inside["after_warmup"]["records"] > 0, inside
    # (less the engine's parked pumps: a bounded pool the first turns fill, reused after)
    working = {k: v["tasks"] - v.get("parked_pumps", 0) for k, v in idle.items() if k in ("before", "after")}
    assert idle["after"]["records"] == 0 and working["after"] <= working["before"], idle
    assert report["ok"], report


def test_wire_soak_with_two_workers_one_killed_halfway_loses_nothing_and_tells_every_client_of_the_dead_one():
    # serve --workers 2; worker 1 gets SIGKILL by its pid halfway. Its clients are each told
    # (failed response.done per response in flight, session.closed worker_lost, close 1011, or
    # session_lost on a resume), open new sessions, and nobody else loses anything.
    report = wire_soak.run(
        sessions=30, seconds=20, seed=3, hostile=1 / 6, journal_max_age_s=6.0, workers=2, kill_worker=True
    )
    _assert_every_client_of_a_dead_worker_told_and_nothing_else_lost(report, kills=1)


def test_wire_soak_with_both_workers_killed_in_turn_tells_every_client_of_each():
    # Worker 1 at a third of the run, worker 0 (where its clients went) at two thirds: the
    # sessions opened on the survivor die too, and resumes of worker 1's sessions meet a dying
    # worker (the front refuses a resume its dead worker had not answered as session_lost).
    report = wire_soak.run(
        sessions=30, seconds=20, seed=5, hostile=1 / 6, journal_max_age_s=6.0, workers=2, kill_workers=2
    )
    _assert_every_client_of_a_dead_worker_told_and_nothing_else_lost(report, kills=2)


def _assert_every_client_of_a_dead_worker_told_and_nothing_else_lost(report: dict, kills: int) -> None:
    print(wire_soak.summary(report))
    c = report["counts"]
    assert c["workers_killed"] == kills, c
    assert report["sessions_lost_with_worker"] >= kills and report["untold_worker_losses"] == 0, c
    assert report["lost"] == 0 and report["duplicates"] == 0 and report["terminal_violations"] == 0, c
    assert report["defence_failures"] == 0 and report["client_failures"] == 0, c
    assert c.get("errors_unexpected", 0) == 0 and c.get("responses_left_open", 0) == 0, c
    assert report["sessions_left"] == 0 and report["server_exit_code"] == 0
    assert c["responses_completed"] >= 50, c
    assert report["ok"], report
