"""Decode steps launched ahead of the host's bookkeeping (BatchScheduler._chain): on a GPU the
next step is computed from the last one's tokens while the host reads them. Run here on the
device path pointed at the CPU: every request must get what one step at a time gives it."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from duplex_actors.core.engine_io import SamplingOverrides, TextDelta, TurnDone, TurnKind  # noqa: E402
from duplex_actors.engines.embedded import EmbeddedThinker, SamplingParams, SlotReleased, ThinkerConfig  # noqa: E402
from duplex_actors.engines.embedded.vocab import default_vocabulary  # noqa: E402

from .helpers import request  # noqa: E402

pytestmark = pytest.mark.embedded

#: Different lengths, so rows end at different steps inside a chain; a min_tokens below most so
#: some end on the end token; unit turns (a decision first) among them.
TURNS = [
    (TurnKind.RESPONSE, 5),
    (TurnKind.RESPONSE, 9),
    (TurnKind.UNIT, 12),
    (TurnKind.RESPONSE, 14),
    (TurnKind.RESPONSE, 30),
    (TurnKind.RESPONSE, 21),
    (TurnKind.UNIT, 30),
    (TurnKind.RESPONSE, 3),
]


def _audio(seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(8000, generator=gen) * 3000).to(torch.int16).numpy().astype("<i2").tobytes()


async def _started(min_tokens: int, lookahead: bool) -> EmbeddedThinker:
    """A started engine of the model's own size (a small one says the same words whatever it
    hears), float32 throughout (a row's logits then do not depend on which rows share its
    step); ``lookahead``: on the device path, pointed at the CPU, with steps run ahead."""
    config = ThinkerConfig(vocab_size=len(default_vocabulary()), dense_low_precision_from_rows=None)
    engine = EmbeddedThinker(
        config,
        defaults=SamplingParams(temperature=0.0, max_tokens=30, min_tokens=min_tokens),
        max_concurrency=8,
        dispatch_interval_s=0.05,  # long chains: a chain ends at the dispatch interval
    )
    await engine.start()
    assert engine.model is not None and engine.scheduler is not None
    if lookahead:
        engine.model._on_cpu = False
        engine.scheduler._device = torch.device("cpu")
        engine.scheduler.lookahead = True
    return engine


async def _answers(lookahead: bool) -> tuple[list[tuple[str, int, str]], int]:
    engine = await _started(6, lookahead)
    assert engine.scheduler is not None
    try:

        async def one(i: int, kind: TurnKind, max_tokens: int) -> tuple[str, int, str]:
            asked = request(
                f"sess_{i}",
                kind=kind,
                unit=0,
                audio=_audio(i),
                sampling=SamplingOverrides(max_tokens=max_tokens),
            )
            outs = [o async for o in engine.generate(asked)]
            text = "".join(o.text for o in outs if isinstance(o, TextDelta))
            count = sum(o.token_count for o in outs if isinstance(o, TextDelta))
            end = outs[-1]
            return text, count, end.reason if isinstance(end, TurnDone) else type(end).__name__

        answers = await asyncio.gather(*(one(i, kind, m) for i, (kind, m) in enumerate(TURNS)))
        return list(answers), engine.scheduler.stats().steps_ahead
    finally:
        await engine.aclose()


def test_steps_launched_ahead_give_every_request_what_single_steps_give():
    plain, none_ahead = asyncio.run(_answers(lookahead=False))
    ahead, launched = asyncio.run(_answers(lookahead=True))
    assert none_ahead == 0 and launched > 0, "no step was launched ahead"
    assert ahead == plain
    # The turns really end in different ways and at different lengths inside the chains.
    assert {reason for _, _, reason in plain} >= {"length", "completed"}, plain
    assert len({count for _, count, _ in plain}) >= 4, plain  # ends at several different steps


def test_a_step_failing_after_a_row_ended_inside_a_chain_ends_each_request_once():
    """The step launched ahead fails after a row of the chain has ended (and got its ending):
    that row keeps its one ending, the others fail, and the engine goes on serving."""
    from duplex_actors.core.engine_io import EngineFailure

    async def main():
        engine = await _started(30, lookahead=True)
        scheduler = engine.scheduler
        assert scheduler is not None
        state = {"in_chain": False, "ended_in_chain": False, "failed": False}
        chain, account, host_values = scheduler._chain, scheduler._account, scheduler._host_values

        def chain_(*args, **kwargs):
            state["in_chain"] = True
            try:
                return chain(*args, **kwargs)
            finally:
                state["in_chain"] = False

        def account_(*args, **kwargs):
            finished, reasons, record = account(*args, **kwargs)
            if state["in_chain"] and finished:
                state["ended_in_chain"] = True
            return finished, reasons, record

        def host_values_(copy):
            if state["ended_in_chain"] and not state["failed"]:
                state["failed"] = True
                raise RuntimeError("device lost")
            return host_values(copy)

        scheduler._chain, scheduler._account, scheduler._host_values = chain_, account_, host_values_
        released: dict[str, list[str]] = {}
        scheduler.add_observer(
            lambda r: (
                released.setdefault(r.request_id, []).append(r.reason)
                if isinstance(r, SlotReleased)
                else None
            )
        )
        try:

            async def one(i: int, max_tokens: int) -> list:
                asked = request(
                    f"sess_{i}", audio=_audio(i), sampling=SamplingOverrides(max_tokens=max_tokens)
                )
                return [o async for o in engine.generate(asked)]

            first = await asyncio.gather(*(one(i, m) for i, m in enumerate((4, 20, 25))))
            after = await one(9, 6)
        finally:
            await engine.aclose()
        return first, after, state, released

    first, after, state, released = asyncio.run(main())
    assert state["failed"], "the chain never failed after a row ended"
    terminals = [[o for o in outs if isinstance(o, (TurnDone, EngineFailure))] for outs in first]
    assert all(len(t) == 1 and outs[-1] is t[0] for t, outs in zip(terminals, first)), terminals
    assert isinstance(first[0][-1], TurnDone) and first[0][-1].reason == "length"
    assert all(isinstance(outs[-1], EngineFailure) for outs in first[1:]), [o[-1] for o in first]
    assert isinstance(after[-1], TurnDone)
    # The scheduler's own account: each slot released once, the ended row for its own reason
    # (released as "failed" too, it had been given a second ending).
    ended = first[0][-1].request_id
    assert released[ended] == ["length"], released
    assert all(len(reasons) == 1 for reasons in released.values()), released
