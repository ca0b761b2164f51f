"""The committed Mermaid, DOT and design-review exports, parsed back, say exactly what the live
Machines say: every transition with its guards (``not`` and ``else`` included), target and
effects, and nothing else.

Independent of the export code on purpose: the reference is read here straight from each
transitions Machine (not through ``chartspec``), the DOT is parsed by Graphviz itself
(``dot -Tjson``), and labels are parsed by the small grammar below, never by the functions that
wrote them. A test that compared an export with the label function that wrote it could not see
a label losing its ``not`` (issue 31, gap c), and one that only looked for the state names could
not see the DOT dropping every in-state transition (gap b)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

from duplex_actors.core import statechart as session_chart
from duplex_actors.tooling import lifecycles

ROOT = Path(__file__).resolve().parents[2]
CHARTS = ROOT / "statecharts"
REVIEW = ROOT / "docs" / "design-review.md"
MACHINES = {
    "session": session_chart.MACHINE,
    "engine_request": lifecycles.ENGINE_REQUEST_MACHINE,
    "lease": lifecycles.LEASE_MACHINE,
}
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` not installed")

# (source, trigger, target or None for in-state, ((guard, required), ...), (effect, ...), is_else)
Row = tuple


def reference(name: str) -> Counter:
    """Every transition of the Machine; a branch after the first of its (source, trigger) is
    an "else" (tried only when the earlier ones failed)."""
    rows: Counter = Counter()
    for trigger, event in MACHINES[name].events.items():
        for source, transitions in event.transitions.items():
            for i, t in enumerate(transitions):
                guards = tuple((str(c.func), bool(c.target)) for c in t.conditions)
                rows[(source, trigger, t.dest, guards, tuple(str(e) for e in t.after), i > 0)] += 1
    return rows


def ordered_reference(name: str) -> list[Row]:
    states = list(MACHINES[name].states)
    triggers = list(MACHINES[name].events)
    return sorted(
        reference(name).elements(),
        key=lambda r: (states.index(r[0]), triggers.index(r[1])),
    )


# --- the label grammar: `trigger | trigger [guard] / effect, effect` ----------------------------

LABEL = re.compile(r"(?P<triggers>\w+(?: \| \w+)*)(?: \[(?P<guard>[^\]]+)\])?(?: / (?P<effects>.+))?")


def parse_guard(text: str | None) -> tuple[tuple, bool]:
    """``a and not b`` / ``else`` / ``else if a`` -> (((a, True), (b, False)), is_else)."""
    if not text:
        return (), False
    is_else = text == "else" or text.startswith("else if ")
    if text == "else":
        return (), True
    if is_else:
        text = text[len("else if ") :]
    guards = []
    for term in text.split(" and "):
        negated = term.startswith("not ")
        name = term[4:] if negated else term
        assert re.fullmatch(r"\w+", name), f"not a guard name: {term!r} in {text!r}"
        guards.append((name, not negated))
    return tuple(guards), is_else


def parse_label(text: str) -> list[tuple[str, tuple, tuple, bool]]:
    """``(trigger, guards, effects, is_else)`` for each trigger a label names."""
    match = LABEL.fullmatch(text.strip())
    assert match, f"not a transition label: {text!r}"
    guards, is_else = parse_guard(match["guard"])
    effects = tuple(match["effects"].split(", ")) if match["effects"] else ()
    return [(t, guards, effects, is_else) for t in match["triggers"].split(" | ")]


def test_the_label_parser_reads_not_and_else():
    assert parse_label("a | b [x and not y] / e1, e2") == [
        ("a", (("x", True), ("y", False)), ("e1", "e2"), False),
        ("b", (("x", True), ("y", False)), ("e1", "e2"), False),
    ]
    assert parse_label("t [else]") == [("t", (), (), True)]
    assert parse_label("t [else if not z] / e") == [("t", (("z", False),), ("e",), True)]


# --- Mermaid ---------------------------------------------------------------------------------

ARROW = re.compile(r"^    (\w+) --> (\w+) : (.+)$")
INSIDE = re.compile(r"^    (\w+) : (.+)$")
COUNT = re.compile(r"^(\d+) in-state transitions$")


def mermaid_rows(text: str, *, only_from: str | None = None) -> Counter:
    rows: Counter = Counter()
    for line in text.splitlines():
        if match := ARROW.match(line):
            source, target, label = match.groups()
            for trigger, guards, effects, is_else in parse_label(label):
                rows[(source, trigger, target, guards, effects, is_else)] += 1
        elif (match := INSIDE.match(line)) and not COUNT.match(match[2]):
            state, label = match.groups()
            for trigger, guards, effects, is_else in parse_label(label):
                rows[(state, trigger, None, guards, effects, is_else)] += 1
    if only_from is not None:
        assert {r[0] for r in rows} <= {only_from}, f"a view of {only_from} draws another state's transitions"
    return rows


def state_views(name: str) -> dict[str, Path]:
    return {p.name.split(".")[1]: p for p in sorted(CHARTS.glob(f"{name}.*.mmd"))}


@pytest.mark.parametrize("name", MACHINES)
def test_mermaid_parses_back_to_the_machine(name):
    """The state views of a split chart together (or the one file of a small chart) hold every
    transition, each once; a split chart's overview holds every arrow without effects and the
    number of in-state transitions of each state."""
    want = reference(name)
    views = state_views(name)
    overview = (CHARTS / f"{name}.mmd").read_text(encoding="utf-8")
    if not views:
        assert mermaid_rows(overview) == want
        return
    assert set(views) == {r[0] for r in want}, "one view per state that has transitions"
    got: Counter = Counter()
    for state, path in views.items():
        got += mermaid_rows(path.read_text(encoding="utf-8"), only_from=state)
    assert got == want
    arrows: Counter = Counter()
    counts = {}
    for line in overview.splitlines():
        if (match := ARROW.match(line)) and match[2] != "[*]":
            for label in match[3].split("<br/>"):
                for trigger, guards, effects, is_else in parse_label(label):
                    assert effects == (), "the overview leaves effects to the state views"
                    arrows[(match[1], trigger, match[2], guards, is_else)] += 1
        elif (match := INSIDE.match(line)) and (count := COUNT.match(match[2])):
            counts[match[1]] = int(count[1])
    assert arrows == Counter({(s, t, d, g, e): n for (s, t, d, g, _, e), n in want.items() if d is not None})
    internal = Counter(r[0] for r in want.elements() if r[2] is None)
    assert counts == dict(internal)


# --- DOT (parsed by Graphviz) ----------------------------------------------------------------


def dot_rows(dot_source: str) -> Counter:
    done = subprocess.run(["dot", "-Tjson0"], input=dot_source, capture_output=True, text=True, check=True)
    graph = json.loads(done.stdout)
    names = [o["name"] for o in graph["objects"]]
    rows: Counter = Counter()
    for node in graph["objects"]:
        if node["name"].startswith("__"):
            continue
        # An HTML-like label: the state's name in the first row, one in-state transition a row.
        table = ET.fromstring(node["label"])
        cells = ["".join(td.itertext()) for td in table.iter("td")]
        assert cells[0] == node["name"], f"box {node['name']} is titled {cells[0]!r}"
        for label in cells[1:]:
            for trigger, guards, effects, is_else in parse_label(label):
                rows[(node["name"], trigger, None, guards, effects, is_else)] += 1
    for edge in graph.get("edges", []):
        source, target = names[edge["tail"]], names[edge["head"]]
        if source.startswith("__"):
            continue
        assert edge.get("headport") == "name", "arrows attach to the state's name, not to a line of its box"
        label = " ".join(edge["label"].replace("\\n", "\n").replace("\\l", "\n").split())
        for trigger, guards, effects, is_else in parse_label(label):
            rows[(source, trigger, target, guards, effects, is_else)] += 1
    return rows


@needs_dot
@pytest.mark.parametrize("name", MACHINES)
def test_dot_parses_back_to_the_machine(name):
    assert dot_rows((CHARTS / f"{name}.dot").read_text(encoding="utf-8")) == reference(name)


SVG = "{http://www.w3.org/2000/svg}"


def svg_rows(svg: str) -> Counter:
    """What the picture draws: each box's text lines after its title, each arrow's label."""
    rows: Counter = Counter()
    for g in ET.fromstring(svg).iter(f"{SVG}g"):
        title = g.find(f"{SVG}title")
        texts = [t.text or "" for t in g.iter(f"{SVG}text")]
        if g.get("class") == "node" and not title.text.startswith("__"):
            assert texts[0] == title.text, f"box {title.text} is titled {texts[0]!r}"
            for label in texts[1:]:
                for trigger, guards, effects, is_else in parse_label(label):
                    rows[(title.text, trigger, None, guards, effects, is_else)] += 1
        elif g.get("class") == "edge" and not title.text.startswith("__"):
            source, target = title.text.split("->")
            for trigger, guards, effects, is_else in parse_label(" ".join(" ".join(texts).split())):
                rows[(source, trigger, target, guards, effects, is_else)] += 1
    return rows


@pytest.mark.parametrize("name", MACHINES)
def test_svg_draws_what_the_machine_says(name):
    """The committed SVG (the picture the review shows), read as drawn text: the DOT check
    above does not see a renderer, or an SVG written some other way, leaving lines out."""
    assert svg_rows((CHARTS / f"{name}.svg").read_text(encoding="utf-8")) == reference(name)


# --- the design review -------------------------------------------------------------------------


def _cells(line: str) -> list[str]:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def _code(cell: str) -> str:
    return "" if cell == "–" else cell.strip("`")


def review_sections() -> dict[str, str]:
    text = REVIEW.read_text(encoding="utf-8")
    return dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", text, re.M | re.S))


@pytest.mark.parametrize("name", MACHINES)
def test_review_table_parses_back_to_the_machine_in_priority_order(name):
    section = review_sections()[name]
    table = section.split("### Transitions\n\n", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in table.splitlines()[2:]:
        source, trigger, guard, target, effects, _why = _cells(line)
        guards, is_else = parse_guard(_code(guard))
        rows.append(
            (
                _code(source),
                _code(trigger),
                None if target == "(internal)" else _code(target),
                guards,
                tuple(_code(e) for e in effects.split(", ")) if effects != "–" else (),
                is_else,
            )
        )
    assert rows == ordered_reference(name)


@pytest.mark.parametrize("name", MACHINES)
def test_review_shows_the_committed_pictures(name):
    """The review embeds the SVG Graphviz rendered and the very Mermaid text of the committed
    files (the render test draws those), each state view under its own heading."""
    section = review_sections()[name]
    images = re.findall(r"!\[[^\]]*\]\(\.\./statecharts/([\w.]+\.svg)\)", section)
    assert images == [f"{name}.svg"] and (CHARTS / images[0]).exists()
    blocks = re.findall(r"```mermaid\n(.*?)```", section, re.S)
    files = [CHARTS / f"{name}.mmd", *state_views(name).values()]
    assert sorted(blocks) == sorted(p.read_text(encoding="utf-8") for p in files)
    for state in state_views(name):
        assert f"### From `{state}`" in section
