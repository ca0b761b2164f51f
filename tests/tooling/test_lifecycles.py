"""The documentary lifecycle charts hold to the code they describe: every step the real
EngineActor and the real Lease take is one the chart allows, landing where the chart says;
and the SCXML export of each chart, run by an independent interpreter, takes the same steps."""

from __future__ import annotations

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duplex_actors.actors.engine_actor import EngineActor
from duplex_actors.core.engine_io import (
    Aborted,
    AudioPacket,
    Decision,
    EngineFailure,
    ModelTurnRequest,
    TextDelta,
    TurnDone,
    TurnKind,
)
from duplex_actors.core.fence import Fence
from duplex_actors.core.lease import DISCONNECT_GRACE_EXPIRED, IDLE_TTL_EXPIRED, REPLAY_WINDOW_S, Lease
from duplex_actors.engines.scripted import Script, ScriptedEngine
from duplex_actors.errors import ResumeConflict
from duplex_actors.tooling import statechart_export as export
from duplex_actors.tooling.scxml import to_scxml

ENGINE = export.spec("engine_request")
LEASE = export.spec("lease")
RESTART_REASON = "test restart"
TERMINAL_STATE = {TurnDone: "completed", Aborted: "aborted", EngineFailure: "failed"}


def _interpreter(spec):
    from .scxml_runner import Interpreter  # skips when scjson is missing

    return Interpreter(to_scxml(spec))


# --- engine request ---------------------------------------------------------------------------


class NoTerminalEngine(ScriptedEngine):
    """A backend that forgets the terminal output: the actor has to synthesise one."""

    async def generate(self, request):
        async for output in super().generate(request):
            if isinstance(output, (TurnDone, EngineFailure)):
                return
            yield output


def _trigger(output, failure_cause: str) -> str:
    if isinstance(output, Decision) and not output.speak:
        return "listen"
    if isinstance(output, (Decision, TextDelta, AudioPacket)):
        return "output"
    if isinstance(output, TurnDone):
        return "turn_done"
    if isinstance(output, Aborted):
        return "abort"
    if output.message == "stream ended without a terminal output":
        return "stream_ended"
    if output.message == RESTART_REASON:
        return "restart"
    if output.message.startswith("EngineFailed:"):
        return "stream_raised"
    return "backend_failure"


scenarios = st.fixed_dictionaries(
    {
        "tokens": st.integers(0, 4),
        "packets": st.integers(0, 2),
        "fail_after": st.none() | st.integers(0, 4),
        "fail_mode": st.sampled_from(["output", "raise"]),
        "unit_listens": st.booleans(),
        "forget_terminal": st.booleans(),
        "interrupt": st.sampled_from([None, "abort", "restart"]),
        "interrupt_after": st.integers(0, 4),
    }
)


def run_request(sc) -> list:
    """One request through the real EngineActor; returns every output the session received."""
    script = Script(
        tokens=tuple("abcd"[: sc["tokens"]]),
        audio_packets=sc["packets"],
        packet_ms=20,
        fail_after=sc["fail_after"],
        fail_mode=sc["fail_mode"],
        speak=not sc["unit_listens"],
        token_latency_s=0.001 if sc["interrupt"] else 0.0,
        hang_after=sc["interrupt_after"] + 1 if sc["interrupt"] else None,
    )
    backend = (NoTerminalEngine if sc["forget_terminal"] else ScriptedEngine)(script)
    fence = Fence("sess_lifecycle0000000000", 0, 0)
    unit = sc["unit_listens"]
    request = ModelTurnRequest(
        request_id=fence.request_id(1 if unit else None),
        fence=fence,
        kind=TurnKind.UNIT if unit else TurnKind.RESPONSE,
        audio=b"\0\0" * 160,
    )
    received: list = []

    async def main():
        actor = EngineActor(backend)
        done = anyio.Event()

        def deliver(output):
            received.append(output)
            if len(received) == sc["interrupt_after"] + 1 and sc["interrupt"] == "abort":
                actor.abort([request.request_id])
            if isinstance(output, (TurnDone, EngineFailure, Aborted)) or (
                isinstance(output, Decision) and not output.speak
            ):
                done.set()

        async with anyio.create_task_group() as tg:
            await tg.start(actor.run)
            actor.submit(request, deliver)
            if sc["interrupt"] == "restart":
                with anyio.move_on_after(0.05):
                    while len(received) <= sc["interrupt_after"] and not done.is_set():
                        await anyio.sleep(0.001)
                if not done.is_set():
                    await actor.restart(RESTART_REASON)
            with anyio.fail_after(5):
                await done.wait()
            await anyio.sleep(0.01)  # anything after the terminal would arrive now
            tg.cancel_scope.cancel()

    anyio.run(main)
    return received


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios)
def test_engine_actor_follows_the_request_chart(sc):
    received = run_request(sc)
    state, path = ENGINE.initial, []
    for output in received:
        trigger = _trigger(output, "")
        edge = ENGINE.resolve(state, trigger, {})
        assert edge is not None, f"the chart refuses {trigger} in {state} (outputs: {received})"
        path.append(trigger)
        state = edge.dest
    # Exactly one terminal, and it is the last output: the chart's end states take nothing.
    assert state in ENGINE.absorbing, (state, received)
    last = received[-1]
    expected = "completed" if isinstance(last, Decision) else TERMINAL_STATE[type(last)]
    assert state == expected
    machine = _interpreter(ENGINE)
    for trigger in path:
        machine.send(trigger, {})
    assert machine.state == state


