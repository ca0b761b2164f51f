"""response.create metadata is echoed on the response object (livekit matches its
generate_reply to the response.created by metadata.client_event_id)."""

from __future__ import annotations

import json

import pytest
import websockets

from .conftest import recv_json, recv_until, running_server

pytestmark = pytest.mark.anyio


async def test_metadata_is_echoed_on_created_and_done_and_only_for_its_response():
    async with running_server() as server:
        async with websockets.connect(server.url) as ws:
            await recv_json(ws)
            await ws.send(
                json.dumps(
                    {
                        "type": "response.create",
                        "response": {"metadata": {"client_event_id": "response_create_abc"}},
                    }
                )
            )
            events = await recv_until(ws, "response.done")
            created = next(e for e in events if e["type"] == "response.created")
            assert created["response"]["metadata"] == {"client_event_id": "response_create_abc"}
            assert events[-1]["response"]["metadata"] == {"client_event_id": "response_create_abc"}
            await ws.send(json.dumps({"type": "response.create"}))
            events = await recv_until(ws, "response.done")
            assert events[-1]["response"]["metadata"] is None


async def test_bad_metadata_is_refused_with_the_field_named():
    async with running_server() as server:
        async with websockets.connect(server.url) as ws:
            await recv_json(ws)
            await ws.send(
                json.dumps({"type": "response.create", "event_id": "m1", "response": {"metadata": {"k": 3}}})
            )
            err = (await recv_until(ws, "error"))[-1]["error"]
            assert err["code"] == "invalid_value" and "response.metadata.k" in err["message"]
            await ws.send(
                json.dumps(
                    {
                        "type": "response.create",
                        "event_id": "m2",
                        "response": {"metadata": {f"k{i}": "v" for i in range(17)}},
                    }
                )
            )
            err = (await recv_until(ws, "error"))[-1]["error"]
            assert err["code"] == "invalid_value" and err["event_id"] == "m2"
