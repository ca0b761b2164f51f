"""Everything at once: many sessions on an engine that raises, hangs, truncates, is slow and
fails aborts, while clients barge in, cancel, close, and vanish mid-response. Afterwards every
session's stream is whole, every terminal happened exactly once and nothing leaked."""

from __future__ import annotations

import random

import anyio
import pytest

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.errors import DuplexError
from duplex_actors.testing.faults import Fault, FaultyEngine

from .conftest import CHUNK, audit, settle

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("seed", [0, 1])
async def test_fault_matrix(seed):
    rng = random.Random(seed)

    def sometimes(p):
        return lambda request: rng.random() < p

    engine = FaultyEngine(
        ScriptedEngine(Script(token_latency_s=0.002, packet_latency_s=0.002)),
        [
            Fault.raise_after(3, times=None, match=sometimes(0.08)),
            Fault.truncate_after(2, times=None, match=sometimes(0.08)),
            Fault.hang_after(2, times=3, match=sometimes(0.05)),
            Fault.slow(0.01, match=sometimes(0.2)),
        ],
        abort_failures=15,
    )
    streams: dict[str, list] = {}
    vanished: list = []
    async with Runtime(engine, stall_timeout_s=0.4, reaper_interval_s=0.05) as rt:

        async def client(i: int) -> None:
            crng = random.Random(rng.getrandbits(32))
            s = await rt.open_session(disconnect_grace_s=0.2)
            got = streams.setdefault(s.id, [])
            vanish = crng.random() < 0.15

            async def reader():
                async for event in s.events():
                    got.append(event)

            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                for _ in range(crng.randint(2, 6)):
                    s.append_audio(CHUNK * crng.randint(1, 5))
                    try:
                        await s.commit()
                        await anyio.sleep(crng.uniform(0, 0.03))
                        roll = crng.random()
                        if roll < 0.25:
                            await s.barge_in()
                        elif roll < 0.35:
                            await s.cancel()
                    except DuplexError:
                        pass  # typed refusals (e.g. a response still running) are fine
                    if vanish and crng.random() < 0.5:
                        break
                    await anyio.sleep(crng.uniform(0, 0.05))
                if vanish:
                    # The client disappears mid-response: stops reading, the transport drops.
                    tg.cancel_scope.cancel()
                else:
                    await s.close()
            if vanish:
                await s.detach()
                vanished.append(s)

        async with anyio.create_task_group() as tg:
            for i in range(40):
                tg.start_soon(client, i)
        # The vanished ones are reaped after the disconnect grace; read what they left.
        for s in vanished:
            async for event in s.events():
                streams[s.id].append(event)
        assert rt.session_count == 0
        await settle(rt, timeout=5.0, backend=engine)

    assert sum(engine.injected.values()) > 5, engine.injected
    for _sid, events in streams.items():
        audit(events)
    reasons = {events[-1].reason for events in streams.values()}
    assert reasons <= {"client_closed", "disconnect_grace_expired"}
    if vanished:
        assert "disconnect_grace_expired" in reasons
