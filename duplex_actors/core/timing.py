"""The response timing ledger: TTFT, TTFP, TPOT, ITL, RTF and stop latency, sans-IO.

Rules (domain doc section 4), each enforced here and property-tested:

* request start of a model turn: while the turn is pending the latest accepted request (or
  unit) wins; once the response begins the start is *bound* and nothing moves it; a request of
  a stale epoch never owns the start.
* per-turn start entries are *pruned* when a model turn completes (entries for turns <= t go).
* the whole ledger is *reset* on end of response, on barge-in and on close, so nothing of an
  old response can leak into the next.
* TPOT weights a segment of n tokens by max(n - 1, 0): one token has no interval.
* every figure names its ``source``: ``server`` (runtime clock, from the server's request
  start) or ``engine:<name>`` (figures the engine measured itself). A client that can only use
  its own receive clock must say ``client``; nothing here falls back silently.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from .engine_io import EngineMetrics
from .fence import Fence

SERVER = "server"
CLIENT = "client"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


@attrs.frozen(slots=True)
class ResponseMetrics:
    """One response's timing: TTFT, TTFP, TPOT, ITL, RTF and stop latency in ms, with the ``source``
    that measured them (server clock, or the engine's own).
    """

    response_id: str
    turn_id: int
    source: str
    ttft_ms: float | None = None
    ttfp_ms: float | None = None
    tpot_ms: float | None = None
    token_count: int = 0
    itl_ms: tuple[float, ...] = ()
    audio_ms: float = 0.0
    rtf: float | None = None
    stop_latency_ms: float | None = None
    #: Figures the engine reported about this response's window, with their own source.
    engine_source: str | None = None
    engine_ttft_ms: float | None = None
    engine_tpot_ms: float | None = None

    def to_wire(self) -> dict[str, Any]:
        # Spelled out: attrs.asdict walks the fields generically, many times slower (a first
        # delta and every response.done carry metrics). The test in
        # tests/core/test_timing_ledger.py keeps this in step with the fields.
        return {
            "response_id": self.response_id,
            "turn_id": self.turn_id,
            "source": self.source,
            "ttft_ms": self.ttft_ms,
            "ttfp_ms": self.ttfp_ms,
            "tpot_ms": self.tpot_ms,
            "token_count": self.token_count,
            "itl_ms": list(self.itl_ms),
            "audio_ms": self.audio_ms,
            "rtf": self.rtf,
            "stop_latency_ms": self.stop_latency_ms,
            "engine_source": self.engine_source,
            "engine_ttft_ms": self.engine_ttft_ms,
            "engine_tpot_ms": self.engine_tpot_ms,
        }


@attrs.frozen(slots=True)
class Summary:
    """Count, mean and percentiles (p50, p90, p99) of a set of timings; None where there were none."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Iterable[float]) -> Summary:
        xs = sorted(v for v in values if v is not None)
        if not xs:
            return cls(0, None, None, None, None)
        return cls(
            len(xs), sum(xs) / len(xs), nearest_rank(xs, 50), nearest_rank(xs, 90), nearest_rank(xs, 99)
        )


def nearest_rank(sorted_values: Sequence[float], percentile: float) -> float:
    """Nearest-rank percentile: the smallest value with at least p% of values at or below it."""
    if not sorted_values:
        raise ValueError("no values")
    rank = max(1, math.ceil(percentile / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


def weighted_tpot(segments: Iterable[tuple[float | None, int]]) -> float | None:
    """Mean time per output token across segments ``(mean inter-token time, n tokens)``.

    A segment contributes with weight max(n - 1, 0), so a one-token segment (no interval) cannot
    skew the mean: sum(t * (n - 1)) / sum(n - 1).
    """
    num = den = 0.0
    for mean_t, n in segments:
        w = max(n - 1, 0)
        if w and mean_t is not None:
            num += mean_t * w
            den += w
    return num / den if den else None


class _ActiveResponse:
    """Timing of the one response currently running (bound request start)."""

    __slots__ = (
        "response_id",
        "turn_id",
        "start",
        "first_text",
        "first_audio",
        "last_token",
        "tokens",
        "itl",
        "audio_s",
        "last_audio",
        "engine",
    )

    def __init__(self, response_id: str, turn_id: int, start: float | None) -> None:
        self.response_id = response_id
        self.turn_id = turn_id
        self.start = start
        self.first_text: float | None = None
        self.first_audio: float | None = None
        self.last_token: float | None = None
        self.tokens = 0
        self.itl: list[float] = []
        self.audio_s = 0.0
        self.last_audio: float | None = None
        self.engine: EngineMetrics | None = None


class TimingLedger:
    """Per-session timing state. Cheap when idle: two empty slots."""

    __slots__ = ("_starts", "_active")

    def __init__(self) -> None:
        self._starts: dict[int, tuple[int, float]] | None = None  # turn -> (epoch, start)
        self._active: _ActiveResponse | None = None

    # -- request start ----------------------------------------------------------------------

    def note_request_start(self, fence: Fence, now: float, current_epoch: int) -> bool:
        """Record that the engine accepted a request for ``fence.turn_id`` at ``now``.

        Returns whether the entry was taken: a stale epoch or an already bound turn is ignored.
        """
        if fence.epoch < current_epoch:
            return False
        if self._active is not None and self._active.turn_id == fence.turn_id:
            return False
        if self._starts is None:
            self._starts = {}
        previous = self._starts.get(fence.turn_id)
        if previous is not None and previous[0] > fence.epoch:
            return False
        self._starts[fence.turn_id] = (fence.epoch, now)
        return True

    def pending_start(self, turn_id: int) -> float | None:
        entry = self._starts.get(turn_id) if self._starts else None
        return None if entry is None else entry[1]

    def bind(self, turn_id: int, response_id: str, now: float) -> float | None:
        """The response began at ``now``: fix its request start, the one noted for the turn.

        With none noted the start stays unknown (None) and so do TTFT, TTFP and RTF: measuring
        from ``now`` would label a figure from the wrong origin ``source="server"``."""
        start = self.pending_start(turn_id)
        self._active = _ActiveResponse(response_id, turn_id, start)
        return start

    @property
    def bound_start(self) -> float | None:
        return None if self._active is None else self._active.start

    # -- outputs ----------------------------------------------------------------------------

    def on_text(self, now: float, token_count: int) -> bool:
        """Count streamed text; returns True when this was the first non-empty text (TTFT)."""
        a = self._active
        if a is None or token_count <= 0:
            return False
        first = a.first_text is None
        if first:
            a.first_text = now
            a.itl.extend([0.0] * (token_count - 1))
        else:
            assert a.last_token is not None  # set with the first token
            gap = (now - a.last_token) / token_count
            a.itl.extend([gap] * token_count)
        a.last_token = now
        a.tokens += token_count
        return first

    def on_audio(self, now: float, duration_s: float) -> bool:
        """Count produced audio; returns True for the first packet (TTFP)."""
        a = self._active
        if a is None:
            return False
        first = a.first_audio is None
        if first:
            a.first_audio = now
        a.audio_s += duration_s
        a.last_audio = now
        return first

    def on_engine_metrics(self, window: EngineMetrics) -> None:
        if self._active is not None:
            self._active.engine = window

    def snapshot(self, *, stop_latency_s: float | None = None) -> ResponseMetrics | None:
        a = self._active
        if a is None:
            return None
        # itl always holds tokens - 1 intervals, so its mean is the per-response TPOT.
        # Seconds become ms inline (not through _ms): a response takes several snapshots.
        itl = a.itl
        tpot_ms = sum(itl) / len(itl) * 1000.0 if itl else None
        start = a.start
        rtf = None
        if a.audio_s > 0 and a.last_audio is not None and start is not None:
            rtf = (a.last_audio - start) / a.audio_s
        eng = a.engine
        engine_tpot = None
        if eng is not None and eng.inter_token_s:
            engine_tpot = _ms(sum(eng.inter_token_s) / len(eng.inter_token_s))
        return ResponseMetrics(
            response_id=a.response_id,
            turn_id=a.turn_id,
            source=SERVER,
            ttft_ms=None if a.first_text is None or start is None else (a.first_text - start) * 1000.0,
            ttfp_ms=None if a.first_audio is None or start is None else (a.first_audio - start) * 1000.0,
            tpot_ms=tpot_ms,
            token_count=a.tokens,
            itl_ms=tuple([x * 1000.0 for x in itl]),  # a list first: no generator to resume per token
            audio_ms=a.audio_s * 1000.0,
            rtf=rtf,
            stop_latency_ms=None if stop_latency_s is None else stop_latency_s * 1000.0,
            engine_source=None if eng is None else eng.source,
            engine_ttft_ms=None if eng is None else _ms(eng.first_token_s),
            engine_tpot_ms=engine_tpot,
        )

    # -- lifecycle --------------------------------------------------------------------------

    def prune(self, completed_turn: int) -> None:
        """A model turn completed: start entries for turns <= it go."""
        if self._starts:
            for turn in [t for t in self._starts if t <= completed_turn]:
                del self._starts[turn]
            if not self._starts:
                self._starts = None

    def reset(self) -> None:
        self._starts = None
        self._active = None

    @property
    def is_empty(self) -> bool:
        return not self._starts and self._active is None


class CumulativeWindow:
    """Turns an engine's cumulative per-request figures into per-response windows.

    A long-lived engine request may serve many responses; its figures (token count, inter-token
    latencies) then grow for its whole life. The cursor remembers where the previous response
    stopped so each response reports only its own part, never the running total.
    """

    __slots__ = ("_cursor",)

    def __init__(self) -> None:
        self._cursor: dict[str, tuple[int, int]] = {}

    def window(self, request_id: str, cumulative: EngineMetrics) -> EngineMetrics:
        tokens0, itl0 = self._cursor.get(request_id, (0, 0))
        self._cursor[request_id] = (cumulative.token_count, len(cumulative.inter_token_s))
        first = cumulative.first_token_s if tokens0 == 0 else None
        return EngineMetrics(
            source=cumulative.source,
            first_token_s=first,
            token_count=max(cumulative.token_count - tokens0, 0),
            inter_token_s=tuple(cumulative.inter_token_s[itl0:]),
        )

    def forget(self, request_id: str) -> None:
        self._cursor.pop(request_id, None)

    def clear(self) -> None:
        self._cursor.clear()

    def __len__(self) -> int:
        return len(self._cursor)
