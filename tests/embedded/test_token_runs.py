"""How the embedded backend turns the scheduler's token runs into engine outputs.

The scheduler hands each request's tokens over as one TokenRun per dispatch. These drive the
real backend (EmbeddedThinker.generate, a started test-size engine) with scripted runs in
place of its scheduler's, so that the shapes a busy scheduler makes rarely (a unit's decision
and its first words in one run, runs queued behind each other) are pinned down too."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")

from duplex_actors.core.engine_io import Decision, EngineFailure, TextDelta, TurnDone, TurnKind
from duplex_actors.engines.embedded.scheduler import SequenceEnded, TokenRun

from .helpers import request, run, small_engine

pytestmark = pytest.mark.embedded


async def _outputs(kind: TurnKind, dispatches) -> tuple[list, object]:
    """The outputs of one request whose scheduler delivers ``dispatches(rid, vocab)``: a list
    of dispatches, each a list of events handed over together."""
    engine = small_engine()
    thinker = engine.thinker
    await engine.start()
    try:
        loop = asyncio.get_running_loop()
        req = request("sess_runs", kind=kind, unit=0 if kind is TurnKind.UNIT else None)

        def submit(job, sink) -> None:
            for i, batch in enumerate(dispatches(job.request_id, thinker.vocab)):
                loop.call_later(0.002 * (i + 1), lambda batch=batch: [sink(event) for event in batch])

        thinker.scheduler.submit = submit
        return [out async for out in thinker.generate(req)], thinker.vocab
    finally:
        await engine.aclose()


def _run(rid: str, ids: list[int], first_step: int) -> TokenRun:
    return TokenRun(rid, ids, first_step, [0.001 * (first_step + i) for i in range(len(ids))])


def test_a_units_decision_and_its_first_words_in_one_run():
    def dispatches(rid, v):
        words = [v.speak, v.id("the"), v.id("was")]
        return [[_run(rid, words, 1), SequenceEnded(rid, "length", 3, 0.01)]]

    outputs, v = run(_outputs(TurnKind.UNIT, dispatches))
    kinds = [type(o) for o in outputs]
    assert kinds == [Decision, TextDelta, TurnDone]
    assert outputs[0].speak is True
    delta = outputs[1]
    assert (delta.text, delta.token_count) == (v.detokenize([v.id("the"), v.id("was")]), 2)
    assert delta.produced_at == pytest.approx(0.002)  # the first word's, not the decision's
    assert outputs[2].metrics.token_count == 2


def test_a_unit_that_listens_ends_at_its_decision():
    def dispatches(rid, v):
        return [[_run(rid, [v.listen], 1), SequenceEnded(rid, "listen", 1, 0.01)]]

    outputs, _ = run(_outputs(TurnKind.UNIT, dispatches))
    assert [type(o) for o in outputs] == [Decision] and outputs[0].speak is False


def test_runs_queued_behind_each_other_go_out_as_one_delta():
    def dispatches(rid, v):
        the, was, told, dot = v.id("the"), v.id("was"), v.id("told"), v.id(".")
        # The first word alone; then two runs that reach the consumer together.
        return [
            [_run(rid, [the], 1)],
            [_run(rid, [was, told], 2), _run(rid, [dot], 4)],
            [SequenceEnded(rid, "eos", 5, 0.01)],
        ]

    outputs, v = run(_outputs(TurnKind.RESPONSE, dispatches))
    assert [type(o) for o in outputs] == [Decision, TextDelta, TextDelta, TurnDone]
    first, rest = outputs[1], outputs[2]
    assert (first.text, first.token_count) == (v.detokenize([v.id("the")]), 1)
    assert (rest.token_count, first.text + rest.text) == (
        3,
        v.detokenize([v.id("the"), v.id("was"), v.id("told"), v.id(".")]),
    )
    done = outputs[3]
    assert done.reason == "completed" and done.metrics.token_count == 4
    assert done.metrics.inter_token_s == pytest.approx((0.001, 0.001, 0.001))


def test_an_ending_after_held_tokens_still_delivers_them_first():
    def dispatches(rid, v):
        return [[_run(rid, [v.id("the"), v.id("was")], 1), SequenceEnded(rid, "failed", 2, 0.01, "boom")]]

    outputs, _ = run(_outputs(TurnKind.RESPONSE, dispatches))
    assert [type(o) for o in outputs] == [Decision, TextDelta, EngineFailure]
    assert outputs[1].token_count == 2 and "boom" in outputs[2].message
