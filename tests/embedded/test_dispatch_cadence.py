"""When the scheduler's worker wakes the event loop: at once for joins and endings, and
otherwise at most every ``dispatch_interval_s`` (each wake costs the decode loop GIL time).

These drive :class:`BatchScheduler` directly, with a recording ``dispatch`` and no event loop,
so what is counted is exactly the worker's calls."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

from duplex_actors.engines.embedded import SamplingParams, Thinker, ThinkerConfig
from duplex_actors.engines.embedded.adapter import WordThinkerAdapter
from duplex_actors.engines.embedded.scheduler import BatchScheduler, DecodeJob, SequenceEnded, TokenRun
from duplex_actors.engines.embedded.thinker_backend import output_prior
from duplex_actors.engines.embedded.vocab import default_vocabulary

from .helpers import request

pytestmark = pytest.mark.embedded

TOKENS = 30
LONG = SamplingParams(temperature=0.0, max_tokens=TOKENS, min_tokens=TOKENS)
VERY_LONG = SamplingParams(temperature=0.0, max_tokens=150, min_tokens=150)


class Recorder:
    """The scheduler's dispatch: keeps every call's events, in order."""

    def __init__(self, expect_ends: int = 1) -> None:
        self.calls: list[list[tuple[object, object]]] = []
        self.ended = threading.Event()
        self.expect_ends = expect_ends

    def __call__(self, batch) -> None:
        self.calls.append(list(batch))
        if sum(type(ev) is SequenceEnded for call in self.calls for _, ev in call) >= self.expect_ends:
            self.ended.set()

    def events(self, request_id: str) -> list:
        return [ev for call in self.calls for _, ev in call if ev.request_id == request_id]


def _steps(events) -> list[int]:
    """The step of every token in ``events``, in order (a run's tokens are consecutive steps)."""
    return [run.first_step + i for run in events if type(run) is TokenRun for i in range(len(run.token_ids))]


def _tokens_in(call) -> int:
    return sum(len(ev.token_ids) for _, ev in call if type(ev) is TokenRun)


@pytest.fixture(scope="module")
def parts():
    vocab = default_vocabulary()
    config = ThinkerConfig(vocab_size=len(vocab), d_model=64, n_layers=2, n_heads=2, d_ff=128, max_slots=4)
    return Thinker(config, output_prior(vocab)), vocab, WordThinkerAdapter(config, vocab, LONG)


@contextlib.contextmanager
def _running(parts, recorder: Recorder, interval: float) -> Iterator[BatchScheduler]:
    model, vocab, _ = parts
    scheduler = BatchScheduler(model, vocab, recorder, max_concurrency=4, dispatch_interval_s=interval)
    scheduler.start()
    try:
        yield scheduler
    finally:
        scheduler.close()


def _job(parts, session: str, params: SamplingParams = LONG) -> DecodeJob:
    adapter = parts[2]
    req = request(session)
    return DecodeJob(req.request_id, lambda: adapter.build_prompt(req), params)


def _wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _complete(events: list) -> bool:
    runs = [e for e in events if type(e) is TokenRun]
    ends = [e for e in events if type(e) is SequenceEnded]
    tokens = sum(len(run.token_ids) for run in runs)
    times = all(len(run.produced_at) == len(run.token_ids) for run in runs)
    return tokens == TOKENS and times and len(ends) == 1 and events[-1] is ends[0]


def _one_request(parts, interval: float) -> Recorder:
    """Run one request alone to its end; what the scheduler dispatched."""
    recorder = Recorder()
    with _running(parts, recorder, interval) as scheduler:
        scheduler.submit(_job(parts, "sess_a"), lambda _e: None)
        assert recorder.ended.wait(30)
    return recorder


def test_a_running_response_is_held_between_its_first_token_and_its_end(parts):
    recorder = _one_request(parts, interval=60.0)
    events = recorder.events("sess_a/e0/t0")
    assert _complete(events)
    # The admission step's first token at once, then everything else with the ending: one
    # run of tokens and the ending.
    assert [_tokens_in(call) for call in recorder.calls] == [1, TOKENS - 1]
    assert [len(call) for call in recorder.calls] == [1, 2]
    steps = _steps(events)
    assert steps == list(range(steps[0], steps[0] + TOKENS))


def test_interval_zero_wakes_the_loop_every_step(parts):
    recorder = _one_request(parts, interval=0.0)
    assert _complete(recorder.events("sess_a/e0/t0"))
    # TOKENS steps; the last one carries its token and the ending.
    assert len(recorder.calls) == TOKENS


def test_a_join_and_an_ending_each_go_out_at_once(parts):
    recorder = Recorder(expect_ends=2)
    with _running(parts, recorder, 60.0) as scheduler:
        scheduler.submit(_job(parts, "sess_a"), lambda _e: None)
        # Wait for sess_a's first dispatch, then let sess_b join while sess_a is mid-response.
        assert _wait_until(lambda: bool(recorder.calls))
        scheduler.submit(_job(parts, "sess_b"), lambda _e: None)
        assert recorder.ended.wait(30)
    a, b = recorder.events("sess_a/e0/t0"), recorder.events("sess_b/e0/t0")
    assert _complete(a) and _complete(b)
    # sess_b's first token left in the call of the step that admitted it, and that call also
    # flushed whatever sess_a had produced since its own first token.
    join = next(i for i, call in enumerate(recorder.calls) if any(ev is b[0] for _, ev in call))
    held_a = [ev for _, ev in recorder.calls[join] if ev.request_id == "sess_a/e0/t0"]
    assert held_a and _steps(held_a)[-1] == _steps(b)[0]
    # sess_a ends first (it started first), and its ending goes out from the step that ended
    # it: nothing from a later step is in that call, and sess_b's ending comes in a later one.
    end_a = next(i for i, call in enumerate(recorder.calls) if any(ev is a[-1] for _, ev in call))
    assert all(step <= a[-1].step for step in _steps(ev for _, ev in recorder.calls[end_a]))
    assert any(ev is b[-1] for _, ev in recorder.calls[-1]) and end_a < len(recorder.calls) - 1


def test_cancel_and_close_flush_held_tokens_before_the_ending(parts):
    recorder = Recorder(expect_ends=2)
    with _running(parts, recorder, 60.0) as scheduler:
        scheduler.submit(_job(parts, "sess_a"), lambda _e: None)
        # sess_b is long enough to be live still when the scheduler closes.
        scheduler.submit(_job(parts, "sess_b", VERY_LONG), lambda _e: None)
        assert _wait_until(lambda: scheduler.stats().steps >= 5)
        scheduler.cancel("sess_a/e0/t0")
        assert _wait_until(lambda: any(type(e) is SequenceEnded for e in recorder.events("sess_a/e0/t0")))
    final_step = scheduler.stats().steps
    a, b = recorder.events("sess_a/e0/t0"), recorder.events("sess_b/e0/t0")
    # What sess_b made after sess_a's ending was held; closing still delivered all of it.
    assert _steps(b)[-1] == final_step
    for events, reason in ((a, "aborted"), (b, "closed")):
        ends = [e for e in events if type(e) is SequenceEnded]
        assert [e.reason for e in ends] == [reason]
        assert events[-1] is ends[0]
        steps = _steps(events)
        assert len(steps) >= 5  # every step's token reached dispatch before the ending
        assert steps == list(range(steps[0], steps[0] + len(steps)))


def test_a_negative_interval_is_refused(parts):
    model, vocab, _ = parts
    with pytest.raises(ValueError, match="dispatch_interval_s"):
        BatchScheduler(model, vocab, Recorder(), max_concurrency=4, dispatch_interval_s=-1.0)


def test_a_negative_share_of_the_queue_is_refused(parts):
    model, vocab, _ = parts
    with pytest.raises(ValueError, match="max_queue_per_tenant"):
        BatchScheduler(model, vocab, Recorder(), max_concurrency=4, max_queue_per_tenant=-1)
