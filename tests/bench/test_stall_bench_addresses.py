"""The mass-resume bench counts each of its clients as its own address everywhere the server
reads one. When http_gate.py was split out of app.py with its own ``_address``, the bench kept
patching app alone: every storm handshake was then charged to 127.0.0.1 (the neighbour's own
tenant in the loop share), and the bench measured a storm from one address instead of 1,000."""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest

import duplex_actors.server
from duplex_actors.bench import stall_bench


def _modules_reading_addresses() -> set[str]:
    found = set()
    for info in pkgutil.iter_modules(duplex_actors.server.__path__):
        module = importlib.import_module(f"duplex_actors.server.{info.name}")
        if callable(getattr(module, "_address", None)):
            found.add(info.name)
    return found


def test_every_server_module_with_its_own_address_reader_is_simulated():
    assert _modules_reading_addresses() == set(stall_bench.ADDRESS_READERS)


def _ws(client: str | None):
    headers = {stall_bench.CLIENT_HEADER: client} if client is not None else {}
    return types.SimpleNamespace(
        request=types.SimpleNamespace(headers=headers), remote_address=("127.0.0.1", 5)
    )


@pytest.fixture
def restored_readers():
    modules = stall_bench._address_readers()
    saved = [module._address for module in modules]
    yield modules
    for module, address in zip(modules, saved, strict=True):
        module._address = address


def test_the_simulation_gives_every_reader_the_bench_clients_address(restored_readers):
    stall_bench._simulate_addresses()
    for module in restored_readers:
        assert module._address(_ws("7")) == "bench-client-7", module.__name__
        # a connection without the header (the neighbour) keeps its real address
        assert module._address(_ws(None)) == "127.0.0.1", module.__name__


@pytest.mark.anyio
async def test_run_puts_every_reader_back(restored_readers, monkeypatch):
    before = [module._address for module in restored_readers]

    async def simulated_run(*args, **kwargs):
        stall_bench._simulate_addresses()
        return {}

    monkeypatch.setattr(stall_bench, "_run", simulated_run)
    await stall_bench.run(1, 0.1, 1.0)
    assert [module._address for module in restored_readers] == before
