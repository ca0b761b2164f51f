"""The codec alone: frames in, typed commands or typed errors out."""

import base64
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from duplex_actors.core import commands as cmd
from duplex_actors.errors import DuplexError, InvalidCommand
from duplex_actors.server import wire
from duplex_actors.server.audio_format import PCM, PCMA, PCMU, AudioFormat


def frame(**fields) -> str:
    return json.dumps(fields)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_append_decodes_pcm_and_echoes_event_id():
    event = wire.decode(frame(type="input_audio_buffer.append", audio=b64(b"\x01\x02" * 10), event_id="e1"))
    assert isinstance(event, cmd.AppendAudio)
    assert event.pcm == b"\x01\x02" * 10 and event.event_id == "e1" and event.sample_rate == 16000


def test_append_uses_the_session_rate_and_a_chunk_naming_another_is_refused():
    assert (
        wire.decode(
            frame(type="input_audio_buffer.append", audio=b64(b"\0\0")), sample_rate=24000
        ).sample_rate
        == 24000
    )
    with pytest.raises(InvalidCommand):
        wire.decode(frame(type="input_audio_buffer.append", audio=b64(b"\0\0"), sample_rate=8000))


def test_append_in_a_declared_format_is_left_for_the_server_to_convert():
    ulaw = AudioFormat(PCMU, 8000)
    event = wire.decode(frame(type="input_audio_buffer.append", audio=b64(b"\xff" * 3)), input_format=ulaw)
    assert isinstance(event, wire.EncodedAudio) and event.data == b"\xff" * 3 and event.format == ulaw
    pcm24 = wire.decode(
        frame(type="input_audio_buffer.append", audio=b64(b"\0\0")), input_format=AudioFormat(PCM, 24000)
    )
    assert isinstance(pcm24, wire.EncodedAudio)  # 24 kHz on the wire, 16 kHz in the session
    with pytest.raises(wire.InvalidAudio):  # pcm16 still needs whole samples
        wire.decode(
            frame(type="input_audio_buffer.append", audio=b64(b"\0\0\0")),
            input_format=AudioFormat(PCM, 24000),
        )


@pytest.mark.parametrize(
    "text, error, code",
    [
        ("{", wire.InvalidJSON, "invalid_json"),
        ("[1, 2]", wire.InvalidJSON, "invalid_json"),
        (frame(type="nope", event_id="x"), wire.UnknownEventType, "unknown_event_type"),
        (frame(event_id="x"), wire.InvalidField, "invalid_value"),
        (frame(type=3, event_id="x"), wire.InvalidField, "invalid_value"),
        (frame(type="input_audio_buffer.append", event_id="x"), wire.InvalidField, "invalid_value"),
        (frame(type="input_audio_buffer.append", audio=5, event_id="x"), wire.InvalidField, "invalid_value"),
        (
            frame(type="input_audio_buffer.append", audio="***", event_id="x"),
            wire.InvalidAudio,
            "invalid_audio",
        ),
        (
            frame(type="input_audio_buffer.append", audio=b64(b"\0\0\0"), event_id="x"),
            wire.InvalidAudio,
            "invalid_audio",
        ),
        (frame(type="input_audio_buffer.append", audio="", event_id="x"), wire.InvalidAudio, "invalid_audio"),
        (
            frame(type="input_audio_buffer.append", audio=b64(b"\0\0"), sample_rate="16k", event_id="x"),
            wire.InvalidField,
            "invalid_value",
        ),
        (frame(type="session.update", event_id="x"), wire.InvalidField, "invalid_value"),
        (
            frame(type="session.update", session={"type": "translation"}, event_id="x"),
            wire.NotSupported,
            "not_supported",
        ),
        (frame(type="conversation.item.create", item={}, event_id="x"), wire.InvalidField, "invalid_value"),
        (
            frame(
                type="conversation.item.create",
                item={"type": "message", "role": "tool", "content": []},
                event_id="x",
            ),
            wire.InvalidField,
            "invalid_value",
        ),
        (
            frame(
                type="conversation.item.create",
                item={"type": "message", "role": "assistant", "content": []},
                event_id="x",
            ),
            wire.InvalidField,
            "invalid_value",
        ),
        (
            frame(
                type="conversation.item.create",
                item={"type": "message", "role": "user", "content": [{"type": "input_audio"}]},
                event_id="x",
            ),
            wire.InvalidField,
            "invalid_value",
        ),
        (
            frame(type="conversation.item.create", item={"type": "mcp_call"}, event_id="x"),
            wire.NotSupported,
            "not_supported",
        ),
        (
            frame(type="response.create", response={"output_modalities": ["video"]}, event_id="x"),
            wire.InvalidField,
            "invalid_value",
        ),
        (
            frame(type="response.create", response={"metadata": {"k": 1}}, event_id="x"),
            wire.InvalidField,
            "invalid_value",
        ),
        (
            frame(type="conversation.item.truncate", item_id="i", content_index=0, event_id="x"),
            wire.InvalidField,
            "invalid_value",
        ),
        (
            frame(type="duplex.playback_ack", response_id="r", played_ms=-1, event_id="x"),
            wire.InvalidField,
            "invalid_value",
        ),
        (
            frame(type="session.resume", session_id="s", generation=True, resume_token="t", event_id="x"),
            wire.InvalidField,
            "invalid_value",
        ),
        (frame(type="input_audio_buffer.commit", epoch=-1, event_id="x"), wire.InvalidField, "invalid_value"),
    ],
)
def test_malformed_frames_raise_typed_errors_with_the_event_id(text, error, code):
    with pytest.raises(error) as info:
        wire.decode(text)
    assert info.value.code == code
    assert info.value.message
    if '"event_id": "x"' in text:
        assert info.value.event_id == "x"


