"""The pytest plugin leaves the library alone: pytest marks every top-level package of a
distribution that declares a ``pytest11`` entry point for assertion rewriting, so without care
each duplex_actors module imported during a test run goes through pytest's AST rewriter. On
CPython 3.11.7 compiling a rewritten module from deep inside an async test can fail with
``SystemError: AST constructor recursion depth mismatch``. The plugin module itself imports
nothing of the library and un-marks it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    env.pop("PYTEST_ADDOPTS", None)
    return env


LAZY_IMPORT_TEST = """
import importlib


def test_modules_imported_during_a_test_are_not_rewritten():
    for name in ("duplex_actors.tooling.scxml", "duplex_actors.testing.strategies"):
        module = importlib.import_module(name)
        assert type(module.__loader__).__name__ != "AssertionRewritingHook", name
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "plugin_args",
    [
        [],  # whatever entry point the installed distribution declares
        ["-p", "no:duplex_actors", "-p", "duplex_actors_pytest"],  # the top-level module itself
    ],
    ids=["installed-entry-point", "top-level-module"],
)
def test_library_modules_imported_during_tests_are_not_assertion_rewritten(tmp_path, plugin_args):
    (tmp_path / "test_lazy.py").write_text(LAZY_IMPORT_TEST, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin_args, str(tmp_path)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout


def test_the_plugin_module_imports_nothing_of_the_library():
    probe = (
        "import sys, duplex_actors_pytest; "
        "print(sorted(m for m in sys.modules if m.startswith('duplex_actors')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['duplex_actors_pytest']"


def test_the_entry_point_names_the_light_plugin_module():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["entry-points"]["pytest11"] == {"duplex_actors": "duplex_actors_pytest"}
    assert "duplex_actors_pytest" in project["tool"]["setuptools"]["py-modules"]
