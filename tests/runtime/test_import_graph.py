"""The actor shell's modules import one another without a cycle, counting imports made only
for type checking too (a cycle there still ties the modules together for readers and tools)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "duplex_actors"


def _local_imports(path: Path, package: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            found.add(f"{package}.{node.module.split('.')[0]}")
    return found


def test_the_actor_modules_import_without_a_cycle():
    graph = {f"actors.{p.stem}": _local_imports(p, "actors") for p in (PACKAGE / "actors").glob("*.py")}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(module for module in graph if reaches(module, module, {module}))
    assert cycles == []