def test_binary_frames_are_refused():
    with pytest.raises(wire.InvalidFrame):
        wire.decode(b'{"type": "heartbeat"}')


def test_declared_limits_are_enforced_before_decoding():
    limits = wire.WireLimits(max_frame_bytes=1000, max_chunk_bytes=100)
    with pytest.raises(wire.FrameTooLarge):
        wire.decode(frame(type="heartbeat", pad="x" * 2000), limits)
    with pytest.raises(wire.ChunkTooLarge) as info:
        wire.decode(frame(type="input_audio_buffer.append", audio=b64(b"\0" * 102), event_id="big"), limits)
    assert info.value.event_id == "big"
    assert isinstance(
        wire.decode(frame(type="input_audio_buffer.append", audio=b64(b"\0" * 100)), limits), cmd.AppendAudio
    )
    # multi-byte text counts in bytes, not characters
    with pytest.raises(wire.FrameTooLarge):
        wire.decode(frame(type="heartbeat", pad="é" * 600), limits)


def test_deep_nesting_is_refused_not_crashing():
    with pytest.raises(wire.FrameTooComplex):  # counted before it is parsed
        wire.decode('{"type": "heartbeat", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(wire.InvalidJSON):
        wire.decode('{"type": "heartbeat", "x": ' + "[" * 50 + "]" * 50 + "}")
    # The walk is skipped when the brackets cannot nest that deep, and runs when they can.
    assert wire.decode('{"type": "heartbeat", "x": ' + "[" * 31 + "]" * 31 + "}").TRIGGER == "heartbeat"
    with pytest.raises(wire.InvalidJSON):
        wire.decode('{"type": "heartbeat", "x": ' + "[" * 32 + "]" * 32 + "}")
    wide = '{"type": "heartbeat", "x": [' + ",".join(["[[1]]"] * 20) + "]}"  # 62 brackets, depth 4
    assert wire.decode(wide).TRIGGER == "heartbeat"


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1E+999"])
def test_numbers_json_has_not_are_refused_wherever_they_sit(number):
    # Python's json reads them; a browser's JSON.parse does not, and a tool's schema holding one
    # came back to the client in session.updated as a bare `Infinity`.
    tools = '[{"type": "function", "name": "f", "parameters": {"type": "object", "x": N}}]'
    for text in (
        '{"type": "session.update", "event_id": "x", "session": {"tools": TOOLS}}'.replace("TOOLS", tools),
        '{"type": "heartbeat", "pad": [1, {"deep": N}]}',
        '{"type": "session.update", "session": {"temperature": N}}',
    ):
        text = text.replace("N", number)
        with pytest.raises(wire.InvalidJSON, match="not a JSON number|out of range"):
            wire.decode(text)


def test_large_finite_numbers_and_float_literals_still_decode():
    text = '{"type": "session.update", "session": {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "maximum": 1.7976931348623157e308, "minimum": -1e-320, "multipleOf": 0.5}}]}}'
    update = wire.decode(text)
    schema = json.loads(update.command.tools[0].parameters)
    assert schema["maximum"] == 1.7976931348623157e308 and schema["multipleOf"] == 0.5


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 1


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner, max_size=3),
    max_leaves=12,
)


