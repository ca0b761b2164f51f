"""One local Ray instance for the whole test session (starting one takes seconds and ~0.7 GB).

Loopback only, no dashboard, no usage stats, no auth token in ~/.ray, and Ray's temp dir in a
short scratch folder (Ray's Unix socket paths must stay under ~107 bytes). Set
``DUPLEX_RAY_TMP`` to choose the parent folder (default: the system temp dir).

Loopback: ``ray.init(_node_ip_address="127.0.0.1")`` is not enough, Ray resolves a loopback
address back to the machine's routable one. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (Ray's
single-machine mode, the default on macOS) keeps every server on 127.0.0.1; Ray reads it at
import, so it is set here, before any test module imports Ray.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def pytest_configure(config: pytest.Config) -> None:
    # Harmless if pyproject already declares it; needed when this folder is run on its own.
    config.addinivalue_line("markers", "ray: needs Ray")


@pytest.fixture
def anyio_backend():
    return "asyncio"


def remove_when_quiet(path: str, attempts: int = 10) -> None:
    """Ray's helper processes may still write a file or two just after shutdown."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        time.sleep(0.2)
        if not os.path.exists(path):
            return


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # someone else's cluster: use it, leave it running
        yield ray
        return
    temp_dir = tempfile.mkdtemp(prefix="dxray", dir=os.environ.get("DUPLEX_RAY_TMP"))
    try:
        context = ray.init(
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=256 * 1024 * 1024,
            _temp_dir=temp_dir,
            log_to_driver=False,
        )
        node_ip = context.address_info["node_ip_address"]
        if node_ip != "127.0.0.1":
            ray.shutdown()
            pytest.fail(
                f"Ray bound to {node_ip}, not loopback: was Ray imported before "
                "tests/ray/conftest.py set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0?"
            )
        yield ray
    finally:
        if ray.is_initialized():
            ray.shutdown()
        remove_when_quiet(temp_dir)
