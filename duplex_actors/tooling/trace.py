"""Post-mortem traces: one session's recorded transitions as a diagram a reviewer can read.

The input is what the runtime already logs: with structlog rendering JSON lines at debug
level, :class:`~duplex_actors.core.session.SessionCore` writes one ``"transition"`` event per
step (``session_id, trigger, src, dest, epoch, turn_id``). This module is pure: records in,
text out. It knows where each trigger comes from (the client, the engine, or the session
itself) and, by looking the step up in the compiled session chart, which effects it carried,
so the diagram also shows what the session sent to the engine and to the client.

Runs of the same internal step (a stream of output deltas, text and audio mixed) collapse
into one arrow with a count, so a long answer stays one line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any

import attrs

from ..core.statechart import CHART, ENGINE_TRIGGERS, SELF_TRIGGERS, CompiledChart

FORMATS = ("mermaid-sequence", "timeline")

# Effects that reach the engine, and effects that produce events for the client.
ENGINE_EFFECTS = {
    "submit_model_turn": "submit model turn",
    "submit_unit": "submit audio unit",
    "abort_engine_requests": "abort requests",
}
CLIENT_EFFECTS = {
    "begin_response": "response.created",
    "deliver_text": "deltas",
    "deliver_audio": "deltas",
    "deliver_function_call": "function call",
    "emit_response_completed": "response.done completed",
    "emit_response_failed": "response.done failed",
    "emit_response_cancelled": "response.done cancelled",
    "emit_session_closed": "session.closed",
    "clear_input": "input_audio_buffer.cleared",
    "emit_speech_started": "speech_started",
    "emit_speech_stopped": "speech_stopped",
    "emit_decision": "decision",
    "emit_engine_error": "error",
    "touch_lease": "heartbeat ack",
    "resume_lease": "session.resumed",
    "apply_session_update": "session.updated",
}


#: The engine's streamed output: a run of it is one step of a trace, whatever the mix.
STREAMED = frozenset({"text_delta", "audio_packet"})


@attrs.frozen(slots=True)
class Step:
    """One logged step of a session (or a run of the same internal step, ``count`` of them)."""

    trigger: str
    src: str
    dest: str
    epoch: int | None
    turn_id: int | None
    at: datetime | None
    count: int = 1
    #: The other streamed triggers a collapsed run holds besides ``trigger``.
    mixed: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """The trigger(s) and, for a run, how many steps it collapsed."""
        return "+".join((self.trigger, *self.mixed)) + (f" ×{self.count}" if self.count > 1 else "")


def read_records(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """JSON objects from JSON-lines text; other lines (console logs, blanks) are skipped."""
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            yield record


def _timestamp(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def session_steps(records: Iterable[Mapping[str, Any]], session_id: str) -> list[Step]:
    """The session's transition events in log order, runs of identical internal steps merged."""
    steps: list[Step] = []
    for r in records:
        if r.get("event") != "transition" or r.get("session_id") != session_id:
            continue
        step = Step(
            str(r.get("trigger")),
            str(r.get("src")),
            str(r.get("dest")),
            r.get("epoch"),
            r.get("turn_id"),
            _timestamp(r.get("timestamp")),
        )
        last = steps[-1] if steps else None
        if (
            last is not None
            and step.src == step.dest == last.src == last.dest
            and (step.epoch, step.turn_id) == (last.epoch, last.turn_id)
            and (step.trigger == last.trigger or {step.trigger, last.trigger} <= STREAMED)
        ):
            mixed = last.mixed
            if step.trigger != last.trigger and step.trigger not in mixed:
                mixed = (*mixed, step.trigger)
            steps[-1] = attrs.evolve(last, count=last.count + 1, mixed=mixed)
        else:
            steps.append(step)
    return steps


def sessions_in(records: Iterable[Mapping[str, Any]]) -> list[str]:
    return list(
        dict.fromkeys(
            r["session_id"] for r in records if r.get("event") == "transition" and "session_id" in r
        )
    )


def step_effects(step: Step, chart: CompiledChart = CHART) -> tuple[str, ...]:
    """The effects the logged step performed, when the chart pins them down unambiguously."""
    candidates = [b for b in chart.table.get((step.src, step.trigger), ()) if b.dest == step.dest]
    if step.src == step.dest:
        # An internal step is logged only when it had effects.
        candidates = [b for b in candidates if b.effects] or candidates
    effect_sets = {b.effects for b in candidates}
    return effect_sets.pop() if len(effect_sets) == 1 else ()


def _origin(trigger: str) -> str:
    if trigger in ENGINE_TRIGGERS:
        return "Engine"
    if trigger in SELF_TRIGGERS:
        return "Session"
    return "Client"


def _fence(step: Step) -> str:
    return f"epoch {step.epoch}, turn {step.turn_id}"


def to_mermaid_sequence(steps: list[Step], session_id: str, chart: CompiledChart = CHART) -> str:
    lines = [
        "sequenceDiagram",
        f"    title session {session_id}",
        "    participant Client",
        "    participant Session",
        "    participant Engine",
    ]
    if steps:
        lines.append(f"    Note over Session: {steps[0].src} ({_fence(steps[0])})")
    for step in steps:
        origin = _origin(step.trigger)
        lines.append(f"    {origin}->>Session: {step.label}")
        for effect in step_effects(step, chart):
            if effect in ENGINE_EFFECTS:
                lines.append(f"    Session->>Engine: {ENGINE_EFFECTS[effect]}")
            elif effect in CLIENT_EFFECTS:
                lines.append(f"    Session-->>Client: {CLIENT_EFFECTS[effect]}")
        if step.src != step.dest:
            lines.append(f"    Note over Session: {step.src} → {step.dest} ({_fence(step)})")
    return "\n".join(lines) + "\n"


def to_timeline(steps: list[Step], session_id: str, chart: CompiledChart = CHART) -> str:
    start = next((s.at for s in steps if s.at is not None), None)
    lines = [
        f"session {session_id}: {len(steps)} step(s)",
        f"{'t (ms)':>10}  {'from':<8} {'trigger':<18} {'transition':<26} {'fence':<18} effects",
    ]
    for step in steps:
        offset = "" if step.at is None or start is None else f"{(step.at - start).total_seconds() * 1000:.1f}"
        trigger = step.label
        move = f"{step.src} → {step.dest}" if step.src != step.dest else f"({step.src})"
        effects = ", ".join(step_effects(step, chart))
        lines.append(
            f"{offset:>10}  {_origin(step.trigger):<8} {trigger:<18} {move:<26} "
            f"{_fence(step):<18} {effects}".rstrip()
        )
    return "\n".join(lines) + "\n"


def render_trace(records: Iterable[Mapping[str, Any]], session_id: str, fmt: str = "mermaid-sequence") -> str:
    """Text for one session's trace; raises LookupError if the log holds no step of it."""
    records = list(records)
    steps = session_steps(records, session_id)
    if not steps:
        known = sessions_in(records)
        raise LookupError(
            f"no transition of session {session_id!r} in the log"
            + (
                f"; sessions present: {', '.join(known)}"
                if known
                else " (was it recorded with JSON logs at debug level?)"
            )
        )
    if fmt == "mermaid-sequence":
        return to_mermaid_sequence(steps, session_id)
    if fmt == "timeline":
        return to_timeline(steps, session_id)
    raise ValueError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
