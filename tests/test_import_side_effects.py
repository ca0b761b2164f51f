"""Importing the library configures nothing; the entry points configure logging.

Each check runs in a fresh interpreter: the test process itself has structlog configured
(tests/conftest.py), as an application would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

#: The package and the modules an application imports from it (the server's, the test kit's).
MODULES = (
    "duplex_actors",
    "duplex_actors.actors.runtime",
    "duplex_actors.core.session",
    "duplex_actors.server.app",
    "duplex_actors.server.workers",
    "duplex_actors.client",
    "duplex_actors.testing",
    "duplex_actors.cli",
)


def _run(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", MODULES)
def test_importing_leaves_structlog_and_the_root_logger_alone(module):
    seen = _run(
        f"""
        import json, logging
        root = logging.getLogger()
        before = (root.level, list(root.handlers), logging.getLoggerClass())
        import structlog
        import {module}
        after = (root.level, list(root.handlers), logging.getLoggerClass())
        print(json.dumps({{"configured": structlog.is_configured(), "root_same": before == after}}))
        """
    )
    assert seen == {"configured": False, "root_same": True}


def test_an_unconfigured_core_logs_no_transitions():
    # structlog's defaults print every event to stdout: the core must not build its debug
    # lines unless an application (or an entry point) configured structlog to show them.
    code = """
        import json
        import structlog
        from duplex_actors import ManualClock, SessionConfig, SessionCore
        from duplex_actors.core import commands as cmd
        core = SessionCore("sess_quiet", SessionConfig(), ManualClock(1.0))
        for _ in range(3):
            core.handle(cmd.AppendAudio(pcm=b"\\0\\0" * 320))
        core.handle(cmd.CommitInput())
        print(json.dumps({"configured": structlog.is_configured()}))
    """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines() == ['{"configured": false}']


def test_the_command_line_configures_logging():
    seen = _run(
        """
        import json
        import structlog
        from typer.testing import CliRunner
        from duplex_actors.cli import app
        result = CliRunner().invoke(app, ["version"])
        print(json.dumps({"exit": result.exit_code, "configured": structlog.is_configured()}))
        """
    )
    assert seen == {"exit": 0, "configured": True}


def test_a_configured_application_sees_the_core_transitions():
    seen = _run(
        """
        import json
        import structlog
        from duplex_actors import ManualClock, SessionConfig, SessionCore
        from duplex_actors.core import commands as cmd
        from duplex_actors.logconfig import configure
        configure("debug")
        with structlog.testing.capture_logs() as logs:
            core = SessionCore("sess_loud", SessionConfig(), ManualClock(1.0))
            core.handle(cmd.AppendAudio(pcm=b"\\0\\0" * 320))
        moves = [(e["src"], e["dest"]) for e in logs if e["event"] == "transition"]
        print(json.dumps({"moves": moves}))
        """
    )
    assert seen == {"moves": [["idle", "listening"]]}