@given(value=_JSON, limit=st.integers(0, 8))
def test_the_nesting_check_is_the_values_depth_against_the_limit(value, limit):
    # Flat objects (every append) take a shortcut; it must agree with the walk everywhere.
    from duplex_actors.server.wire_types import _depth_ok

    assert _depth_ok(value, limit) == (_depth(value) <= limit)


def test_a_frame_of_many_tiny_values_is_refused_before_it_is_parsed():
    # 1 MB of "[[],[],...]" took the event loop ~0.4 s to parse and check, and deflates to
    # ~1 KB on the wire: a frame's cost is its values, not its bytes.
    limits = wire.WireLimits(max_json_values=1000)
    flood = '{"type": "heartbeat", "x": [' + ",".join(["[]"] * 1000) + "]}"
    with pytest.raises(wire.FrameTooComplex) as refused:
        wire.decode(flood, limits)
    assert refused.value.code == "frame_too_complex"
    assert wire.decode('{"type": "heartbeat", "x": [' + ",".join(["0"] * 400) + "]}", limits)
    # Real frames are far under the default: 128 tools with ten-property schemas.
    props = {f"p{i}": {"type": "string", "description": "a field"} for i in range(10)}
    tools = [
        {"type": "function", "name": f"t{n}", "parameters": {"type": "object", "properties": props}}
        for n in range(128)
    ]
    update = wire.decode(frame(type="session.update", session={"tools": tools}))
    assert len(update.command.tools) == 128


@pytest.mark.parametrize(
    "session, expected",
    [
        ({"turn_detection": None}, {"auto_respond": False}),
        ({"audio": {"input": {"turn_detection": None}}}, {"auto_respond": False}),
        ({"audio": {"input": {"turn_detection": {"type": "server_vad"}}}}, {"auto_respond": True}),
        ({"turn_detection": {"type": "server_vad", "create_response": False}}, {"auto_respond": False}),
        ({"instructions": "be brief"}, {"instructions": "be brief"}),
        (
            {"duplex": {"model_native": True, "min_interruption_ms": 700}},
            {"model_native": True, "min_interruption_ms": 700},
        ),
        ({"type": "realtime", "voice": "alloy", "tools": []}, {}),
    ],
)
def test_session_update_maps_openai_and_duplex_fields(session, expected):
    update = wire.decode(frame(type="session.update", session=session))
    assert isinstance(update, wire.SessionUpdate)
    event = update.command
    for key in ("auto_respond", "model_native", "instructions", "min_interruption_ms"):
        assert getattr(event, key) == expected.get(key)


def test_session_update_sampling_fields():
    event = wire.decode(
        frame(
            type="session.update",
            session={
                "max_output_tokens": 12,
                "duplex": {"sampling": {"temperature": 0.5, "top_k": 4, "seed": 3}},
            },
        )
    ).command
    assert event.sampling.max_tokens == 12 and event.sampling.temperature == 0.5
    assert event.sampling.top_k == 4 and event.sampling.seed == 3
    assert (
        wire.decode(frame(type="session.update", session={"max_output_tokens": "inf"})).command.sampling
        is None
    )


