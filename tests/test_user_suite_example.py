"""A user's test suite, as docs/testing.md shows it: the testing kit's state machines pointed at
deliberately broken engines and a broken session policy. Each test asserts that hypothesis
finds the break, so the kit itself is tested for being able to fail.

Shrinking is switched off here only to keep the suite fast; in your own suite leave it on and
hypothesis prints the shortest program that breaks your engine.
"""

from __future__ import annotations

import anyio
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import FlakyFailure
from hypothesis.stateful import run_state_machine_as_test

from duplex_actors import Decision, EngineCapabilities, TextDelta, TurnDone
from duplex_actors.testing import (
    CANCEL_RESPONSE,
    TRANSITIONS,
    RuntimeMachine,
    SessionCore,
    SessionCoreMachine,
    policy_chart,
    row,
)

FIND = settings(
    max_examples=150,
    deadline=None,
    stateful_step_count=30,
    database=None,
    phases=(Phase.generate,),
    suppress_health_check=list(HealthCheck),
)


def expect_break(machine, *messages: str) -> None:
    """Run ``machine``; require that hypothesis reports a failure mentioning one of ``messages``.

    A break that depends on timing may not reproduce on hypothesis' final replay; it is then
    reported as ``FlakyFailure`` carrying the original error, which counts as found too.
    """
    with pytest.raises((AssertionError, FlakyFailure)) as info:
        run_state_machine_as_test(machine, settings=FIND)
    text = str(info.value) + "".join(str(e) for e in getattr(info.value, "exceptions", ()))
    assert any(m in text for m in messages), f"hypothesis failed for another reason:\n{text}"


# --- a backend that keeps talking after it was aborted -----------------------------------------


class TalksAfterAbort:
    """Streams a reply, but shields its work from cancellation and ignores abort()."""

    name = "talks-after-abort"
    capabilities = EngineCapabilities(produces_audio=False)

    async def start(self):
        pass

    async def aclose(self):
        pass

    async def abort(self, request_id):
        pass  # bug 1: abort is ignored

    async def generate(self, request):
        rid = request.request_id
        yield Decision(rid, speak=True)
        for word in ("one", " two", " three", " four", " five", " six"):
            with anyio.CancelScope(shield=True):  # bug 2: cancellation cannot reach the stream
                await anyio.sleep(0.004)
            yield TextDelta(rid, word)
        yield TurnDone(rid)


class TalksAfterAbortMachine(RuntimeMachine):
    def make_engine(self):
        return TalksAfterAbort()


def test_hypothesis_finds_an_engine_that_talks_after_abort():
    expect_break(TalksAfterAbortMachine, "after abort()")


# --- a backend that never sends a terminal output ------------------------------------------------


class NeverFinishes:
    """Streams a reply and just stops: no TurnDone, no EngineFailure."""

    name = "never-finishes"
    capabilities = EngineCapabilities(produces_audio=False)

    async def start(self):
        pass

    async def aclose(self):
        pass

    async def abort(self, request_id):
        pass

    async def generate(self, request):
        rid = request.request_id
        yield Decision(rid, speak=True)
        yield TextDelta(rid, "hello")


class NeverFinishesMachine(RuntimeMachine):
    def make_engine(self):
        return NeverFinishes()


def test_hypothesis_finds_an_engine_that_never_sends_a_terminal():
    expect_break(NeverFinishesMachine, "stream ended without a terminal output")


# --- a session policy that forgets response.done on barge-in -------------------------------------


def chart_without_cancel_terminal():
    """The shipped chart, except that a barge-in no longer ends the response it interrupts."""
    rows = [r for r in TRANSITIONS if (r["trigger"], r["source"]) != ("barge_in", "responding")]
    rows.insert(
        0,
        row(
            "barge_in",
            "responding",
            "barge_in",
            [e for e in CANCEL_RESPONSE if e != "emit_response_cancelled"],
        ),
    )
    return policy_chart(rows)


class ForgetfulPolicyMachine(SessionCoreMachine):
    def make_core(self, session_id, config, clock):
        return SessionCore(session_id, config, clock, chart=chart_without_cancel_terminal())


def test_hypothesis_finds_a_barge_in_without_response_done():
    # Whichever check sees it first: the missing terminal, or the response left active.
    expect_break(
        ForgetfulPolicyMachine, "terminal events differ from the model", "active response: session has"
    )


# --- and the unbroken runtime passes the same machines ------------------------------------------


def test_the_shipped_scripted_engine_passes():
    run_state_machine_as_test(RuntimeMachine, settings=settings(FIND, max_examples=20))
