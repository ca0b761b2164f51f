"""The SCXML exports are structurally valid SCXML 1.0 and executable: scjson's interpreter,
loading them, takes the same transitions (same target, same effects in the same order, same
refusals) as the runtime on hypothesis-generated event sequences. Mutated documents are caught.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from duplex_actors.core import commands as cmd
from duplex_actors.core.clock import ManualClock
from duplex_actors.core.engine_io import Aborted, Decision, EngineFailure, TextDelta, TurnDone
from duplex_actors.core.session import SessionConfig, SessionCore
from duplex_actors.core.statechart import CHART, GUARDS, PRECONDITIONS, TRIGGERS
from duplex_actors.errors import DuplexError
from duplex_actors.tooling import statechart_export as export
from duplex_actors.tooling.scxml import to_scxml, validate_scxml

from .scxml_runner import Interpreter, StatemachineInterpreter

INTERPRETERS = {"scjson": Interpreter, "python-statemachine": StatemachineInterpreter}
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]

SESSION = export.spec("session")
SESSION_SCXML = to_scxml(SESSION)
interpreter_settings = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- structure ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(export.MACHINES))
def test_exports_are_valid_scxml(name):
    chart = export.spec(name)
    assert validate_scxml(to_scxml(chart), chart) == []


@pytest.mark.parametrize("name", list(export.MACHINES))
def test_interpreter_loads_each_chart_in_strict_mode(name):
    chart = export.spec(name)
    assert Interpreter(to_scxml(chart)).state == chart.initial
    assert Interpreter(to_scxml(chart), sandboxed=True).state == chart.initial


def test_sandboxed_evaluation_agrees():
    """The fast path (eval after scjson's ECMAScript normalisation) and scjson's sandbox take
    the same steps through every guarded branch of a barge-in and recovery."""
    all_true = dict.fromkeys(GUARDS, True)
    script = [
        ("append", {}),
        ("speech_stopped", {"server_vad": True, "has_buffered_audio": True}),
        ("speak", {}),
        ("text_delta", {"response_begun": True}),
        ("barge_in", {}),
        ("abort_confirmed", {"aborts_settled": True, "has_buffered_audio": True}),
        ("commit", all_true),
        ("turn_done", {}),
        ("cancel", {}),
        ("close", {}),
    ]
    runs = []
    for sandboxed in (False, True):
        machine = Interpreter(SESSION_SCXML, sandboxed=sandboxed)
        trace = []
        for trigger, values in script:
            guards = {**dict.fromkeys(GUARDS, False), **values}
            trace.append((trigger, machine.state, tuple(machine.send(trigger, guards))))
        runs.append(trace)
    assert runs[0] == runs[1]
    assert [state for _, state, _ in runs[0]][-1] == "idle"


@pytest.mark.parametrize(
    "breakage, complaint",
    [
        (lambda t: t.replace('version="1.0"', 'version="2.0"'), "version"),
        (lambda t: t.replace('target="responding"', 'target="speaking"', 1), "unknown state 'speaking'"),
        (lambda t: t.replace('initial="idle"', 'initial="nowhere"'), "initial"),
        (
            lambda t: t.replace('<data id="aborts_settled" expr="1 == 0" />', ""),
            "undeclared 'aborts_settled'",
        ),
        (lambda t: t.replace('<state id="barge_in">', '<state id="idle">'), "used twice"),
        (lambda t: t.replace("</scxml>", ""), "well-formed"),
        (lambda t: t.replace('<log label="effect"', '<bogus label="effect"', 1), "<bogus> may not appear"),
        (
            lambda t: t.replace('<state id="closed">', '<final id="closed">').replace(
                "</state>\n</scxml>", "</final>\n</scxml>"
            ),
            "<final> may not have transitions",
        ),
    ],
)
def test_validator_catches_broken_documents(breakage, complaint):
    problems = validate_scxml(breakage(SESSION_SCXML), SESSION)
    assert any(complaint in p for p in problems), problems


def test_validator_checks_against_the_chart():
    # Dropping one transition keeps the document valid SCXML but no longer this chart.
    text = re.sub(r'<transition event="heartbeat">.*?</transition>', "", SESSION_SCXML, count=1, flags=re.S)
    assert validate_scxml(text) == []
    assert any("transitions, the chart has" in p for p in validate_scxml(text, SESSION))


# --- the round trip against the compiled chart ------------------------------------------------

# close, expire and fail end the session for good; drawn as often as the rest, they would end
# most sequences after a few steps, so every other trigger is drawn ten times as often.
ENDING = ("close", "expire", "fail")
weighted_triggers = st.sampled_from([t for t in TRIGGERS if t not in ENDING] * 10 + list(ENDING))
# The preconditions (a command's fence, the ids it names) mostly hold, as they do for a client
# that follows the protocol: failing half the time, they would refuse most steps and leave the
# rows behind them rarely reached.
_PRECONDITION_GUARDS = {name for names in PRECONDITIONS.values() for name in names}


def _chart_steps(precondition_values):
    guards = {g: precondition_values if g in _PRECONDITION_GUARDS else st.booleans() for g in GUARDS}
    return st.lists(st.tuples(weighted_triggers, st.fixed_dictionaries(guards)), min_size=15, max_size=60)


chart_steps = _chart_steps(st.sampled_from([True] * 7 + [False]))
#: For the mutants, which change rows behind the preconditions: those always hold.
lawful_chart_steps = _chart_steps(st.just(True))


def divergence(scxml_text: str, sequence, interpreter=Interpreter) -> str | None:
    """The first step where the interpreter and ``CHART.resolve`` disagree, or None."""
    machine = interpreter(scxml_text)
    state = "idle"
    for i, (trigger, guards) in enumerate(sequence):
        try:
            res = CHART.resolve(state, trigger, guards.__getitem__)
            want = (res.dest, tuple(res.effects), None)
        except DuplexError as err:
            want = (state, (), type(err).__name__)  # refused: state kept, the typed error named
        effects = tuple(machine.send(trigger, guards))
        got = (machine.state, effects, machine.refusal)
        if got != want:
            return f"step {i}: {state} --{trigger} {guards}--> interpreter {got}, runtime {want}"
        state = want[0]
    return None


@pytest.mark.slow
@interpreter_settings
@given(chart_steps)
def test_interpreter_matches_compiled_chart(sequence):
    assert divergence(SESSION_SCXML, sequence) is None


@pytest.mark.parametrize("name", list(export.MACHINES))
@pytest.mark.parametrize("interpreter", list(INTERPRETERS))
def test_committed_scxml_runs_unmodified_in_each_interpreter(name, interpreter):
    # The file as committed, read from disk: what a user would hand their interpreter.
    text = (ROOT / "statecharts" / f"{name}.scxml").read_text(encoding="utf-8")
    assert INTERPRETERS[interpreter](text).state == export.spec(name).initial


@pytest.mark.slow
@interpreter_settings
@given(chart_steps)
def test_python_statemachine_matches_compiled_chart(sequence):
    # A second, independent interpreter with a Python datamodel, in its restricted mode.
    text = (ROOT / "statecharts" / "session.scxml").read_text(encoding="utf-8")
    assert divergence(text, sequence, StatemachineInterpreter) is None


def _mutate_first(pattern: str, replacement: str):
    def mutate(text: str) -> str:
        mutated, n = re.subn(pattern, replacement, text, count=1, flags=re.S)
        assert n == 1, pattern
        return mutated

    return mutate


MUTANTS = {
    # commit with auto_respond goes nowhere instead of responding
    "retargeted": _mutate_first(
        r'(<state id="listening">.*?<transition event="commit" cond="[^"]*" )target="responding"',
        r'\1target="idle"',
    ),
    # the guard on leaving barge_in is lost
    "guard dropped": _mutate_first(
        r'(<state id="barge_in">.*?<transition event="abort_confirmed") cond="[^"]*"', r"\1"
    ),
    # barge-in forgets to move the epoch
    "effect dropped": _mutate_first(
        r'(<state id="responding">.*?<transition event="barge_in" cond="[^"]*" target="barge_in">\s*)'
        r"<log label=\"effect\" expr=\"'advance_epoch'\" />",
        r"\1",
    ),
    # a refusal becomes a silent no-op: cancel while idle is accepted
    "refusal lost": _mutate_first(
        r'(<state id="idle">.*?)<transition event="cancel">.*?</transition>', r"\1"
    ),
    # the wrong typed error
    "refusal retyped": _mutate_first(
        r"(<state id=\"responding\">.*?<log label=\"refusal\" expr=\"')ResponseInProgress'",
        r"\1IllegalTransition'",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_round_trip_catches_a_mutated_chart(mutant):
    """The round-trip property fails on a deliberately wrong SCXML: it is a test that can fail."""
    text = MUTANTS[mutant](SESSION_SCXML)
    assert text != SESSION_SCXML
    assert validate_scxml(text) == []  # structurally fine: only behaviour gives it away

    # No shrinking: finding the divergence is the point, and shrinking 60-step programs
    # through the interpreter would take minutes. The budget is generous: a search stops at
    # its first divergence, and with 1000 a full run missed a mutant now and then.
    @settings(
        max_examples=4000,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(lawful_chart_steps)
    def prop(sequence):
        assert divergence(text, sequence) is None

    with pytest.raises(AssertionError, match=r"step \d+: "):
        prop()


# --- the round trip against a real SessionCore --------------------------------------------------


class RecordingChart:
    """Wraps the compiled chart a SessionCore uses and records every step it resolves, with
    the values all guards had at that moment (guards are pure reads of the session)."""

    #: No append fast path: every append is resolved here, so every step is recorded.
    append_buffers_in: dict[str, tuple[str, ...]] = {}

    def __init__(self, chart=CHART) -> None:
        self.chart = chart
        self.steps: list[tuple[str, str, dict, object]] = []

    def __getattr__(self, name):
        return getattr(self.chart, name)

    def resolve_on(self, subject, guards, state, trigger, step):  # what a SessionCore calls
        values = {name: bool(guards[name](subject, step)) for name in GUARDS}
        try:
            res = self.chart.resolve_on(subject, guards, state, trigger, step)
        except DuplexError as err:
            self.steps.append((state, trigger, values, err))
            raise
        self.steps.append((state, trigger, values, res))
        return res


CHUNK = b"\x01\x00" * 3200  # 200 ms
# The turn-taking commands are drawn more often than settings changes, and close rarely, so
# that sequences spend their steps in responding and barge_in rather than closed.
client_ops = st.sampled_from(
    [
        cmd.AppendAudio(pcm=CHUNK),
        cmd.CommitInput(),
        cmd.CreateResponse(),
        cmd.BargeIn(),
        cmd.SpeechStartedSignal(),
        cmd.SpeechStoppedSignal(),
    ]
    * 4
    + [
        cmd.ClearInput(),
        cmd.CancelResponse(),
        cmd.Heartbeat(),
        cmd.Detach(),
        # refused by a check: stale generation, wrong token (the real token is random)
        cmd.Resume(generation=3, resume_token="forged"),
        cmd.Resume(generation=0, resume_token="forged", last_seq=0),
        cmd.AppendAudio(pcm=CHUNK, sample_rate=8000),
        cmd.UpdateSession(auto_respond=False),
        cmd.UpdateSession(auto_respond=True),
        cmd.UpdateSession(server_vad=True),
        cmd.UpdateSession(server_vad=False),
        cmd.UpdateSession(model_native=True),
        cmd.UpdateSession(model_native=False),
    ]
    * 2
    + [cmd.Close()]
)
engine_ops = st.tuples(
    st.sampled_from(["speak", "listen", "text", "done", "failure", "aborted", "stale"]), st.integers(0, 3)
)
session_ops = st.lists(st.one_of(client_ops, engine_ops), min_size=10, max_size=40)


def _engine_output(core: SessionCore, kind: str, pick: int):
    live = sorted(core.in_flight_requests | core.aborting_requests)
    rid = live[pick % len(live)] if live and kind != "stale" else f"{core.session_id}/e99/t99"
    return {
        "speak": Decision(rid, True),
        "listen": Decision(rid, False),
        "text": TextDelta(rid, "hi"),
        "done": TurnDone(rid),
        "failure": EngineFailure(rid, "boom"),
        "aborted": Aborted(rid),
        "stale": TextDelta(rid, "old"),
    }[kind]


@pytest.mark.slow
@interpreter_settings
@given(session_ops)
def test_interpreter_matches_a_real_session(ops):
    recorder = RecordingChart()
    core = SessionCore("sess_scxml000000000000", SessionConfig(), ManualClock(10.0), chart=recorder)
    for op in ops:
        try:
            if isinstance(op, tuple):
                core.on_engine_output(_engine_output(core, *op))
            else:
                core.handle(op)
        except DuplexError:
            pass  # typed refusals are part of the behaviour under test
        core.take_actions()
        core.take_events()
    machine = Interpreter(SESSION_SCXML)
    for i, (state, trigger, guards, res) in enumerate(recorder.steps):
        assert machine.state == state, f"step {i}: session in {state}, interpreter in {machine.state}"
        effects = machine.send(trigger, guards)
        if isinstance(res, Exception):
            assert (machine.state, effects, machine.refusal) == (state, [], type(res).__name__), (
                f"step {i}: refused {trigger} in {state}"
            )
        else:
            assert (machine.state, tuple(effects), machine.refusal) == (res.dest, res.effects, None), (
                f"step {i}: {trigger}"
            )
    assert machine.state == core.state
