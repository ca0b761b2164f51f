"""The runtime's GC policy: opt-in, reversible, and safe for what it freezes."""

import gc
import weakref

import anyio
import pytest

from duplex_actors import GcPolicy, Runtime, ScriptedEngine
from duplex_actors.actors import gc_policy

CHUNK = b"\x01\x00" * 320
pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


async def test_no_policy_leaves_the_collector_alone():
    before = gc.get_threshold(), gc.get_freeze_count()
    async with Runtime(ScriptedEngine(), reaper_interval_s=0):
        assert (gc.get_threshold(), gc.get_freeze_count()) == before


async def test_policy_applies_and_restores():
    before = gc.get_threshold()
    policy = GcPolicy(freeze_interval_s=0.01, gen0_threshold=1234)
    async with Runtime(ScriptedEngine(), reaper_interval_s=0, gc_policy=policy):
        assert gc.get_threshold()[0] == 1234
        assert gc.get_freeze_count() > 0
        # nested runtimes share it; the inner one leaving does not undo the outer one's
        async with Runtime(ScriptedEngine(), reaper_interval_s=0, gc_policy=GcPolicy()):
            pass
        assert gc.get_threshold()[0] == 1234
        await anyio.sleep(0.05)  # a few periodic freezes
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
    assert not gc_policy._active


async def test_closed_sessions_are_freed_while_frozen():
    """What the policy freezes must die by reference counting alone, or it would leak."""
    refs = []
    policy = GcPolicy(freeze_interval_s=0.005)
    async with Runtime(ScriptedEngine(), reaper_interval_s=0, gc_policy=policy) as rt:
        for _ in range(3):
            session = await rt.open_session()
            session.append_audio(CHUNK)
            await session.commit()
            with anyio.fail_after(5):
                async for event in session.events():
                    if event.type == "response.done":
                        break
            await anyio.sleep(0.02)  # frozen mid-life, journal and all
            await session.close()
            async for _event in session.events():
                pass
            refs.append(weakref.ref(session.core))
            refs.append(weakref.ref(session._actor))
            del session, event
        # the dispatcher's loop variable still names the last actor it ran: move it on
        await (await rt.open_session()).heartbeat()
        await anyio.sleep(0.02)
        gc_policy.freeze_young()
        assert [r for r in refs if r() is not None] == []


async def test_reclaim_takes_back_cycles_frozen_while_alive():
    class Node:
        pass

    # growth 0: every interval reclaims, whatever the memory did
    policy = GcPolicy(
        freeze_interval_s=None, reclaim_interval_s=0.02, reclaim_growth=0, reclaim_min_growth_mb=0
    )
    async with Runtime(ScriptedEngine(), reaper_interval_s=0, gc_policy=policy):
        a, b = Node(), Node()
        a.other, b.other = b, a
        ref = weakref.ref(a)
        gc.freeze()  # as the policy's periodic freeze would, while the pair is alive
        del a, b
        gc.collect()
        assert ref() is not None  # frozen: a full collection does not see it
        await anyio.sleep(0.1)  # a periodic reclaim
        assert ref() is None


def test_a_reclaim_is_due_only_once_memory_grew():
    policy = GcPolicy()  # 25 %, and at least 32 MiB
    mib = 1 << 20
    assert not gc_policy.reclaim_due(policy, 1000 * mib, 1000 * mib)
    assert not gc_policy.reclaim_due(policy, 1200 * mib, 1000 * mib)
    assert gc_policy.reclaim_due(policy, 1250 * mib, 1000 * mib)
    assert not gc_policy.reclaim_due(policy, 120 * mib, 100 * mib)  # under the 32 MiB floor
    assert gc_policy.reclaim_due(policy, 132 * mib, 100 * mib)
    assert gc_policy.reclaim_due(policy, None, None)  # memory unreadable: as before, always


def test_with_an_estimate_of_the_garbage_growth_alone_buys_no_reclaim():
    """serve knows what closed connections left (server/lingering.py): a resume storm grows
    memory with live connections and has nothing to free, so only garbage, or memory grown
    past what the estimate could miss, makes a reclaim worth its stall."""
    policy = GcPolicy()  # 32 MiB of garbage and 25 % of resident memory; 1 GiB unseen
    mib = 1 << 20
    assert not gc_policy.reclaim_due(policy, 400 * mib, 150 * mib, garbage=0)  # storm: +250 MiB
    assert not gc_policy.reclaim_due(policy, 400 * mib, 150 * mib, garbage=60 * mib)  # < 25 %
    assert gc_policy.reclaim_due(policy, 400 * mib, 150 * mib, garbage=100 * mib)
    assert not gc_policy.reclaim_due(policy, 100 * mib, 100 * mib, garbage=20 * mib)  # < 32 MiB
    assert gc_policy.reclaim_due(policy, 1300 * mib, 150 * mib, garbage=0)  # +1,150 MiB unseen
    assert gc_policy.reclaim_due(policy, None, None, garbage=0)  # memory unreadable


async def test_the_periodic_reclaim_asks_the_estimate(monkeypatch):
    garbage = [0]
    reclaims = []
    monkeypatch.setattr(gc_policy, "resident_bytes", lambda: 500 << 20)
    monkeypatch.setattr(gc_policy, "reclaim", lambda: reclaims.append(garbage[0]) or 0)
    policy = GcPolicy(freeze_interval_s=0.005, reclaim_interval_s=0.02, garbage_estimate=lambda: garbage[0])
    async with Runtime(ScriptedEngine(), reaper_interval_s=0, gc_policy=policy):
        await anyio.sleep(0.2)
        assert reclaims == []
        garbage[0] = 200 << 20
        await anyio.sleep(0.1)
        assert reclaims and set(reclaims) == {200 << 20}


async def test_the_periodic_reclaim_waits_for_growth(monkeypatch):
    resident = [500 << 20]
    reclaims = []
    monkeypatch.setattr(gc_policy, "resident_bytes", lambda: resident[0])
    monkeypatch.setattr(gc_policy, "reclaim", lambda: reclaims.append(resident[0]) or 0)
    policy = GcPolicy(freeze_interval_s=0.005, reclaim_interval_s=0.02)
    async with Runtime(ScriptedEngine(), reaper_interval_s=0, gc_policy=policy):
        await anyio.sleep(0.2)  # ten intervals, memory flat: nothing to find, no full pause
        assert reclaims == []
        resident[0] = 700 << 20
        await anyio.sleep(0.1)
        assert reclaims == [700 << 20]  # once: the next intervals compare with 700 MiB
