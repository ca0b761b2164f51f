"""Every committed Mermaid file renders with Mermaid's own renderer, each state box titled with
its state's name.

The renderer is mermaid-cli driving a headless chromium (set up by ``.ci/mermaid.sh``, which CI
runs). Where it is not set up the test is skipped, unless ``DUPLEX_REQUIRE_MERMAID=1`` says it
must run (CI sets that, so a broken setup fails instead of skipping)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MMDC = ROOT / ".ci" / "mermaid" / "node_modules" / ".bin" / "mmdc"
PUPPETEER_CONFIG = ROOT / ".ci" / "mermaid" / "puppeteer.json"
CHROMIUM = (
    os.environ.get("DUPLEX_MERMAID_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
)
COMMITTED = sorted([*ROOT.glob("statecharts/*.mmd"), *ROOT.glob("docs/**/*.mmd")])


def _renderer_missing() -> str | None:
    if not MMDC.exists():
        return f"{MMDC} not installed (run .ci/mermaid.sh)"
    if not CHROMIUM:
        return "no chromium to render with"
    return None


@pytest.fixture(scope="module")
def render():
    missing = _renderer_missing()
    if missing:
        if os.environ.get("DUPLEX_REQUIRE_MERMAID") == "1":
            pytest.fail(missing)
        pytest.skip(missing)

    def run(source: Path, out: Path) -> str:
        env = dict(os.environ, PUPPETEER_EXECUTABLE_PATH=CHROMIUM)
        done = subprocess.run(
            [str(MMDC), "--quiet", "-p", str(PUPPETEER_CONFIG), "-i", str(source), "-o", str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, f"mermaid could not render {source.name}:\n{done.stderr[-2000:]}"
        return out.read_text(encoding="utf-8")

    return run


def box_titles(svg: str) -> dict[str, str]:
    """State id -> the first label drawn in its box (the box's title)."""
    titles = {}
    for node in re.split(r'(?=<g class="node )', svg)[1:]:
        ident = re.match(r'<g class="node\s+statediagram-state" id="[\w-]*?state-(\w+?)-\d+"', node)
        label = re.search(r"<p>([^<]*)", node)
        if ident and label:
            titles[ident.group(1)] = label.group(1)
    return titles


def test_there_are_committed_charts_to_render():
    assert COMMITTED, "no committed .mmd files found"


@pytest.mark.slow
@pytest.mark.parametrize("source", COMMITTED, ids=lambda p: p.name)
def test_committed_mermaid_renders_with_each_box_titled_by_its_state(source, render, tmp_path):
    text = source.read_text(encoding="utf-8")
    svg = render(source, tmp_path / (source.stem + ".svg"))
    states = re.findall(r'^    state "([^"]+)" as (\w+)$', text, re.M)
    assert states, f"{source.name} declares no states"
    titles = box_titles(svg)
    for name, ident in states:
        assert titles.get(ident) == name, f"{source.name}: box {ident} is titled {titles.get(ident)!r}"


def test_the_title_check_catches_a_box_titled_by_a_self_transition(render, tmp_path):
    # The way the export used to write a state with self-transitions: no declaration first.
    source = tmp_path / "old.mmd"
    source.write_text(
        "stateDiagram-v2\n    [*] --> idle\n    idle : heartbeat / touch_lease\n    idle --> done : close\n",
        encoding="utf-8",
    )
    titles = box_titles(render(source, tmp_path / "old.svg"))
    assert titles.get("idle") == "heartbeat / touch_lease"
