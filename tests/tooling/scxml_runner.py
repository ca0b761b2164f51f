"""Drive an exported SCXML document through two independent interpreters: scjson's
(ECMAScript datamodel) and python-statemachine's (a restricted Python datamodel).

The chart's guards are ECMAScript data in the document; before each event the host (here: the
test) sets them, as the runtime evaluates its guard methods at that moment. Effects come back
through the interpreter's ``<log label="effect">`` entries, in the order it ran them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io

import pytest

context = pytest.importorskip("scjson.context", reason="the SCXML round trip needs scjson")


@functools.lru_cache(maxsize=32)
def _loaded(text: str, sandboxed: bool):
    # Strict mode: scjson refuses elements and attributes outside its SCXML schema. Its
    # sandboxed evaluator costs ~35 ms per expression; the documents are our own, so the
    # property tests let it evaluate (still after its own ECMAScript normalisation) with eval,
    # and one test checks that the sandbox gives the same answers.
    return context.DocumentContext.from_xml_string(
        text, execution_mode="strict", allow_unsafe_eval=not sandboxed
    )


class Interpreter:
    def __init__(self, text: str, *, sandboxed: bool = False) -> None:
        self.ctx = copy.deepcopy(_loaded(text, sandboxed))  # loading costs ~0.3 s; a copy ~10 ms
        self.root = self.ctx.root_activation.id
        self.refusal: str | None = None  # the typed error the last event was refused with

    @property
    def state(self) -> str:
        active = sorted(self.ctx.configuration - {self.root})
        assert len(active) == 1, f"flat charts have one active state, got {active}"
        return active[0]

    def send(self, event: str, guards: dict[str, bool]) -> list[str]:
        for name, value in guards.items():
            assert name in self.ctx.data_model, f"guard {name} is not declared in the datamodel"
            self.ctx.data_model[name] = bool(value)
        before = len(self.ctx.action_log)
        self.ctx.enqueue(event)
        self.ctx.microstep()
        # Entering a top-level <final> queues done.state.*: let the interpreter take it now so
        # that it is not mistaken for the next external event.
        while self.ctx.events._q and self.ctx.events._q[0].name.startswith("done."):
            self.ctx.microstep()
        errors = [e.name for e in list(self.ctx.events._q) if e.name.startswith("error")]
        assert not errors, f"the interpreter raised {errors} on {event}"
        logged = self.ctx.action_log[before:]
        refusals = [e.split(":", 1)[1] for e in logged if e.startswith("refusal:")]
        self.refusal = refusals[0] if refusals else None
        return [e.split(":", 1)[1] for e in logged if e.startswith("effect:")]


def _statechart_class(text: str):
    # Loaded afresh for each machine (~40 ms): python-statemachine (3.2) initialises a loaded
    # class's <datamodel> for its first instance only.
    # Restricted (untrusted) evaluation: the document must run as written, no eval. Errors in
    # its expressions are raised rather than turned into error.execution events, so a document
    # it cannot evaluate fails the test instead of quietly taking no transition.
    statemachine_io = pytest.importorskip(
        "statemachine.io", reason="the second round trip needs python-statemachine"
    )
    cls = statemachine_io.load(text, format="scxml")
    cls.catch_errors_as_events = False
    return cls


class StatemachineInterpreter:
    """The same interface as :class:`Interpreter`, on python-statemachine.

    Its ``<log>`` prints ``label: 'value'`` lines; they are read back as the effects and the
    refusal of each step."""

    def __init__(self, text: str) -> None:
        self.machine = _statechart_class(text)()
        self.refusal: str | None = None

    @property
    def state(self) -> str:
        active = [s.id for s in self.machine.configuration]
        assert len(active) == 1, f"flat charts have one active state, got {active}"
        return active[0]

    def send(self, event: str, guards: dict[str, bool]) -> list[str]:
        model = self.machine.model
        for name, value in guards.items():
            assert hasattr(model, name), f"guard {name} is not declared in the datamodel"
            setattr(model, name, bool(value))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            self.machine.send(event)
        logged = [line.split(": ", 1) for line in printed.getvalue().splitlines()]
        refusals = [value.strip("'") for label, value in logged if label == "refusal"]
        self.refusal = refusals[0] if refusals else None
        return [value.strip("'") for label, value in logged if label == "effect"]