def test_turn_detection_switches_server_vad_with_its_settings():
    on = wire.decode(
        frame(
            type="session.update",
            session={
                "audio": {
                    "input": {
                        "turn_detection": {"type": "server_vad", "threshold": 0.6, "silence_duration_ms": 300}
                    }
                }
            },
        )
    )
    assert on.turn_detection == wire.TurnDetection(threshold=0.6, silence_duration_ms=300)
    assert not on.vad_off and on.command.auto_respond is True
    off = wire.decode(frame(type="session.update", session={"turn_detection": None}))
    assert off.turn_detection is None and off.vad_off
    untouched = wire.decode(frame(type="session.update", session={"instructions": "x"}))
    assert untouched.turn_detection is None and not untouched.vad_off
    with pytest.raises(wire.InvalidField) as bad:
        wire.decode(
            frame(type="session.update", session={"turn_detection": {"type": "server_vad", "threshold": 2}})
        )
    assert bad.value.param == "session.turn_detection.threshold"


@pytest.mark.parametrize(
    "session, param, code",
    [
        ({"instructions": 7}, "session.instructions", "invalid_value"),
        (
            {"audio": {"input": {"turn_detection": {"type": "magic"}}}},
            "session.audio.input.turn_detection.type",
            "invalid_value",
        ),
        (
            {"audio": {"input": {"format": {"type": "audio/opus"}}}},
            "session.audio.input.format.type",
            "unsupported_audio_format",
        ),
        (
            {"audio": {"output": {"format": {"type": "audio/pcm", "rate": 44100}}}},
            "session.audio.output.format.rate",
            "unsupported_audio_format",
        ),
        ({"output_modalities": ["smell"]}, "session.output_modalities", "invalid_value"),
        ({"audio": {"output": {"speed": 2.0}}}, "session.audio.output.speed", "invalid_value"),
        ({"speed": "fast"}, "session.speed", "invalid_value"),
        (
            {"audio": {"output": {"voice": {"id": "v" * 129}}}},
            "session.audio.output.voice.id",
            "invalid_value",
        ),
    ],
)
def test_one_refused_field_refuses_the_whole_update_and_names_its_param(session, param, code):
    # OpenAI applies a session.update all or nothing: one bad field, and none of the others
    # (min_interruption_ms, voice) may be applied. Decode raises, so nothing reaches the session.
    with pytest.raises(DuplexError) as refused:
        wire.decode(
            frame(
                type="session.update",
                event_id="u1",
                session={
                    **session,
                    "duplex": {"min_interruption_ms": 900},
                    "audio": {
                        **session.get("audio", {}),
                        "output": {"voice": "marin", **session.get("audio", {}).get("output", {})},
                    },
                },
            )
        )
    error = refused.value
    assert (error.param, error.code, error.event_id) == (param, code, "u1")


def test_a_bare_tool_name_as_tool_choice_names_a_tool_of_the_same_update():
    # openai-agents lets a user set tool_choice to a bare tool name, which GA's schema does not
    # allow. Refusing it would now refuse the whole update (tools, instructions, audio), so a
    # name the update's own tools declare is read as that function; any other string is refused.
    tool = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
    update = wire.decode(frame(type="session.update", session={"tools": [tool], "tool_choice": "get_time"}))
    assert [t.name for t in update.command.tools] == ["get_time"]
    assert update.command.tool_choice == "get_time"
    with pytest.raises(wire.InvalidField) as refused:
        wire.decode(frame(type="session.update", session={"tools": [tool], "tool_choice": "get_weather"}))
    assert refused.value.param == "session.tool_choice"
    create = wire.decode(frame(type="response.create", response={"tools": [tool], "tool_choice": "get_time"}))
    assert create.tool_choice == "get_time"


def test_speed_is_read_from_audio_output_or_the_top_level():
    ga = wire.decode(frame(type="session.update", session={"audio": {"output": {"speed": 1.25}}}))
    beta = wire.decode(frame(type="session.update", session={"speed": 0.25}))
    assert (ga.command.output_speed, beta.command.output_speed) == (1.25, 0.25)
    assert wire.decode(frame(type="session.update", session={})).command.output_speed is None


