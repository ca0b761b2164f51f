"""Property tests of the timing ledger: TPOT weighting, request-start binding, pruning, reset,
and the cumulative-metrics window."""

import math

from hypothesis import given
from hypothesis import strategies as st

from duplex_actors.core.engine_io import EngineMetrics
from duplex_actors.core.fence import Fence
from duplex_actors.core.timing import (
    CumulativeWindow,
    Summary,
    TimingLedger,
    nearest_rank,
    weighted_tpot,
)

times = st.floats(min_value=0.0001, max_value=0.5, allow_nan=False)


@given(st.lists(st.tuples(times, st.integers(0, 50)), max_size=20))
def test_weighted_tpot_equals_mean_over_all_real_intervals(segments):
    # Expand each segment into its n - 1 intervals and average them all: that is the definition.
    intervals = [t for t, n in segments for _ in range(max(n - 1, 0))]
    got = weighted_tpot(segments)
    if not intervals:
        assert got is None
    else:
        assert math.isclose(got, sum(intervals) / len(intervals), rel_tol=1e-9)


@given(st.lists(st.tuples(times, st.integers(2, 50)), min_size=1, max_size=10), times)
def test_one_token_segments_never_skew_tpot(segments, wild):
    assert weighted_tpot(segments + [(wild * 1000, 1), (None, 0)]) == weighted_tpot(segments)


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=200), st.sampled_from([50, 90, 99]))
def test_nearest_rank(values, p):
    xs = sorted(values)
    r = nearest_rank(xs, p)
    assert r in xs
    at_or_below = sum(1 for x in xs if x <= r)
    assert at_or_below / len(xs) >= p / 100
    smaller = [x for x in xs if x < r]
    assert len(smaller) / len(xs) < p / 100
    s = Summary.of(values)
    assert s.count == len(values) and s.p50 <= s.p90 <= s.p99


@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 100, allow_nan=False)), min_size=1, max_size=20))
def test_latest_accepted_request_wins_while_pending(notes):
    ledger = TimingLedger()
    current_epoch = max(e for e, _ in notes)
    latest = None
    for epoch, t in notes:
        took = ledger.note_request_start(Fence("s", epoch, 0), t, current_epoch)
        assert took == (epoch >= current_epoch)
        if took:
            latest = t
    assert ledger.pending_start(0) == latest


@given(st.floats(0, 100), st.floats(0, 100), st.floats(0, 100))
def test_start_is_bound_at_response_begin(t_request, t_begin, t_late):
    ledger = TimingLedger()
    ledger.note_request_start(Fence("s", 0, 0), t_request, 0)
    assert ledger.bind(0, "r", t_begin) == t_request
    assert not ledger.note_request_start(Fence("s", 0, 0), t_late, 0)
    assert ledger.bound_start == t_request


def test_stale_epoch_never_owns_the_start():
    ledger = TimingLedger()
    ledger.note_request_start(Fence("s", 2, 0), 5.0, 2)
    assert not ledger.note_request_start(Fence("s", 1, 0), 9.0, 2)
    assert ledger.pending_start(0) == 5.0


@given(st.sets(st.integers(0, 20), min_size=1), st.integers(0, 20))
def test_prune_drops_turns_up_to_the_completed_one(turns, done):
    ledger = TimingLedger()
    for t in turns:
        ledger.note_request_start(Fence("s", 0, t), float(t), 0)
    ledger.prune(done)
    for t in turns:
        assert (ledger.pending_start(t) is None) == (t <= done)


@given(st.lists(st.tuples(times, st.integers(1, 4)), min_size=1, max_size=30), st.floats(0, 1))
def test_ttft_once_never_negative_and_reset_empties(deltas, start):
    ledger = TimingLedger()
    ledger.note_request_start(Fence("s", 0, 0), start, 0)
    ledger.bind(0, "r", start + 0.01)
    now = start + 0.01
    firsts = 0
    for gap, n in deltas:
        now += gap
        firsts += ledger.on_text(now, n)
    assert firsts == 1
    m = ledger.snapshot()
    assert m.ttft_ms is not None and m.ttft_ms >= 0
    assert m.token_count == sum(n for _, n in deltas)
    assert len(m.itl_ms) == m.token_count - 1
    assert all(x >= 0 for x in m.itl_ms)
    ledger.reset()
    assert ledger.is_empty and ledger.snapshot() is None


@given(st.lists(st.tuples(st.integers(0, 20), st.lists(times, max_size=10)), min_size=1, max_size=8))
def test_cumulative_window_never_reports_the_running_total(responses):
    """An engine request serving several responses reports cumulative figures; each response's
    window must hold only its own tokens and intervals, and the windows add up to the total."""
    window = CumulativeWindow()
    total_tokens, total_itl = 0, []
    seen_tokens, seen_itl = 0, []
    for tokens, itl in responses:
        total_tokens += tokens
        total_itl += itl
        w = window.window("req", EngineMetrics("engine:x", 0.1, total_tokens, tuple(total_itl)))
        assert w.token_count == tokens
        assert list(w.inter_token_s) == itl
        seen_tokens += w.token_count
        seen_itl += list(w.inter_token_s)
    assert seen_tokens == total_tokens and seen_itl == total_itl


@given(times, st.lists(st.tuples(times, st.floats(0.01, 0.5)), min_size=1, max_size=12), times)
def test_no_noted_request_start_means_no_server_figures_never_a_fabricated_one(begin, packets, text_gap):
    ledger = TimingLedger()  # nothing noted: the response began with no known request start
    assert ledger.bind(0, "r", begin) is None
    assert ledger.bound_start is None
    now = begin
    for gap, duration in packets:
        now += gap
        ledger.on_audio(now, duration)
    ledger.on_text(now + text_gap, 3)
    m = ledger.snapshot()
    assert m.source == "server"
    assert m.ttft_ms is None and m.ttfp_ms is None and m.rtf is None
    assert m.audio_ms > 0 and m.token_count == 3  # what does not depend on the start stays


@given(times, st.lists(st.tuples(times, st.floats(0.01, 0.5)), min_size=1, max_size=12))
def test_rtf_spans_from_the_request_start_to_the_last_audio_packet(start, packets):
    ledger = TimingLedger()
    ledger.note_request_start(Fence("s", 0, 0), start, 0)
    ledger.bind(0, "r", start + 0.001)
    now = start + 0.001
    for gap, duration in packets:
        now += gap
        ledger.on_audio(now, duration)
    produced = sum(d for _, d in packets)
    m = ledger.snapshot()
    assert math.isclose(m.rtf, (now - start) / produced, rel_tol=1e-9)
    assert math.isclose(m.audio_ms, produced * 1000.0, rel_tol=1e-9)


def test_metrics_on_the_wire_name_every_field_with_its_value():
    """to_wire is spelled out for speed: a field added to ResponseMetrics must be added there."""
    import attrs

    from duplex_actors.core.timing import ResponseMetrics

    # Distinct non-default values, so a field copied from the wrong attribute shows.
    values = {}
    for i, field in enumerate(attrs.fields(ResponseMetrics)):
        if field.name == "itl_ms":
            values[field.name] = (1.5, 2.5)
        elif field.type in ("int", int):
            values[field.name] = 100 + i
        elif field.type in ("str", "str | None", str):
            values[field.name] = f"v{i}"
        else:
            values[field.name] = 0.25 + i
    m = ResponseMetrics(**values)
    expected = {k: (list(v) if isinstance(v, tuple) else v) for k, v in attrs.asdict(m).items()}
    assert m.to_wire() == expected
    assert list(m.to_wire()) == [f.name for f in attrs.fields(ResponseMetrics)]
