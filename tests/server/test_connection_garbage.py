"""A closed connection is freed by reference counting, leaving no cyclic garbage of ours.

Why it matters: serve's GcPolicy freezes what survives (actors/gc_policy.py), so a cycle that
outlives its connection is only freed by a full collection, a stall of the whole loop that
grows with every live session (0.8-1.2 s at 10,000). Each closed connection used to leave
150-270 objects in cycles (the read queue's flow callbacks, websockets' subprotocol selector
bound to its protocol, anyio's record of the cancelled writer, the protocol's parser left
suspended holding it, asyncio's transport with the bound read callback it keeps on itself); after a resume storm those were what the reclaim had to
walk the whole heap for.
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


def _protocols_held_by_their_parser() -> int:
    """Server protocols whose parser (a generator of theirs, left suspended once the
    connection ended) still holds them: a cycle that only a collection frees."""
    from websockets.server import ServerProtocol

    return sum(
        1
        for o in gc.get_objects()
        if type(o) is ServerProtocol  # (not isinstance: the heap holds weak proxies too)
        and getattr(o.parser, "gi_frame", None) is not None
        and o.parser.gi_frame.f_locals.get("self") is o
    )


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


async def _refused_1009(url: str) -> None:
    # A deflate bomb: the server fails the connection (1009) and cuts it; the client reads the
    # close and cuts its socket too.
    from .test_edge_memory import _bomb, _bomb_once

    assert await _bomb_once(int(url.rsplit(":", 1)[1].split("/", 1)[0]), _bomb()) == 1009


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
        _refused_1009,
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
            # No connection or transport outlives its close: the census (of the server's
            # connections and transports) counts none without a collection, and a collection
            # finds no server-side object. (The test's own client transports, in this process
            # too, are asyncio's cycles: not looked for.)
            assert LINGERING.connections == 0
            assert LINGERING.transports == 0
            assert _protocols_held_by_their_parser() == 0
            assert _server_side_garbage() == []
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
