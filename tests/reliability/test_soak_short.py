"""The soak's short form, in CI: 200 sessions for 20 s with barge-ins, disconnects (events lost
on the wire) and resumes (some sent twice). Zero events lost, every terminal exactly once,
nothing leaked, memory level after warm-up."""

from __future__ import annotations

import pytest

from duplex_actors.bench import soak


@pytest.mark.slow
def test_soak_short_form_loses_nothing_and_leaks_nothing():
    report = soak.run(sessions=200, seconds=20, seed=1, journal_max_age_s=8.0)
    print(soak.summary(report))
    c = report["counts"]
    assert report["events_lost"] == 0, report["errors"]
    assert c.get("session_closed_not_once", 0) == 0
    assert c.get("responses_without_one_done", 0) == 0
    assert c.get("duplicate_response_done", 0) == 0
    assert c.get("unexpected_errors", 0) == 0, report["errors"]
    assert c.get("resume_conflicts", 0) == 0, report["errors"]
    # The run really did what it claims to exercise.
    assert c["barge_ins"] > 50 and c["detaches"] > 50 and c["resumes"] > 50
    assert c.get("wire_events_lost_in_transit", 0) > 0  # the journal had to replay something
    assert c["responses_completed"] > 500
    # Nothing leaked.
    assert report["sessions_open_at_end"] == 0
    assert report["engine_in_flight_at_end"] == 0 and report["engine_routes_at_end"] == 0
    assert report["engine_active_at_end"] == 0
    assert report["tasks_alive_at_end"] <= report["tasks_alive_at_start"]
    assert report["tasks_alive_after_shutdown"] == 1
    assert report["memory_flat"], report["rss_samples"]
    assert report["ok"]
