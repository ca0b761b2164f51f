"""The codec alone: frames in, typed commands or typed errors out."""

import base64
import json

import pytest

from duplex_actors.core import commands as cmd
from duplex_actors.server import wire


def frame(**fields) -> str:
    return json.dumps(fields)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_append_decodes_pcm_and_echoes_event_id():
    event = wire.decode(frame(type="input_audio_buffer.append", audio=b64(b"\x01\x02" * 10), event_id="e1"))
    assert isinstance(event, cmd.AppendAudio)
    assert event.pcm == b"\x01\x02" * 10 and event.event_id == "e1" and event.sample_rate == 16000


def test_append_uses_the_session_rate_unless_the_chunk_names_one():
    assert wire.decode(frame(type="input_audio_buffer.append", audio=b64(b"\0\0")), sample_rate=24000).sample_rate == 24000
    named = wire.decode(frame(type="input_audio_buffer.append", audio=b64(b"\0\0"), sample_rate=8000))
    assert named.sample_rate == 8000


@pytest.mark.parametrize("text, error, code", [
    ("{", wire.InvalidJSON, "invalid_json"),
    ("[1, 2]", wire.InvalidJSON, "invalid_json"),
    (frame(type="nope", event_id="x"), wire.UnknownEventType, "unknown_event_type"),
    (frame(event_id="x"), wire.InvalidField, "invalid_value"),
    (frame(type=3, event_id="x"), wire.InvalidField, "invalid_value"),
    (frame(type="input_audio_buffer.append", event_id="x"), wire.InvalidField, "invalid_value"),
    (frame(type="input_audio_buffer.append", audio=5, event_id="x"), wire.InvalidField, "invalid_value"),
    (frame(type="input_audio_buffer.append", audio="***", event_id="x"), wire.InvalidAudio, "invalid_audio"),
    (frame(type="input_audio_buffer.append", audio=b64(b"\0\0\0"), event_id="x"), wire.InvalidAudio, "invalid_audio"),
    (frame(type="input_audio_buffer.append", audio="", event_id="x"), wire.InvalidAudio, "invalid_audio"),
    (frame(type="input_audio_buffer.append", audio=b64(b"\0\0"), sample_rate="16k", event_id="x"), wire.InvalidField, "invalid_value"),
    (frame(type="session.update", event_id="x"), wire.InvalidField, "invalid_value"),
    (frame(type="session.update", session={"instructions": 7}, event_id="x"), wire.InvalidField, "invalid_value"),
    (frame(type="session.update", session={"turn_detection": {"type": "magic"}}, event_id="x"), wire.InvalidField, "invalid_value"),
    (frame(type="session.update", session={"audio": {"input": {"format": {"type": "audio/pcmu"}}}}, event_id="x"), wire.UnsupportedAudioFormat, "unsupported_audio_format"),
    (frame(type="session.update", session={"audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}}}, event_id="x"), wire.UnsupportedAudioFormat, "unsupported_audio_format"),
    (frame(type="conversation.item.create", item={}, event_id="x"), wire.NotSupported, "not_supported"),
    (frame(type="conversation.item.truncate", item_id="i", content_index=0, event_id="x"), wire.InvalidField, "invalid_value"),
    (frame(type="duplex.playback_ack", response_id="r", played_ms=-1, event_id="x"), wire.InvalidField, "invalid_value"),
    (frame(type="session.resume", session_id="s", generation=True, resume_token="t", event_id="x"), wire.InvalidField, "invalid_value"),
    (frame(type="input_audio_buffer.commit", epoch=-1, event_id="x"), wire.InvalidField, "invalid_value"),
])
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
    assert isinstance(wire.decode(frame(type="input_audio_buffer.append", audio=b64(b"\0" * 100)), limits),
                      cmd.AppendAudio)
    # multi-byte text counts in bytes, not characters
    with pytest.raises(wire.FrameTooLarge):
        wire.decode(frame(type="heartbeat", pad="é" * 600), limits)


def test_deep_nesting_is_refused_not_crashing():
    with pytest.raises(wire.InvalidJSON):
        wire.decode('{"type": "heartbeat", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(wire.InvalidJSON):
        wire.decode('{"type": "heartbeat", "x": ' + "[" * 50 + "]" * 50 + "}")


@pytest.mark.parametrize("session, expected", [
    ({"turn_detection": None}, {"auto_respond": False}),
    ({"audio": {"input": {"turn_detection": None}}}, {"auto_respond": False}),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad"}}}}, {"auto_respond": True}),
    ({"turn_detection": {"type": "server_vad", "create_response": False}}, {"auto_respond": False}),
    ({"instructions": "be brief"}, {"instructions": "be brief"}),
    ({"duplex": {"model_native": True, "min_interruption_ms": 700}}, {"model_native": True, "min_interruption_ms": 700}),
    ({"type": "realtime", "voice": "alloy", "tools": []}, {}),
])
def test_session_update_maps_openai_and_duplex_fields(session, expected):
    update = wire.decode(frame(type="session.update", session=session))
    assert isinstance(update, wire.SessionUpdate)
    event = update.command
    for key in ("auto_respond", "model_native", "instructions", "min_interruption_ms"):
        assert getattr(event, key) == expected.get(key)


def test_session_update_sampling_fields():
    event = wire.decode(frame(type="session.update", session={
        "max_output_tokens": 12, "duplex": {"sampling": {"temperature": 0.5, "top_k": 4, "seed": 3}}})).command
    assert event.sampling.max_tokens == 12 and event.sampling.temperature == 0.5
    assert event.sampling.top_k == 4 and event.sampling.seed == 3
    assert wire.decode(frame(type="session.update", session={"max_output_tokens": "inf"})).command.sampling is None


def test_turn_detection_switches_server_vad_with_its_settings():
    on = wire.decode(frame(type="session.update", session={"audio": {"input": {"turn_detection": {
        "type": "server_vad", "threshold": 0.6, "silence_duration_ms": 300}}}}))
    assert on.turn_detection == wire.TurnDetection(threshold=0.6, silence_duration_ms=300)
    assert not on.vad_off and on.command.auto_respond is True
    off = wire.decode(frame(type="session.update", session={"turn_detection": None}))
    assert off.turn_detection is None and off.vad_off
    untouched = wire.decode(frame(type="session.update", session={"instructions": "x"}))
    assert untouched.turn_detection is None and not untouched.vad_off
    with pytest.raises(wire.InvalidField):
        wire.decode(frame(type="session.update", session={"turn_detection": {"type": "server_vad", "threshold": 2}}))


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
    trunc = wire.decode(frame(type="conversation.item.truncate", item_id="i1", content_index=0, audio_end_ms=40))
    assert trunc == wire.TruncateItem(item_id="i1", content_index=0, audio_end_ms=40)
    resume = wire.decode(frame(type="session.resume", session_id="s1", generation=2, resume_token="t", last_seq=9))
    assert resume.session_id == "s1" and resume.command.last_seq == 9 and resume.command.generation == 2
