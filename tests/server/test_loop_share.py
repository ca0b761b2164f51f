"""LoopShare (server/loop_share.py): when the loop runs short, a client over its max-min fair
share waits; under capacity, or alone, nobody does; idle clients are forgotten."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.server.loop_share import LoopShare


def feed(share: LoopShare, tenant: str, rate: float, until: float, step: float = 0.01, start: float = 0.0):
    """Bill ``tenant`` ``rate`` seconds a second in frames every ``step``, ignoring waits."""
    t = start
    while t < until:
        share.bill(tenant, rate * step, t)
        t += step
    return t


def test_under_capacity_nobody_waits():
    share = LoopShare(0.5)
    feed(share, "a", 0.2, 5.0)
    feed(share, "b", 0.2, 5.0)
    assert share.bill("a", 0.002, 5.0) == 0.0 and share.bill("b", 0.002, 5.0) == 0.0
    assert share.share is None


def test_one_client_alone_is_never_held_back_however_much_it_takes():
    share = LoopShare(0.5)
    feed(share, "alone", 0.95, 5.0)
    assert share.rate("alone", 5.0) == pytest.approx(0.95, rel=0.05)
    assert share.bill("alone", 0.01, 5.0) == 0.0 and share.held_s == 0.0


def test_the_heavy_client_waits_down_to_its_fair_share_and_the_light_one_never_waits():
    share = LoopShare(0.5, window_s=1.0)
    t = 0.0
    while t < 5.0:
        share.bill("light", 0.001, t)  # 0.1 s a second
        share.bill("heavy", 0.009, t)  # 0.9 s a second
        t += 0.01
    # Max-min fair: the light one keeps its 0.1; the heavy one gets the rest of 0.5.
    assert share.share == pytest.approx(0.4, rel=0.05)
    assert share.bill("light", 0.001, t) == 0.0
    wait = share.bill("heavy", 0.009, t)
    assert wait == pytest.approx(math.log(share.rate("heavy", t) / 0.4), rel=0.05)


def test_waits_are_capped_and_idle_clients_are_forgotten():
    share = LoopShare(0.1, window_s=1.0, max_wait_s=0.3)
    share.bill("light", 0.01, 0.0)
    share.bill("heavy", 50.0, 0.0)  # the share is recomputed every 50 ms, not every frame
    assert share.bill("heavy", 0.01, 0.1) == 0.3  # far over its share: at most max_wait_s
    share.bill("x", 0.01, 60.0)  # a minute later both have decayed to nothing
    share.bill("x", 0.0, 60.1)
    assert len(share) == 1


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.sampled_from([0.1, 0.3, 0.5]),
    frame_s=st.sampled_from([0.0005, 0.002, 0.008]),
    light=st.floats(0.001, 0.05),
    readers=st.integers(1, 8),
)
def test_a_client_that_reads_whenever_allowed_gets_about_its_share_over_time(
    capacity, frame_s, light, readers
):
    # ``readers`` sessions of one client each read a frame of ``frame_s`` as soon as they are
    # allowed (back to back otherwise); another client bills ``light`` seconds a second. Over
    # 20 s the heavy client's handling stays near its fair share, not the whole loop.
    share = LoopShare(capacity, window_s=1.0)
    next_read = [0.0] * readers
    heavy = 0.0
    t, light_at = 0.0, 0.0
    while t < 20.0:
        i = min(range(readers), key=next_read.__getitem__)
        t = next_read[i]
        while light_at <= t:
            share.bill("light", light * 0.01, light_at)
            light_at += 0.01
        wait = share.bill("heavy", frame_s, t)
        heavy += frame_s if t >= 5.0 else 0.0
        # A single thread: the next frame anyone reads starts after this one's work.
        next_read[i] = t + frame_s + wait
        for j in range(readers):
            next_read[j] = max(next_read[j], t + frame_s)
    fair = capacity - min(light, capacity / 2)
    # The readers' waits end together, so the client overshoots by a frame per reader at most
    # per wait; well under the whole loop (1 s a second) either way.
    assert heavy / 15.0 <= fair * 1.25 + readers * frame_s * 2 + 0.01, (heavy / 15.0, fair)
