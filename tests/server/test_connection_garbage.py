"""A closed connection is freed by reference counting, leaving no cyclic garbage of ours.

Why it matters: serve's GcPolicy freezes what survives (actors/gc_policy.py), so a cycle that
outlives its connection is only freed by a full collection, a stall of the whole loop that
grows with every live session (0.8-1.2 s at 10,000). Each closed connection used to leave
150-270 objects in cycles (the read queue's flow callbacks, websockets' subprotocol selector
bound to its protocol, anyio's record of the cancelled writer); after a resume storm those were
what the reclaim had to walk the whole heap for. What is left is asyncio's own transport (a
bound method it keeps on itself), a few small objects, not ours to break.
"""

from __future__ import annotations

import asyncio
import gc
import json

import pytest

pytest.importorskip("websockets")

from websockets.asyncio.client import connect

from duplex_actors.server.lingering import LINGERING

from .conftest import recv_json, recv_until, resume_frame, running_server

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _server_side_garbage() -> list[str]:
    """Types of the cyclic garbage a full collection finds now that the server owns: our
    objects, websockets' server side, asyncio tasks and their cancellations."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = [
            f"{type(o).__module__}.{type(o).__qualname__}"
            for o in gc.garbage
            if type(o).__module__.startswith("duplex_actors")
            or type(o).__qualname__ in ("ServerProtocol", "ServerConnection", "Task", "CancelledError")
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.collect()
    return found


async def _close_after_created(url: str) -> None:
    async with connect(url) as ws:
        await recv_json(ws)


async def _close_after_a_turn(url: str) -> None:
    async with connect(url) as ws:
        await recv_json(ws)
        await ws.send(json.dumps({"type": "response.create"}))
        await recv_until(ws, "response.done")


async def _close_mid_response(url: str) -> None:
    async with connect(url) as ws:
        await recv_json(ws)
        await ws.send(json.dumps({"type": "response.create"}))
        await recv_until(ws, "response.created")


async def _drop_without_a_close_frame(url: str) -> None:
    ws = await connect(url)
    await recv_json(ws)
    ws.transport.abort()


async def _pushed_out_by_a_resume(url: str) -> None:
    old = await connect(url)
    created = await recv_json(old)
    sid, token = created["session"]["id"], created["resume_token"]
    async with connect(f"{url}?session_id={sid}") as new:
        await new.send(resume_frame(session_id=sid, generation=0, resume_token=token, last_seq=1))
        assert (await recv_json(new))["type"] == "session.resumed"
        await old.wait_closed()


@pytest.mark.slow
@pytest.mark.parametrize(
    "scenario",
    [
        _close_after_created,
        _close_after_a_turn,
        _close_mid_response,
        _drop_without_a_close_frame,
        _pushed_out_by_a_resume,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
async def test_a_closed_connection_leaves_no_cyclic_garbage_of_ours(scenario):
    async with running_server(session_overrides={"disconnect_grace_s": 0.2}) as server:
        await _close_after_created(server.url)  # first-use caches and lazy imports
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):
                await scenario(server.url)
            # the server notices the close, the session's disconnect grace runs out, it is reaped
            await asyncio.sleep(1.0)
            server.runtime.reap_now()
            await asyncio.sleep(0.2)
            # The census saw the closed transports that asyncio's own cycle keeps, and no
            # connection outliving its close.
            assert LINGERING.connections == 0
            assert LINGERING.transports >= 3
            assert _server_side_garbage() == []
            assert LINGERING.transports == 0
        finally:
            gc.enable()


def test_the_census_counts_a_closed_connection_only_once_it_outlived_a_period():
    """A connection still held right after its close (its handler finishing, a takeover) is
    not garbage: it counts toward a reclaim only if it is still alive a period later."""
    from duplex_actors.server.lingering import CONNECTION_BYTES, TRANSPORT_BYTES, Lingering

    class Thing:
        pass

    census = Lingering()
    held, leaked, transport = Thing(), Thing(), Thing()
    census.closed(held, None)
    census.closed(leaked, transport)
    assert census.connections == 2 and census.transports == 1
    assert census.estimate_bytes() == 0  # both closed in this period
    del held  # its handler let it go
    assert census.estimate_bytes() == CONNECTION_BYTES + TRANSPORT_BYTES
    del leaked, transport
    assert census.estimate_bytes() == 0 and census.connections == census.transports == 0