def test_max_output_tokens_inf_resets_the_limit_and_a_response_may_lift_it():
    update = wire.decode(frame(type="session.update", session={"max_output_tokens": "inf"}))
    assert update.command.reset_sampling == ("max_tokens",) and update.command.sampling is None
    update = wire.decode(frame(type="session.update", session={"max_output_tokens": 5}))
    assert update.command.reset_sampling == () and update.command.sampling.max_tokens == 5
    create = wire.decode(frame(type="response.create", response={"max_output_tokens": "inf"}))
    assert create.max_tokens == 0  # none for this response, whatever the session's
    assert wire.decode(frame(type="response.create", response={})).max_tokens is None


def test_session_update_declares_formats_and_modalities():
    update = wire.decode(
        frame(
            type="session.update",
            session={
                "type": "realtime",
                "output_modalities": ["text"],
                "audio": {
                    "input": {"format": {"type": "audio/pcmu"}},
                    "output": {"format": {"type": "audio/pcma"}},
                },
            },
        )
    )
    assert update.input_format == AudioFormat(PCMU, 8000) and update.output_format == AudioFormat(PCMA, 8000)
    assert update.command.modalities == ("text",)
    legacy = wire.decode(frame(type="session.update", session={"input_audio_format": "g711_ulaw"}))
    assert legacy.input_format == AudioFormat(PCMU, 8000)


def test_every_other_client_event_maps_to_its_command():
    cases = {
        "input_audio_buffer.commit": cmd.CommitInput,
        "input_audio_buffer.clear": cmd.ClearInput,
        "response.create": cmd.CreateResponse,
        "response.cancel": cmd.CancelResponse,
        "heartbeat": cmd.Heartbeat,
        "duplex.barge_in": cmd.BargeIn,
        "session.close": cmd.Close,
    }
    for kind, expected in cases.items():
        event = wire.decode(frame(type=kind, event_id=kind, epoch=2))
        assert type(event) is expected and event.event_id == kind and event.epoch == 2
    created = wire.decode(frame(type="response.create", response={"instructions": "hi"}))
    assert created.instructions == "hi"
    ack = wire.decode(frame(type="duplex.playback_ack", response_id="r1", played_ms=250))
    assert ack == cmd.PlaybackAck(response_id="r1", played_ms=250)
    trunc = wire.decode(
        frame(type="conversation.item.truncate", item_id="i1", content_index=0, audio_end_ms=40)
    )
    assert trunc == cmd.TruncateItem(item_id="i1", content_index=0, audio_end_ms=40)
    assert wire.decode(frame(type="conversation.item.delete", item_id="i1")) == cmd.DeleteItem(item_id="i1")
    assert wire.decode(frame(type="conversation.item.retrieve", item_id="i1")) == cmd.RetrieveItem(
        item_id="i1"
    )
    cancel = wire.decode(frame(type="response.cancel", response_id="resp_1"))
    assert cancel.response_id == "resp_1"
    made = wire.decode(
        frame(type="response.create", response={"output_modalities": ["text"], "metadata": {"k": "v"}})
    )
    assert made.modalities == ("text",) and made.metadata == {"k": "v"}
    text = wire.decode(
        frame(
            type="conversation.item.create",
            previous_item_id="root",
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "hello there"}],
            },
        )
    )
    assert text.item.role == "user" and text.item.text == "hello there" and text.previous_item_id == "root"
    tool = wire.decode(
        frame(
            type="conversation.item.create",
            item={"type": "function_call_output", "call_id": "c1", "output": '{"ok": true}'},
        )
    )
    assert tool.item.type == "function_call_output" and tool.item.call_id == "c1"
    resume = wire.decode(
        frame(type="session.resume", session_id="s1", generation=2, resume_token="t", last_seq=9)
    )
    assert resume.session_id == "s1" and resume.command.last_seq == 9 and resume.command.generation == 2
