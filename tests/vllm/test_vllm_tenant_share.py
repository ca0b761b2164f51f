"""vLLM's waiting queue, shared by tenant: when the batch is full, a neighbour's request is
admitted before one client's many queued ones (priority = the tenant's requests in flight)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")

from .support import Decision, make_request, wait_until

pytestmark = pytest.mark.vllm


def test_a_tenants_waiting_requests_do_not_hold_a_neighbours_behind_them_all(tiny_model_path):
    from duplex_actors.engines.vllm_engine import VllmEngine

    # A batch of one, so the order of admission is the order of first tokens.
    engine = VllmEngine(
        tiny_model_path,
        max_model_len=1024,
        max_num_seqs=1,
        kv_cache_space_gib=1,
        sampling_defaults={"ignore_eos": True},
    )
    order: list[str] = []

    async def one(request, name: str) -> None:
        async for out in engine.generate(request):
            if isinstance(out, Decision):
                order.append(name)

    async def scenario() -> list[str]:
        await engine.start()
        try:
            # The flooder's first request takes the one slot, long enough to outlast the rest
            # being queued; then four more of its requests, then the neighbour's.
            tasks = [asyncio.create_task(one(make_request(600, tenant="key:flooder"), "flood0"))]
            assert await wait_until(lambda: order == ["flood0"], timeout=60)
            for i in range(1, 5):
                tasks.append(asyncio.create_task(one(make_request(8, tenant="key:flooder"), f"flood{i}")))
            await asyncio.sleep(0.2)  # all four reach vLLM's waiting queue first
            tasks.append(asyncio.create_task(one(make_request(8, tenant="key:neighbour"), "mine")))
            await asyncio.gather(*tasks)
            return order
        finally:
            await engine.aclose()

    runner = asyncio.Runner()
    try:
        order = runner.run(asyncio.wait_for(scenario(), 300))
    finally:
        runner.close()
    # First come, first served, the neighbour would be last; by tenant it is next.
    assert order[:2] == ["flood0", "mine"], order
    assert sorted(order[2:]) == ["flood1", "flood2", "flood3", "flood4"]
