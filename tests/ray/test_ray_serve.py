"""The Ray Serve application on a real local Ray cluster: router (ingress) + one session-runtime
replica + the engine deployment (autoscaling config pinned to 1 replica). A turn runs through it over a real
websocket, and a dropped session resumes through the router's affinity route."""

from __future__ import annotations

import functools
import json
import socket
import urllib.error
import urllib.request

import anyio
import pytest

pytest.importorskip("ray")
pytest.importorskip("ray.serve")
pytest.importorskip("websockets")

from websockets.asyncio.client import connect

from duplex_actors import Script, ScriptedEngine
from duplex_actors.client import DuplexClient
from duplex_actors.errors import UnknownSession
from duplex_actors.scaleout.ray_serve import build_app, replica_of, shutdown_app

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.anyio, pytest.mark.timeout(300)]
APP = "duplex-test"
HTTP_PORT = 0
CHUNK = b"\x01\x00" * 1600
SLOW = Script(
    token_latency_s=0.02, tokens=tuple(f"w{i} " for i in range(20)), audio_packets=4, packet_latency_s=0.02
)


@pytest.fixture(scope="module")
def router(ray_cluster):
    from ray import serve

    global HTTP_PORT
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        HTTP_PORT = probe.getsockname()[1]
    # Serve's proxy answers GET /route; websockets go straight to the session replicas.
    serve.start(http_options={"host": "127.0.0.1", "port": HTTP_PORT})
    try:
        handle = serve.run(
            build_app(
                functools.partial(ScriptedEngine, SLOW),
                session_replicas=1,
                host="127.0.0.1",
                # max 1: the active-request checks must reach the one replica
                engine_autoscaling={"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 4},
                session_actor_options={"num_cpus": 0},
                engine_actor_options={"num_cpus": 0},
                report_interval_s=0.2,
            ),
            name=APP,
            route_prefix="/",
        )
        yield handle
    finally:
        shutdown_app(APP)
        serve.shutdown()


async def test_a_turn_runs_through_the_session_replica_and_the_engine_deployment(router):
    from ray import serve

    url = await router.route.remote(None)
    async with await DuplexClient.connect(url) as client:
        created = await client.recv()
        assert replica_of(created["session"]["id"]) is not None
        await client.send_audio(CHUNK)
        await client.commit()
        await client.create_response()  # GA: a commit alone only adds the audio
        done, events = await client.wait_for("response.done", timeout=30)
    assert done["response"]["status"] == "completed"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    assert text == "".join(SLOW.tokens)
    app = serve.status().applications[APP]
    assert {"router", "sessions", "engine"} <= set(app.deployments)
    assert all(d.status == "HEALTHY" for d in app.deployments.values())


async def test_a_dropped_session_resumes_through_the_affinity_route_and_misses_nothing(router):
    url = await router.route.remote(None)
    client = await DuplexClient.connect(url, auto_reconnect=False)
    events = [await client.recv()]
    session_id = events[0]["session"]["id"]
    await client.send_audio(CHUNK)
    await client.commit()
    await client.create_response()  # GA: a commit alone only adds the audio
    while events[-1]["type"] != "response.output_audio_transcript.delta":
        events.append(await client.recv(timeout=30))
    # resume from the last event this test read (the client may have buffered more)
    token, generation, last_seq = client.resume_token, client.generation, events[-1]["server_event_seq"]
    client.abort_transport()
    await client.close()

    resume_url = await router.route.remote(session_id)
    assert resume_url == f"{url}?session_id={session_id}"
    async with connect(resume_url) as ws:
        await ws.send(
            json.dumps(
                {
                    "type": "session.resume",
                    "session_id": session_id,
                    "generation": generation,
                    "resume_token": token,
                    "last_seq": last_seq,
                }
            )
        )
        with anyio.fail_after(30):
            while True:
                event = json.loads(await ws.recv())
                events.append(event)
                if event["type"] == "response.done":
                    break
    seqs = [e["server_event_seq"] for e in events]  # session.resumed is in the stream too
    assert seqs == list(range(1, len(seqs) + 1)), "every event exactly once, in order"
    assert [e["type"] for e in events].count("session.resumed") == 1
    assert events[-1]["response"]["status"] == "completed"


async def test_the_route_for_a_session_no_replica_owns_is_unknown_session(router):
    with pytest.raises(UnknownSession):
        await router.route.remote("sess_rdeadbeef_00")
    with pytest.raises(UnknownSession):
        await router.route.remote("sess_0123456789abcdef")


async def test_the_route_over_http_through_serves_proxy_gives_the_owner(router):
    def get(query: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{HTTP_PORT}/route{query}", timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    status, body = await anyio.to_thread.run_sync(get, "")
    assert status == 200 and body["url"].startswith("ws://127.0.0.1:")
    async with await DuplexClient.connect(body["url"]) as client:
        session_id = (await client.recv())["session"]["id"]
        status, owner = await anyio.to_thread.run_sync(get, f"?session_id={session_id}")
        assert status == 200 and owner["url"] == f"{body['url']}?session_id={session_id}"
    status, missing = await anyio.to_thread.run_sync(get, "?session_id=sess_rdeadbeef_00")
    assert status == 404 and missing["error"]["code"] == "unknown_session"


async def test_barge_in_cancels_the_turn_on_the_engine_replica_and_the_next_turn_completes(router):
    from ray import serve

    engine = serve.get_deployment_handle("engine", app_name=APP)
    # A new handle's first call waits for the replicas to be found (0.7 s in a CI run), longer
    # than the turn has left after its first words (~0.4 s): made before the turn, not in it.
    assert len(await engine.active.remote()) == 0
    url = await router.route.remote(None)
    async with await DuplexClient.connect(url) as client:
        await client.recv()
        await client.send_audio(CHUNK)
        await client.commit()
        await client.create_response()  # GA: a commit alone only adds the audio
        await client.wait_for("response.output_audio_transcript.delta", timeout=30)
        assert len(await engine.active.remote()) == 1  # the turn is open on the engine replica
        await client.barge_in()
        done, _ = await client.wait_for("response.done", timeout=30)
        assert done["response"]["status"] == "cancelled"
        with anyio.fail_after(10):  # the cancelled Serve call closed the backend's stream
            while await engine.active.remote():
                await anyio.sleep(0.05)
        await client.send_audio(CHUNK)
        await client.commit()
        await client.create_response()  # GA: a commit alone only adds the audio
        done, _ = await client.wait_for("response.done", timeout=30)
        assert done["response"]["status"] == "completed"
