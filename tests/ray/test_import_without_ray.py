"""The Ray backend module must cost nothing where Ray is not installed (no Ray needed here)."""

import subprocess
import sys

PROBE = """
import sys
sys.modules["ray"] = None  # any 'import ray' now raises ImportError
from duplex_actors.engines.ray_engine import RayEngine, EngineHost, RayEngineStatistics
from duplex_actors import ScriptedEngine
engine = RayEngine(ScriptedEngine)
assert engine.name == "ray" and not engine.running and engine.active == frozenset()
assert "ray" not in [m for m in sys.modules if sys.modules[m] is not None]
try:
    import anyio
    anyio.run(engine.start)
except ImportError:
    print("start-needs-ray")
"""


def test_module_imports_without_ray_and_start_says_why():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "start-needs-ray"