def test_each_engine_request_end_is_reached():
    """The scenarios above do reach every end state and every failure cause."""
    seen = set()
    cases = [
        dict(
            tokens=2,
            packets=1,
            fail_after=None,
            fail_mode="output",
            unit_listens=False,
            forget_terminal=False,
            interrupt=None,
            interrupt_after=0,
        )
    ]
    cases.append({**cases[0], "fail_after": 1})
    cases.append({**cases[0], "fail_after": 1, "fail_mode": "raise"})
    cases.append({**cases[0], "forget_terminal": True})
    cases.append({**cases[0], "interrupt": "abort", "interrupt_after": 1})
    cases.append({**cases[0], "interrupt": "restart", "interrupt_after": 1})
    cases.append({**cases[0], "unit_listens": True})
    for case in cases:
        seen.update(_trigger(o, "") for o in run_request(case))
    assert seen == set(ENGINE.triggers)


# --- lease ------------------------------------------------------------------------------------

lease_ops = st.lists(
    st.one_of(
        st.tuples(st.just("touch"), st.floats(0, 40)),
        st.tuples(st.just("detach"), st.floats(0, 40)),
        st.tuples(
            st.just("resume"),
            st.sampled_from(["good", "bad_generation", "bad_token", "replay", "forged_replay"]),
        ),
        st.tuples(st.just("reap"), st.sampled_from([0.0, 5.0, 29.0, 30.0, 31.0, 299.0, 300.0, 400.0])),
        st.tuples(st.just("in_flight"), st.sampled_from([1, -1])),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(lease_ops)
def test_lease_follows_the_lease_chart(ops):
    now = 0.0
    lease = Lease(now, idle_ttl=300.0, grace=30.0)
    state = LEASE.initial
    # control id, the credentials it presented and when: the last accepted resume's retry is
    # answered within REPLAY_WINDOW_S (core/lease.py)
    accepted: list[tuple[str, int, str, float]] = []
    machine = _interpreter(LEASE)
    for i, (op, arg) in enumerate(ops):
        guards = dict.fromkeys(LEASE.guards, False)
        if op in ("touch", "detach"):
            now += arg
        if op == "reap":
            now += arg
            guards["grace_elapsed"] = lease.detached_at is not None and now - lease.detached_at >= lease.grace
            guards["idle_ttl_elapsed"] = lease.in_flight == 0 and now - lease.last_activity >= lease.idle_ttl
        if op == "in_flight":
            lease.in_flight = max(lease.in_flight + arg, 0)
            continue  # not a lifecycle step: it only feeds the idle guard
        control_id = None
        if op == "resume":
            generation = lease.generation + (1 if arg == "bad_generation" else 0)
            token = lease.token + ("x" if arg in ("bad_token", "forged_replay") else "")
            control_id = f"c{i}"
            replay = arg == "replay" and bool(accepted) and now - accepted[-1][3] <= REPLAY_WINDOW_S
            if arg == "replay" and accepted:  # the very request again: its id and credentials
                control_id, generation, token, _ = accepted[-1]
            elif arg == "forged_replay" and accepted:  # the last control id, other credentials
                control_id = accepted[-1][0]
            guards["replays_last_resume"] = replay
            guards["credentials_match"] = (generation, token) == (lease.generation, lease.token)
        edge = LEASE.resolve(state, op, guards)

        # The real lease.
        outcome = None
        if op == "touch":
            lease.touch(now)
        elif op == "detach":
            lease.detach(now)
        elif op == "resume":
            try:
                lease.resume(now, generation, token, control_id)
                if not guards["replays_last_resume"]:
                    accepted.append((control_id, generation, token, now))
            except ResumeConflict:
                outcome = "refused"
        elif op == "reap":
            outcome = lease.expiry(now)
        observed = (
            "expired"
            if outcome in (IDLE_TTL_EXPIRED, DISCONNECT_GRACE_EXPIRED)
            else ("detached" if lease.detached else "attached")
        )

        if edge is None:
            assert outcome == "refused", f"step {i}: the chart refuses {op} in {state}, the lease did not"
            assert observed == state
        else:
            assert outcome != "refused", f"step {i}: the lease refused {op} the chart allows"
            assert observed == edge.dest, f"step {i}: {op} {guards}: lease {observed}, chart {edge.dest}"
            if op == "reap" and edge.dest == "expired":
                assert f"close_{outcome}" in edge.effects  # the chart names the right reason
        machine.send(op, guards)
        assert machine.state == (state if edge is None else edge.dest)
        state = observed
        if state == "expired":
            break
