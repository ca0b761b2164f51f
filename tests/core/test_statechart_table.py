"""Every (state, client command) pair: legal ones reach the expected state, illegal ones raise
the declared error and change nothing. The expectations are written out by hand, not read from
the chart, so a change to the chart that alters behaviour fails here."""

import pytest

from duplex_actors.core import commands as cmd
from duplex_actors.core.conversation import ContentPart, Item
from duplex_actors.errors import (
    InputBufferEmpty,
    ItemNotFound,
    NoActiveResponse,
    ResponseInProgress,
    ResponseNotFound,
    SessionClosed,
    UnknownFunctionCall,
)

from .helpers import CHUNK, core_in, snapshot

STATES = ["idle", "listening", "responding", "responding_begun", "barge_in", "closed"]


def make(trigger, core):
    return {
        "append": lambda: cmd.AppendAudio(pcm=CHUNK),
        "commit": lambda: cmd.CommitInput(),
        "clear": lambda: cmd.ClearInput(),
        "create_response": lambda: cmd.CreateResponse(),
        "speech_started": lambda: cmd.SpeechStartedSignal(audio_ms=10),
        "speech_stopped": lambda: cmd.SpeechStoppedSignal(audio_ms=20),
        "barge_in": lambda: cmd.BargeIn(),
        "cancel": lambda: cmd.CancelResponse(),
        "heartbeat": lambda: cmd.Heartbeat(),
        "playback_ack": lambda: cmd.PlaybackAck(response_id="resp_x", played_ms=10),
        "detach": lambda: cmd.Detach(),
        "resume": lambda: cmd.Resume(
            generation=core.lease.generation, resume_token=core.lease.token, last_seq=core.last_seq
        ),
        "update": lambda: cmd.UpdateSession(instructions="be brief"),
        # No call was issued in these cores: the output answers nothing (legal path:
        # tests/core/test_function_calls.py).
        "function_output": lambda: cmd.AddFunctionOutput(call_id="call_x", output="1"),
        "close": lambda: cmd.Close(),
        "create_item": lambda: cmd.CreateItem(
            item=Item(id="", role="user", content=(ContentPart(type="input_text", text="hello"),))
        ),
        "delete_item": lambda: cmd.DeleteItem(item_id="item_unknown"),
        "retrieve_item": lambda: cmd.RetrieveItem(item_id="item_unknown"),
        "truncate_item": lambda: cmd.TruncateItem(item_id="item_unknown", content_index=0, audio_end_ms=0),
        "cancel_other": lambda: cmd.CancelResponse(response_id="resp_other"),
    }[trigger]()


I, L, R, B, C = "idle", "listening", "responding", "barge_in", "closed"  # noqa: E741  (table keys)
# Item edits never move the state; an unknown item is refused (and changes nothing).
ITEMS = {"delete_item": ItemNotFound, "retrieve_item": ItemNotFound, "truncate_item": ItemNotFound}
EXPECTED = {
    "idle": {
        "append": L,
        "commit": InputBufferEmpty,
        "clear": I,
        "create_response": R,
        "speech_started": L,
        "speech_stopped": I,
        "barge_in": I,
        "cancel": NoActiveResponse,
        "heartbeat": I,
        "playback_ack": I,
        "detach": I,
        "resume": I,
        "update": I,
        "close": C,
    },
    "listening": {
        "append": L,
        "commit": R,
        "clear": I,
        "create_response": R,
        "speech_started": L,
        "speech_stopped": L,
        "barge_in": L,
        "cancel": NoActiveResponse,
        "heartbeat": L,
        "playback_ack": L,
        "detach": L,
        "resume": L,
        "update": L,
        "close": C,
    },
    "responding": {
        "append": R,
        "commit": InputBufferEmpty,
        "clear": R,
        "create_response": ResponseInProgress,
        "speech_started": R,
        "speech_stopped": R,
        "barge_in": B,
        "cancel": B,
        "heartbeat": R,
        "playback_ack": R,
        "detach": R,
        "resume": R,
        "update": R,
        "close": C,
    },
    "barge_in": {
        "append": B,
        "commit": InputBufferEmpty,
        "clear": B,
        "create_response": R,
        "speech_started": B,
        "speech_stopped": B,
        "barge_in": B,
        "cancel": NoActiveResponse,
        "heartbeat": B,
        "playback_ack": B,
        "detach": B,
        "resume": B,
        "update": B,
        "close": C,
    },
    "closed": {
        t: SessionClosed
        for t in [
            "append",
            "commit",
            "clear",
            "create_response",
            "speech_started",
            "speech_stopped",
            "barge_in",
            "cancel",
            "heartbeat",
            "playback_ack",
            "detach",
            "resume",
            "update",
        ]
    }
    | {"close": C},
}
for _state in (I, L, R, B):
    EXPECTED[_state]["function_output"] = UnknownFunctionCall
EXPECTED[C]["function_output"] = SessionClosed
for _state, _cell in EXPECTED.items():
    if _state == "closed":
        _cell.update({t: SessionClosed for t in ["create_item", *ITEMS, "cancel_other"]})
    else:
        _cell.update(
            {
                "create_item": _state,
                **ITEMS,
                "cancel_other": ResponseNotFound if _state == R else NoActiveResponse,
            }
        )
EXPECTED["responding_begun"] = EXPECTED["responding"]

PAIRS = [(s, t) for s in STATES for t in EXPECTED[s]]


@pytest.mark.parametrize("state,trigger", PAIRS, ids=[f"{s}-{t}" for s, t in PAIRS])
def test_state_trigger_pair(state, trigger):
    core = core_in(state)
    expected = EXPECTED[state][trigger]
    command = make(trigger, core)
    if isinstance(expected, type):
        before = snapshot(core)
        with pytest.raises(expected) as info:
            core.handle(command)
        assert snapshot(core) == before, "a refused command changed the session"
        assert info.value.code  # every refusal has a stable wire code
        assert core.take_actions() == []
    else:
        core.handle(command)
        assert core.state == expected


def test_every_client_trigger_of_the_chart_is_covered():
    from duplex_actors.core.statechart import CLIENT_TRIGGERS

    assert set(EXPECTED["idle"]) - {"cancel_other"} == CLIENT_TRIGGERS


def test_commit_during_a_response_adds_the_audio_and_starts_nothing():
    core = core_in("responding_begun")
    rid = core.response_id
    core.handle(cmd.AppendAudio(pcm=CHUNK))
    core.handle(cmd.CommitInput())
    assert core.state == "responding" and core.response_id == rid
    assert core.take_actions() == []
    assert [e.type for e in core.take_events()] == [
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
    ]


def test_a_commit_responds_only_when_the_session_asks_for_it():
    core = core_in("listening", respond_on_commit=False)
    core.handle(cmd.CommitInput())
    assert core.state == "idle" and core.take_actions() == []


def test_close_twice_is_harmless_and_emits_one_closed_event():
    core = core_in("responding_begun")
    core.handle(cmd.Close())
    core.handle(cmd.Close())
    types = [e.type for e in core.take_events()]
    assert types.count("session.closed") == 1
    assert types.count("response.done") == 1
