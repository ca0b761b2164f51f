"""Traces drawn from a real recorded run: a Runtime on the ScriptedEngine, logging JSON."""

from __future__ import annotations

import io
import json

import anyio
import pytest
import structlog
from typer.testing import CliRunner

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.logconfig import configure, ensure_configured
from duplex_actors.tooling.trace import read_records, render_trace, session_steps, sessions_in


@pytest.fixture
def json_log():
    buf = io.StringIO()
    configure("debug", json=True, stream=buf)
    yield buf
    structlog.reset_defaults()
    ensure_configured()  # back to the quiet default the rest of the suite runs with


def _record(buf, *, barge_in: bool) -> tuple[str, str]:
    async def main():
        script = Script(token_latency_s=0.01 if barge_in else 0.0)
        async with Runtime(ScriptedEngine(script)) as rt:
            s = await rt.open_session()
            s.append_audio(b"\0\0" * 3200)
            await s.commit()
            async for e in s.events():
                if barge_in and e.type == "response.output_text.delta":
                    await s.barge_in()
                if e.type == "response.done":
                    break
            await s.close()
            return s.id

    sid = anyio.run(main)
    return sid, buf.getvalue()


def test_trace_of_a_completed_turn(json_log):
    sid, log = _record(json_log, barge_in=False)
    records = list(read_records(log.splitlines()))
    assert sid in sessions_in(records)
    steps = session_steps(records, sid)
    moves = [(s.src, s.trigger, s.dest) for s in steps if s.src != s.dest]
    assert moves == [
        ("idle", "append", "listening"),
        ("listening", "commit", "responding"),
        ("responding", "turn_done", "idle"),
        ("idle", "close", "closed"),
    ]
    outputs = [s for s in steps if s.trigger in ("text_delta", "audio_packet", "function_call")]
    assert len(outputs) == 1 and outputs[0].count > 1  # the deltas collapse into one step

    text = render_trace(records, sid, "mermaid-sequence")
    lines = text.splitlines()
    assert lines[0] == "sequenceDiagram"
    for participant in ("Client", "Session", "Engine"):
        assert f"    participant {participant}" in lines
    assert "    Client->>Session: commit" in lines
    assert "    Session->>Engine: submit model turn" in lines
    assert "    Engine->>Session: turn_done" in lines
    assert "    Session-->>Client: response.done completed" in lines
    assert "    Note over Session: listening → responding (epoch 0, turn 0)" in lines
    assert "    Note over Session: responding → idle (epoch 0, turn 1)" in lines
    assert lines.index("    Client->>Session: commit") < lines.index("    Engine->>Session: turn_done")


def test_trace_of_a_barge_in(json_log):
    sid, log = _record(json_log, barge_in=True)
    records = list(read_records(log.splitlines()))
    text = render_trace(records, sid, "mermaid-sequence")
    assert "    Client->>Session: barge_in" in text
    assert "    Session->>Engine: abort requests" in text
    assert "    Session-->>Client: response.done cancelled" in text
    assert "responding → barge_in (epoch 1, turn 0)" in text  # the epoch moved on
    timeline = render_trace(records, sid, "timeline")
    rows = timeline.splitlines()[2:]
    assert any("barge_in" in r and "responding → barge_in" in r and "advance_epoch" in r for r in rows)
    offsets = [float(r.split()[0]) for r in rows]
    assert offsets == sorted(offsets) and offsets[0] == 0.0


def test_trace_only_shows_the_asked_session_and_says_when_absent():
    records = [
        {
            "event": "transition",
            "session_id": "a",
            "trigger": "append",
            "src": "idle",
            "dest": "listening",
            "epoch": 0,
            "turn_id": 0,
        },
        {
            "event": "transition",
            "session_id": "b",
            "trigger": "close",
            "src": "idle",
            "dest": "closed",
            "epoch": 0,
            "turn_id": 0,
        },
        {"event": "something_else", "session_id": "a"},
    ]
    text = render_trace(records, "a", "mermaid-sequence")
    assert "append" in text and "close" not in text
    with pytest.raises(LookupError, match="sessions present: a, b"):
        render_trace(records, "zzz")


def test_read_records_skips_non_json_lines():
    lines = ["not json", "", '{"event": "transition"}', "{broken", json.dumps([1, 2])]
    assert list(read_records(lines)) == [{"event": "transition"}]


def test_trace_cli(json_log, tmp_path):
    cli = pytest.importorskip("duplex_actors.cli")
    sid, log = _record(json_log, barge_in=False)
    path = tmp_path / "run.jsonl"
    path.write_text(log)
    runner = CliRunner()
    listed = runner.invoke(cli.app, ["trace", str(path)])
    assert listed.exit_code == 0 and sid in listed.output.split()
    out = runner.invoke(cli.app, ["trace", str(path), "--session", sid, "--format", "timeline"])
    assert out.exit_code == 0, out.output
    assert "idle → listening" in out.output
    missing = runner.invoke(cli.app, ["trace", str(path), "--session", "sess_nope"])
    assert missing.exit_code == 1
