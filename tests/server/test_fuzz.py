"""Hypothesis throws malformed frames at a live server; the server and the session survive."""

from __future__ import annotations

import base64
import json

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from websockets.asyncio.client import connect  # noqa: E402

from duplex_actors.server.wire import WireLimits, accepted_types  # noqa: E402

from .conftest import CHUNK_100MS, recv_until, running_server  # noqa: E402
from .test_hostile import strict_json  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


async def recv_json(ws) -> dict:
    """The next event, read as RFC 8259 JSON: whatever a fuzzed frame held, what the server
    sends must parse in every client (a browser's JSON.parse has no NaN or Infinity)."""
    return strict_json(await ws.recv())


LIMITS = WireLimits(max_frame_bytes=8 * 1024, max_chunk_bytes=2 * 1024)
# Every type the codec knows except the one that legitimately ends the session.
TYPES = [t for t in accepted_types() if t != "session.close"]

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats()  # NaN and the infinities too: Python's json writes them, the server refuses them
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
field_names = st.sampled_from(
    [
        "audio",
        "session",
        "response",
        "event_id",
        "epoch",
        "item_id",
        "content_index",
        "audio_end_ms",
        "response_id",
        "played_ms",
        "sample_rate",
        "generation",
        "resume_token",
        "last_seq",
        "session_id",
        "turn_detection",
        "instructions",
    ]
) | st.text(max_size=8)
audio_values = (
    st.binary(max_size=3000).map(lambda b: base64.b64encode(b).decode()) | st.text(max_size=50) | json_values
)


@st.composite
def event_objects(draw):
    event = draw(st.dictionaries(field_names, json_values, max_size=6))
    event["type"] = draw(st.sampled_from(TYPES) | st.text(max_size=30) | json_scalars)
    if draw(st.booleans()):
        event["audio"] = draw(audio_values)
    if draw(st.booleans()):
        event["event_id"] = draw(st.text(min_size=1, max_size=12) | json_scalars)
    return event


frames = st.one_of(
    event_objects().map(json.dumps),
    event_objects().map(lambda e: json.dumps(e)[: max(1, len(json.dumps(e)) // 2)]),  # truncated
    json_values.map(json.dumps),
    st.text(max_size=200),
    st.binary(max_size=200),
    st.just(json.dumps({"type": "heartbeat", "pad": "x" * (LIMITS.max_frame_bytes + 1)})),
)


def _refused(constant: str):
    raise ValueError(f"{constant} is refused as invalid JSON, with no event_id to echo")


@pytest.fixture
async def fuzz_server():
    async with running_server(limits=LIMITS) as server:
        yield server


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(frames, min_size=1, max_size=25))
async def test_malformed_frames_never_hurt_the_server_or_the_session(fuzz_server, batch):
    server = fuzz_server
    async with connect(server.url, max_size=None) as ws:
        created = await recv_json(ws)
        assert created["type"] == "session.created"
        session_id = created["session"]["id"]
        for frame in batch:
            await ws.send(frame)
        # A probe: an unknown type with a unique id. Codec errors are emitted in frame order,
        # so once its error arrives every earlier codec error has arrived too.
        await ws.send(json.dumps({"type": "probe.end", "event_id": "probe"}))
        events = [created]
        for _ in range(5000):
            event = await recv_json(ws)
            events.append(event)
            if event["type"] == "error" and event["error"]["event_id"] == "probe":
                break
        else:
            raise AssertionError("probe error never came")
        seqs = [e["server_event_seq"] for e in events]
        assert seqs == list(range(1, len(seqs) + 1))
        for event in events:
            if event["type"] == "error":
                assert event["error"]["code"] and event["error"]["message"]
        # Each frame with an unknown type and a string event_id got its own error back.
        echoed = {e["error"]["event_id"] for e in events if e["type"] == "error"}
        for frame in batch:
            try:
                obj = json.loads(frame, parse_constant=_refused)
            except (ValueError, TypeError):
                continue
            if (
                isinstance(obj, dict)
                and isinstance(obj.get("event_id"), str)
                and isinstance(obj.get("type"), str)
                and obj["type"] not in accepted_types()
                and len(frame) <= LIMITS.max_frame_bytes
            ):
                assert obj["event_id"] in echoed
        # the session is alive and answers on the same connection
        await ws.send(json.dumps({"type": "heartbeat"}))
        await recv_until(ws, "heartbeat.ack", limit=5000)
        assert server.runtime.get(session_id).state != "closed"

    # and the server still serves a well-behaved session end to end
    async with connect(server.url) as ws:
        await recv_json(ws)
        await ws.send(
            json.dumps(
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(CHUNK_100MS[:2000]).decode()}
            )
        )
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))
        events = await recv_until(ws, "response.done")
        assert events[-1]["response"]["status"] == "completed"
