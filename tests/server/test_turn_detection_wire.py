"""GA ``turn_detection`` over a real socket, field by field, for any value a client may send.

Every ``session.update`` carrying a ``turn_detection`` object either applies it whole (the
session's settings and the echoed object say exactly what was sent, defaults for what was
left out) or is refused with one ``error`` naming the field in ``param``, the session's turn
detection left as it was. Either way the connection stays usable.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect

from .conftest import recv_json, recv_until, running_server
from .test_server_vad import LoudnessVad

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

PARAM = "session.audio.input.turn_detection"
DEFAULTS = {
    "threshold": 0.5,
    "prefix_padding_ms": 300,
    "silence_duration_ms": 500,
    "create_response": True,
    "interrupt_response": True,
    "idle_timeout_ms": None,
}
# (valid values, invalid ones) per field; None means "use the default" for each of them.
FIELDS = {
    "threshold": (st.floats(0.01, 0.99), st.sampled_from([0.0, 1.0, -1, "0.5", True, [0.5]])),
    "prefix_padding_ms": (st.integers(0, 10_000), st.sampled_from([-1, 10_001, 1.5, "300", False])),
    "silence_duration_ms": (st.integers(1, 60_000), st.sampled_from([0, 60_001, 2.5, "500", True])),
    "create_response": (st.booleans(), st.sampled_from([0, 1, "true", [], {}])),
    "interrupt_response": (st.booleans(), st.sampled_from([0, "false", 1.0])),
    "idle_timeout_ms": (
        st.integers(1_000, 3_600_000),
        st.sampled_from([0, 999, 3_600_001, -5, 1000.5, "1000", True]),
    ),
}


@st.composite
def turn_detections(draw):
    """A turn_detection object, and the name of the field that must be refused (None: all valid)."""
    obj = {"type": draw(st.sampled_from(["server_vad", "semantic_vad"]))}
    chosen = draw(st.lists(st.sampled_from(sorted(FIELDS)), unique=True, max_size=len(FIELDS)))
    bad = draw(st.none() | st.sampled_from(chosen)) if chosen else None
    for name in chosen:
        valid, invalid = FIELDS[name]
        obj[name] = draw(invalid if name == bad else valid | st.none())
    return obj, bad


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(updates=st.lists(turn_detections(), min_size=1, max_size=4))
async def test_a_turn_detection_update_applies_whole_or_is_refused_naming_its_field(updates):
    async with running_server(vad_factory=LoudnessVad) as server:
        async with connect(server.url) as ws:
            created = await recv_json(ws)
            core = server.runtime.get(created["session"]["id"]).core
            applied = {**DEFAULTS}
            for obj, bad in updates:
                update = {"type": "realtime", "audio": {"input": {"turn_detection": obj}}}
                await ws.send(json.dumps({"type": "session.update", "event_id": "u", "session": update}))
                events = await recv_until(ws, "session.updated")
                errors = [e["error"] for e in events if e["type"] == "error"]
                echoed = events[-1]["session"]["audio"]["input"]["turn_detection"]
                if bad is not None:
                    assert [e["param"] for e in errors] == [f"{PARAM}.{bad}"], errors
                else:
                    assert errors == []
                    applied = {k: (DEFAULTS[k] if obj.get(k) is None else obj[k]) for k in DEFAULTS}
                assert echoed == {"type": "server_vad", **applied}
                config = core.config
                assert config.server_vad is True
                assert config.auto_respond is applied["create_response"]
                assert config.interrupt_response is applied["interrupt_response"]
                assert config.idle_timeout_ms == applied["idle_timeout_ms"]
                assert config.speech_prefix_ms == applied["prefix_padding_ms"]
            await ws.send(json.dumps({"type": "heartbeat"}))
            await recv_until(ws, "heartbeat.ack")
