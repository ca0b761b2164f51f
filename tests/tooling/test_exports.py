"""Every export format parses and says everything the live Machines say; the drift check
passes on the committed files and fails on a modified copy; the CLI drives all of it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from transitions.extensions.diagrams import GraphMachine
from typer.testing import CliRunner

from duplex_actors.core import statechart as session_chart
from duplex_actors.core.statechart import CHART, WHY
from duplex_actors.tooling import lifecycles
from duplex_actors.tooling import statechart_export as export

ROOT = Path(__file__).resolve().parents[2]
NAMES = list(export.MACHINES)
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` not installed")


def test_session_spec_is_the_compiled_chart():
    """The export reads the same Machine the runtime compiles: same table, same priorities."""
    spec = export.spec("session")
    table = {
        key: tuple((b.dest, b.guards, b.effects) for b in branches) for key, branches in CHART.table.items()
    }
    assert spec.table() == table
    assert set(spec.states) == set(CHART.states)


@pytest.mark.parametrize("name", NAMES)
def test_json_round_trips_to_the_same_table(name):
    spec = export.spec(name)
    text = export.to_json(spec)
    assert export.table_from_json(text) == spec.table()
    data = json.loads(text)
    assert [s["id"] for s in data["states"]] == list(spec.states)
    assert data["initial"] == spec.initial


def test_session_json_matches_the_runtime_table_and_why():
    data = json.loads(export.to_json(export.spec("session")))
    assert export.table_from_json(json.dumps(data)) == {
        key: tuple((b.dest, b.guards, b.effects) for b in branches) for key, branches in CHART.table.items()
    }
    assert {t["name"]: t["why"] for t in data["triggers"]} == WHY


@pytest.mark.parametrize("name", NAMES)
def test_mermaid_declares_each_state_before_anything_mentions_it(name):
    # What each transition says is checked by parsing the files back
    # (test_exports_parse_back.py); this is about how Mermaid titles the boxes.
    spec = export.spec(name)
    documents = [(export.to_mermaid(spec), spec.states)]
    for state in export.view_states(spec):
        text = export.mermaid_view(spec, state)
        documents.append((text, re.findall(r'^    state "\w+" as (\w+)$', text, re.M)))
        assert documents[-1][1][0] == state
    for text, states in documents:
        lines = text.splitlines()
        assert "stateDiagram-v2" in lines
        for state in states:
            # Declared by name before anything else mentions it: Mermaid titles a box with the
            # first description it sees, so a box with self-transitions would otherwise be
            # titled with one of them instead of the state's name.
            declaration = f'    state "{state}" as {state}'
            first_mention = next(
                i
                for i, line in enumerate(lines)
                if re.match(rf"^    (state \"{state}\" as )?{state}\b", line)
            )
            assert lines[first_mention] == declaration, (state, lines[first_mention])
    overview = documents[0][0].splitlines()
    assert f"    [*] --> {spec.initial}" in overview
    for state in spec.absorbing:
        assert f"    {state} --> [*]" in overview


def test_only_the_session_chart_is_split_into_views():
    assert [n for n in NAMES if export.view_states(export.spec(n))] == ["session"]
    assert export.view_states(export.spec("session")) == export.spec("session").states


@needs_dot
@pytest.mark.parametrize("name", NAMES)
def test_dot_parses_and_svg_is_svg(name):
    spec = export.spec(name)
    dot = export.to_dot(spec)
    canon = subprocess.run(["dot", "-Tcanon"], input=dot, capture_output=True, text=True, check=True)
    assert canon.stdout.startswith("digraph")
    svg = export.render_svg(dot)
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    titles = {t.text for t in root.iter("{http://www.w3.org/2000/svg}title")}
    assert set(spec.states) <= titles
    # Edges are titled "source->target" by state names (the console finds the edge a
    # transition took so), never with the port the arrow attaches to.
    edges = [
        g.find("{http://www.w3.org/2000/svg}title").text
        for g in root.iter("{http://www.w3.org/2000/svg}g")
        if g.get("class") == "edge"
    ]
    want = {f"{s}->{t}" for s, t, _ in export.merged_external_edges(spec)} | {f"__start->{spec.initial}"}
    assert set(edges) == want
    assert export.svg_digest(svg) == export.dot_digest(dot)


@needs_dot
def test_dot_with_the_graphviz_package():
    graphviz = pytest.importorskip("graphviz")
    svg = graphviz.Source(export.to_dot(export.spec("session"))).pipe(format="svg").decode()
    assert "<svg" in svg


@pytest.mark.parametrize(
    "machine, name",
    [
        (session_chart.MACHINE, "session"),
        (lifecycles.ENGINE_REQUEST_MACHINE, "engine_request"),
        (lifecycles.LEASE_MACHINE, "lease"),
    ],
)
def test_edges_agree_with_transitions_own_diagram(machine, name):
    """transitions' GraphMachine, fed the same rows, draws the same (source, target, trigger)
    arrows as our DOT: an independent renderer of the same Machine as a cross-check."""
    rows = []
    for trigger, event in machine.events.items():
        for source, transitions in event.transitions.items():
            for t in transitions:
                rows.append(
                    {
                        "trigger": trigger,
                        "source": source,
                        "dest": t.dest,
                        "conditions": [c.func for c in t.conditions if c.target],
                        "unless": [c.func for c in t.conditions if not c.target],
                    }
                )
    graph_machine = GraphMachine(
        model=None,
        states=list(machine.states),
        transitions=rows,
        initial=machine.initial,
        auto_transitions=False,
        graph_engine="graphviz",
    )

    class Model:
        pass

    model = Model()
    graph_machine.add_model(model)
    theirs = set()
    for match in re.finditer(
        r'^\s*(\w+) -> (\w+) \[label=(?:"([^"]*)"|(\w+))', model.get_graph().source, re.M
    ):
        source, target, quoted, bare = match.groups()
        label = quoted if quoted is not None else bare
        for part in label.split(" | "):
            trigger = part.split(" ")[0]
            if "[internal]" not in part:
                theirs.add((source, target, trigger))
    spec = export.spec(name)
    ours = {(e.source, e.target, e.trigger) for e in spec.edges if not e.internal}
    assert ours == theirs


# --- committed files and drift ----------------------------------------------------------------


def test_committed_files_match_the_code():
    problems = export.check(ROOT)
    assert problems == [], "\n".join(problems) + "\nregenerate: duplex-actors statechart --write"


def _copy_committed(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "statecharts", tmp_path / "statecharts")
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "design-review.md", tmp_path / "docs" / "design-review.md")
    return tmp_path


@pytest.mark.parametrize(
    "victim, edit",
    [
        (
            "statecharts/session.mmd",
            lambda t: t.replace("barge_in --> ", "barge_in --> idle : made up\n    barge_in --> ", 1),
        ),
        ("statecharts/lease.scxml", lambda t: t.replace('target="expired"', 'target="attached"', 1)),
        ("statecharts/engine_request.json", lambda t: t.replace('"aborted"', '"failed"', 1)),
        ("statecharts/session.dot", lambda t: t + "// hand edit\n"),
        ("statecharts/session.svg", lambda t: re.sub(r"dot-sha256: [0-9a-f]{8}", "dot-sha256: 00000000", t)),
        ("docs/design-review.md", lambda t: t.replace("| `idle` |", "| `idle?` |", 1)),
    ],
)
def test_drift_check_fails_on_a_modified_copy(tmp_path, victim, edit):
    root = _copy_committed(tmp_path)
    assert export.check(root) == []
    path = root / victim
    path.write_text(edit(path.read_text()))
    problems = export.check(root)
    assert len(problems) == 1 and problems[0].startswith(str(path)), problems


def test_drift_check_reports_missing_files(tmp_path):
    root = _copy_committed(tmp_path)
    (root / "statecharts" / "lease.mmd").unlink()
    assert export.check(root) == [f"{root / 'statecharts' / 'lease.mmd'}: missing"]


def test_drift_check_reports_a_view_the_code_does_not_draw(tmp_path):
    root = _copy_committed(tmp_path)
    stale = root / "statecharts" / "session.gone.mmd"
    stale.write_text("stateDiagram-v2\n")
    assert export.check(root) == [f"{stale}: not generated from the code (a state that is gone?)"]


# --- the command line -----------------------------------------------------------------------


def _app():
    cli = pytest.importorskip("duplex_actors.cli")
    return cli.app


def test_cli_check_passes_and_fails(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(_app(), ["statechart", "--check", "--root", str(ROOT)])
    assert ok.exit_code == 0, ok.output
    root = _copy_committed(tmp_path)
    (root / "statecharts" / "session.scxml").write_text("<scxml/>")
    bad = runner.invoke(_app(), ["statechart", "--check", "--root", str(root)])
    assert bad.exit_code == 1
    assert "session.scxml" in bad.output


@pytest.mark.parametrize(
    "fmt", ["mermaid", "dot", "scxml", "json"] + (["svg"] if shutil.which("dot") else [])
)
def test_cli_writes_each_format(tmp_path, fmt):
    result = CliRunner().invoke(
        _app(), ["statechart", "--format", fmt, "--machine", "all", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    for name in NAMES:
        path = tmp_path / f"{name}.{export.EXTENSIONS[fmt]}"
        assert path.read_text() == (ROOT / "statecharts" / path.name).read_text() or fmt == "svg"


def test_cli_writes_and_prints_the_mermaid_views(tmp_path):
    runner = CliRunner()
    wrote = runner.invoke(
        _app(), ["statechart", "--format", "mermaid", "--machine", "session", "-o", str(tmp_path)]
    )
    assert wrote.exit_code == 0, wrote.output
    views = sorted(p.name for p in tmp_path.glob("session.*.mmd"))
    assert views == sorted(p.name for p in (ROOT / "statecharts").glob("session.*.mmd")) and views
    for name in views:
        assert (tmp_path / name).read_text() == (ROOT / "statecharts" / name).read_text()
    one = runner.invoke(_app(), ["statechart", "--machine", "session", "--view", "barge_in"])
    assert one.exit_code == 0 and one.output == (ROOT / "statecharts" / "session.barge_in.mmd").read_text()
    for args in (["--machine", "lease", "--view", "attached"], ["--machine", "session", "--view", "nope"]):
        assert runner.invoke(_app(), ["statechart", *args]).exit_code != 0, args


def test_cli_prints_one_machine_and_the_review_doc():
    runner = CliRunner()
    lease = runner.invoke(_app(), ["statechart", "--format", "mermaid", "--machine", "lease"])
    assert lease.exit_code == 0 and lease.output == export.to_mermaid(export.spec("lease"))
    review = runner.invoke(_app(), ["statechart", "--format", "review-md"])
    assert review.exit_code == 0 and review.output == export.review_markdown()
    unknown = runner.invoke(_app(), ["statechart", "--machine", "nope"])
    assert unknown.exit_code != 0


def test_review_doc_has_a_row_per_transition_with_its_why():
    text = export.review_markdown()
    for name in NAMES:
        spec = export.spec(name)
        assert f"## {name}" in text
        # Its own section only: charts share state and trigger names (closed, drain).
        section = text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        for edge in spec.edges:
            target = "(internal)" if edge.internal else f"`{edge.target}`"
            row = next(
                (
                    line
                    for line in section.splitlines()
                    if line.startswith(f"| `{edge.source}` | `{edge.trigger}` |") and f"| {target} |" in line
                ),
                None,
            )
            assert row is not None, edge
            assert spec.why[edge.trigger] in row.replace("\\|", "|")


@pytest.mark.parametrize("fmt", ["mermaid", "dot", "scxml", "json"])
def test_cli_prints_exactly_one_document_or_refuses(fmt):
    # Several documents back to back on stdout are not one valid document of any format.
    runner = CliRunner()
    for args in ([], ["--machine", "all"]):
        result = runner.invoke(_app(), ["statechart", "--format", fmt, *args])
        assert result.exit_code != 0, (args, result.output[:200])
        assert "--machine" in result.output
    one = runner.invoke(_app(), ["statechart", "--format", fmt, "--machine", "session"])
    assert one.exit_code == 0 and one.output == export.render(export.spec("session"), fmt)
    if fmt == "json":
        json.loads(one.output)
    if fmt == "scxml":
        ET.fromstring(one.output)


def test_trigger_origins_reach_the_json_and_the_review_doc():
    from duplex_actors.core.statechart import TRIGGER_ORIGINS

    data = json.loads(export.to_json(export.spec("session")))
    assert {t["name"]: t["origin"] for t in data["triggers"]} == {
        t: o.value for t, o in TRIGGER_ORIGINS.items()
    }
    review = export.review_markdown()
    for trigger, origin in TRIGGER_ORIGINS.items():
        assert f"| `{trigger}` | {origin.value} |" in review
