"""The server's connections follow the connection chart: every way a real connection ends goes
through the chart's triggers, in the states the chart names, with the close code it chooses."""

from __future__ import annotations

import json

import anyio
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from duplex_actors.core import connection_chart as chart
from duplex_actors.core.connection_chart import ConnectionLifecycle
from duplex_actors.server.app import CLOSE_GOING_AWAY, CLOSE_POLICY_VIOLATION, CLOSE_SUPERSEDED

from .conftest import recv_json, recv_until, resume_frame, running_server

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

GRACE = {"disconnect_grace_s": 30.0}


@pytest.fixture
def steps(monkeypatch):
    """Every step any connection takes: {connection: [(source, trigger, dest), ...]}."""
    # Keyed by the lifecycle itself, which the dict keeps alive: keyed by id(), a freed
    # connection's id was reused by the next one, merging two paths into one.
    taken: dict[ConnectionLifecycle, list[tuple[str, str, str]]] = {}
    fire = ConnectionLifecycle.fire

    def recording_fire(self, trigger, facts=chart.NO_FACTS):
        before = self.state
        effects = fire(self, trigger, facts)
        taken.setdefault(self, []).append((before, trigger, self.state))
        return effects

    monkeypatch.setattr(ConnectionLifecycle, "fire", recording_fire)
    return taken


async def _ended(steps, count: int = 1) -> list[list[tuple[str, str, str]]]:
    """The paths of the first ``count`` connections, once each has seen its socket lost."""
    with anyio.fail_after(5):
        while sum(1 for path in steps.values() if path[-1][1] == "socket_lost") < count:
            await anyio.sleep(0.01)
    return list(steps.values())


async def test_a_goodbye_closes_the_session(steps):
    async with running_server(session_overrides=GRACE) as server:
        async with connect(server.url) as ws:
            sid = (await recv_json(ws))["session"]["id"]
        (path,) = await _ended(steps)
        assert path == [("attached", "socket_lost", "closed")]
        with anyio.fail_after(5):
            while sid in server._records:
                await anyio.sleep(0.01)


async def test_a_lost_socket_detaches_the_session(steps):
    async with running_server(session_overrides=GRACE) as server:
        ws = await connect(server.url)
        sid = (await recv_json(ws))["session"]["id"]
        ws.transport.abort()
        (path,) = await _ended(steps)
        assert path == [("attached", "socket_lost", "detached")]
        assert server.runtime.get(sid).state != "closed"
        assert server._records[sid].attached is None


async def test_a_resume_supersedes_the_older_connection(steps):
    async with running_server(session_overrides=GRACE) as server:
        old = await connect(server.url)
        created = await recv_json(old)
        sid, token = created["session"]["id"], created["resume_token"]
        async with connect(f"{server.url}?session_id={sid}") as new:
            await new.send(resume_frame(session_id=sid, generation=0, resume_token=token, last_seq=1))
            assert (await recv_json(new))["type"] == "session.resumed"
            with pytest.raises(ConnectionClosed):
                await recv_json(old)
            assert old.close_code == CLOSE_SUPERSEDED
            (path,) = await _ended(steps)
            assert path == [
                ("attached", "takeover", "superseded"),
                ("superseded", "socket_lost", "superseded"),
            ]
            assert server._records[sid].attached.lifecycle.state == "attached"
            assert server.runtime.get(sid).state != "closed"


async def test_a_shutdown_drains_then_closes_with_going_away(steps):
    async with running_server(session_overrides=GRACE) as server:
        ws = await connect(server.url)
        await recv_json(ws)
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.shutdown, 1.0)
            events = await recv_until(ws, "session.closed")
            with pytest.raises(ConnectionClosed):
                await recv_json(ws)
        assert events[-1]["reason"] == "runtime_shutdown"
        assert ws.close_code == CLOSE_GOING_AWAY
        (path,) = await _ended(steps)
        assert path[:2] == [("attached", "drain", "draining"), ("draining", "session_closed", "closed")]
        assert path[-1] == ("closed", "socket_lost", "closed")


async def test_a_flood_closes_the_session_with_the_policy_code(steps):
    async with running_server(invalid_frames_per_s=1.0, invalid_frames_burst=3) as server:
        async with connect(server.url) as ws:
            await recv_json(ws)
            for i in range(10):
                await ws.send(f"not json {i}")
            with pytest.raises(ConnectionClosed):
                while True:
                    event = await recv_json(ws)
                    if event["type"] == "session.closed":
                        assert event["reason"] == "invalid_frame_flood"
            assert ws.close_code == CLOSE_POLICY_VIOLATION
        (path,) = await _ended(steps)
        assert path[0] == ("attached", "flood", "attached")
        assert ("attached", "session_closed", "closed") in path
        assert path[-1] == ("closed", "socket_lost", "closed")


async def test_every_step_the_server_took_is_a_row_of_the_chart(steps):
    """Across the scenarios above (run again here together), no step was refused."""
    async with running_server(session_overrides=GRACE) as server:
        for _ in range(3):
            async with connect(server.url) as ws:
                await recv_json(ws)
                await ws.send(json.dumps({"type": "response.create"}))
                await recv_until(ws, "response.created")
        paths = await _ended(steps, 3)
    for path in paths:
        for source, trigger, dest in path:
            assert any(step.dest == dest for _, step in chart.TABLE[(source, trigger)])
