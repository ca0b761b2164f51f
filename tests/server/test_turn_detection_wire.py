"""GA ``turn_detection`` over a real socket, field by field, for any value a client may send.

Every ``session.update`` carrying a ``turn_detection`` object either applies it whole (the
session's settings and the echoed object say exactly what was sent, defaults for what was
left out; semantic_vad echoed as semantic_vad with its eagerness, mapped onto the silence that
ends a turn) or is refused with one ``error`` naming the field in ``param`` and no
``session.updated``, the session's turn detection left as it was. Either way the connection
stays usable.
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
    "eagerness": (
        st.sampled_from(["low", "medium", "high", "auto"]),
        st.sampled_from(["eager", 1, True, ""]),
    ),
}
SILENCE = {"low": 1000, "medium": 500, "auto": 500, "high": 300}


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
            record = server._records[created["session"]["id"]]
            applied = {**DEFAULTS}
            echo = {"type": "server_vad", **DEFAULTS}
            silence = DEFAULTS["silence_duration_ms"]
            for obj, bad in updates:
                update = {"type": "realtime", "audio": {"input": {"turn_detection": obj}}}
                await ws.send(json.dumps({"type": "session.update", "event_id": "u", "session": update}))
                events = await recv_until(ws, "error" if bad is not None else "session.updated")
                if bad is not None:  # and nothing after the error: no session.updated
                    await ws.send(json.dumps({"type": "heartbeat"}))
                    events += await recv_until(ws, "heartbeat.ack")
                errors = [e["error"] for e in events if e["type"] == "error"]
                updated = [e for e in events if e["type"] == "session.updated"]
                if bad is not None:
                    # All or nothing: one error naming the field, no session.updated.
                    assert [e["param"] for e in errors] == [f"{PARAM}.{bad}"], errors
                    assert updated == []
                else:
                    assert errors == [] and len(updated) == 1
                    applied = {k: (DEFAULTS[k] if obj.get(k) is None else obj[k]) for k in DEFAULTS}
                    silence = applied["silence_duration_ms"]
                    if obj["type"] == "semantic_vad":
                        eagerness = obj.get("eagerness") or "auto"
                        if obj.get("silence_duration_ms") is None:
                            silence = SILENCE[eagerness]
                        echo = {
                            "type": "semantic_vad",
                            "eagerness": eagerness,
                            "create_response": applied["create_response"],
                            "interrupt_response": applied["interrupt_response"],
                        }
                    else:
                        echo = {"type": "server_vad", **applied}
                    assert updated[0]["session"]["audio"]["input"]["turn_detection"] == echo
                assert record.wire.turn_detection == echo
                assert record.vad_settings.silence_duration_ms == silence
                config = core.config
                assert config.server_vad is True
                assert config.auto_respond is applied["create_response"]
                assert config.interrupt_response is applied["interrupt_response"]
                assert config.idle_timeout_ms == applied["idle_timeout_ms"]
                assert config.speech_prefix_ms == applied["prefix_padding_ms"]
            await ws.send(json.dumps({"type": "heartbeat"}))
            await recv_until(ws, "heartbeat.ack")
