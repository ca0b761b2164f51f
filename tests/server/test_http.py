"""/health, /metrics and auth at connect."""

from __future__ import annotations

import json

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from duplex_actors.client import DuplexClient
from duplex_actors.core.clock import ManualClock

from .conftest import CHUNK_100MS, http_get, recv_json, running_server
from .conftest import metric_sample as sample

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def test_health_reports_sessions_and_connections(server):
    status, headers, body = await http_get(server.http_url + "/health")
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"status": "ok", "sessions": 0, "connections": 0}
    async with connect(server.url) as ws:
        await recv_json(ws)
        _, _, body = await http_get(server.http_url + "/health")
        assert json.loads(body)["sessions"] == 1 and json.loads(body)["connections"] == 1


async def test_unknown_paths_are_404(server):
    status, _, body = await http_get(server.http_url + "/v2/elsewhere")
    assert status == 404 and "/v1/realtime" in body


async def test_metrics_count_sessions_responses_and_latencies(server):
    async with await DuplexClient.connect(server.url) as client:
        await client.recv()
        await client.send_audio(CHUNK_100MS)
        await client.commit()
        await client.create_response()
        await client.wait_for("response.done")
        await client.send({"type": "bogus"})
        await client.wait_for("error")
        status, headers, text = await http_get(server.http_url + "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        assert sample(text, "duplex_sessions", '{state="idle"}') == 1
        assert sample(text, "duplex_sessions", '{state="responding"}') == 0
        assert sample(text, "duplex_responses_total", '{status="completed"}') == 1
        assert sample(text, "duplex_ttft_seconds_count") == 1
        assert sample(text, "duplex_ttfp_seconds_count") == 1
        assert sample(text, "duplex_client_errors_total", '{code="unknown_event_type"}') == 1
        assert sample(text, "duplex_connections_open") == 1
        assert sample(text, "duplex_mailbox_depth", '{stat="max"}') >= 0
        assert sample(text, "duplex_barge_ins_total") == 0
        assert sample(text, "duplex_engine_requests", '{outcome="submitted"}') == 1
        # what the wire soak reads to tell journals (the event rate) from a leak
        assert sample(text, "duplex_journal", '{unit="events"}') >= 10  # this turn's events
        assert sample(text, "duplex_journal", '{unit="bytes"}') >= 128 * 10
        assert sample(text, "duplex_server_session_records") == 1
        assert sample(text, "duplex_python_allocated_blocks") > 1000
        assert sample(text, "duplex_event_loop_tasks") >= 2  # at least this connection's reader and writer


async def test_api_key_is_required_when_configured():
    async with running_server(api_key="k-123") as server:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k-123"}):
            with pytest.raises(InvalidStatus) as info:
                await connect(server.url, additional_headers=headers)
            response = info.value.response
            assert response.status_code == 401
            assert b"API key" in response.body
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
        # plain HTTP to the endpoint is refused the same way
        status, _, body = await http_get(server.http_url + "/v1/realtime")
        assert status == 401 and "API key" in body
        assert server.runtime.session_count == 0  # no session was opened for a refused peer

        async with connect(server.url, additional_headers={"Authorization": "Bearer k-123"}) as ws:
            assert (await recv_json(ws))["type"] == "session.created"
        # the browser style: the key rides in a subprotocol next to "realtime"
        async with connect(server.url, subprotocols=["realtime", "openai-insecure-api-key.k-123"]) as ws:
            assert ws.subprotocol == "realtime"
            assert (await recv_json(ws))["type"] == "session.created"
        _, _, text = await http_get(server.http_url + "/metrics")
        assert sample(text, "duplex_auth_refused_total") == 4
        # health and metrics stay open for probes
        status, _, _ = await http_get(server.http_url + "/health")
        assert status == 200


async def test_permessage_deflate_is_negotiated_only_when_the_server_allows_it():
    for compression, expected in (("deflate", ["permessage-deflate"]), (None, [])):
        async with running_server(compression=compression) as server:
            async with connect(server.url) as ws:  # the client offers deflate, as SDK clients do
                assert (await recv_json(ws))["type"] == "session.created"
                assert [e.name for e in ws.protocol.extensions] == expected


async def test_metrics_requested_flat_out_are_rendered_at_most_once_per_max_age():
    # A render walks every session on the event loop (11 ms at 2,000 sessions) and /metrics
    # needs no key: a client requesting it flat out made a neighbour's turn 2.8x slower.
    # The max age reads the runtime's clock: a manual one keeps a slow CI host from ageing the
    # cache between two of the 30 requests (it did once, in 1 run of about 30).
    clock = ManualClock(0.0)
    async with running_server(metrics_max_age_s=0.5, runtime_kw={"clock": clock}) as server:
        for _ in range(200):
            server.runtime.open_session_nowait()
        texts = [(await http_get(server.http_url + "/metrics"))[2] for _ in range(30)]
        assert server.metrics.renders == 1
        assert (
            all(t == texts[0] for t in texts) and sample(texts[0], "duplex_sessions", '{state="idle"}') == 200
        )
        server.runtime.open_session_nowait()
        clock.advance(0.49)  # still within the max age: the cached text
        assert (await http_get(server.http_url + "/metrics"))[2] == texts[0]
        clock.advance(0.02)  # past it: a fresh render sees the new session
        _, _, text = await http_get(server.http_url + "/metrics")
        assert server.metrics.renders == 2
        assert sample(text, "duplex_sessions", '{state="idle"}') == 201


async def test_connect_rates_answer_429_with_retry_after_before_any_session_opens():
    """Opt-in connect rates: past its burst an address (or a key) gets 429 and Retry-After at
    the handshake; another key is not held back by the first one's churn."""
    keys = ("key-a", "key-b")
    clock = ManualClock(0.0)  # the rates read the runtime's clock: no refill while we connect
    async with running_server(
        runtime_kw={"clock": clock},
        api_keys=keys,
        connect_rate_per_key=1.0,
        connect_burst_per_key=3,
        connect_rate_per_address=100.0,
    ) as server:
        bearer = [{"Authorization": f"Bearer {k}"} for k in keys]
        for _ in range(3):
            async with connect(server.url, additional_headers=bearer[0]) as ws:
                assert (await recv_json(ws))["type"] == "session.created"
        opened = server.runtime.opened
        with pytest.raises(InvalidStatus) as info:
            await connect(server.url, additional_headers=bearer[0])
        response = info.value.response
        assert response.status_code == 429 and response.headers["Retry-After"] == "1"
        assert b"API key" not in response.body and b"key" in response.body
        assert server.runtime.opened == opened  # refused before any session existed
        async with connect(server.url, additional_headers=bearer[1]) as ws:  # its own bucket
            assert (await recv_json(ws))["type"] == "session.created"
        clock.advance(1.0)  # what Retry-After said
        async with connect(server.url, additional_headers=bearer[0]) as ws:
            assert (await recv_json(ws))["type"] == "session.created"
        _, _, text = await http_get(server.http_url + "/metrics")
        assert sample(text, "duplex_connects_rate_limited_total", '{by="key"}') == 1
    async with running_server(
        runtime_kw={"clock": ManualClock(0.0)}, connect_rate_per_address=1.0, connect_burst_per_address=2
    ) as server:
        for _ in range(2):
            async with connect(server.url) as ws:
                await recv_json(ws)
        with pytest.raises(InvalidStatus) as info:
            await connect(server.url)
        assert info.value.response.status_code == 429
        assert server.runtime.opened == 2
