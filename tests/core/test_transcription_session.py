"""A session that makes no responses (``SessionConfig.responses`` off): GA's transcription
session. Its committed audio is transcribed and nothing answers it; response.create is refused
by the chart's ``responses_offered`` check, and none of the ways a session starts a response on
its own (server VAD's end of speech, a commit for embedders, model-native units, the idle
timeout) starts one, whatever those settings say."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.core import commands as cmd
from duplex_actors.core import events as ev
from duplex_actors.core.actions import InputTranscript, SubmitTurn, TranscribeInput
from duplex_actors.core.clock import ManualClock
from duplex_actors.core.conversation import ContentPart, Item
from duplex_actors.core.session import SessionConfig, SessionCore
from duplex_actors.core.statechart import RESPONDING
from duplex_actors.errors import DuplexError, ResponsesNotOffered

from .helpers import user_text

CHUNK = b"\x01\x00" * 1600  # 100 ms at 16 kHz


def transcribing(clock: ManualClock | None = None, **config) -> SessionCore:
    settings_ = {
        "responses": False,
        "server_vad": True,
        "transcription": "pocketsphinx",
        "respond_on_commit": True,  # read as off: nothing starts a response here
        "auto_respond": True,
        "idle_timeout_ms": 500,
        **config,
    }
    core = SessionCore("sess_transcribe000", SessionConfig(**settings_), clock or ManualClock(0.0))
    core.take_events()
    return core


def test_response_create_is_refused_and_changes_nothing():
    core = transcribing()
    core.handle(cmd.CreateItem(item=user_text("hello")))
    core.take_events()
    state = core.state
    with pytest.raises(ResponsesNotOffered) as refused:
        core.handle(cmd.CreateResponse())
    assert refused.value.code == "responses_not_offered"
    assert core.state == state and core.take_events() == [] and core.take_actions() == []
    # Out of band, over its own input, too.
    with pytest.raises(ResponsesNotOffered):
        core.handle(cmd.CreateResponse(input=(user_text("only this"),), out_of_band=True))


def test_the_end_of_speech_commits_and_transcribes_and_nothing_answers():
    clock = ManualClock(0.0)
    core = transcribing(clock)
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    for _ in range(5):
        core.handle(cmd.AppendAudio(pcm=CHUNK))
    core.handle(cmd.SpeechStoppedSignal(audio_ms=500))
    actions = core.take_actions()
    events = core.take_events()
    assert not [a for a in actions if isinstance(a, SubmitTurn)]
    (transcribe,) = [a for a in actions if isinstance(a, TranscribeInput)]
    assert [type(e) for e in events if isinstance(e, ev.InputCommitted)] == [ev.InputCommitted]
    assert core.state != RESPONDING
    core.on_transcript(InputTranscript(transcribe.item_id, "hello there", final=True))
    (completed,) = [e for e in core.take_events() if e.type.endswith("transcription.completed")]
    assert completed.transcript == "hello there"
    # The idle timeout never starts (its end would start a response).
    clock.advance(5.0)
    assert core.idle_deadline is None
    core.idle_timeout()
    assert not [a for a in core.take_actions() if isinstance(a, SubmitTurn)]


def test_a_client_commit_only_adds_the_audio():
    core = transcribing(server_vad=False)
    core.handle(cmd.AppendAudio(pcm=CHUNK))
    core.handle(cmd.CommitInput())
    assert not [a for a in core.take_actions() if isinstance(a, SubmitTurn)]
    assert core.state != RESPONDING


_COMMANDS = st.sampled_from(
    [
        cmd.AppendAudio(pcm=CHUNK),
        cmd.SpeechStartedSignal(audio_ms=0),
        cmd.SpeechStoppedSignal(audio_ms=100),
        cmd.CommitInput(),
        cmd.ClearInput(),
        cmd.CreateResponse(),
        cmd.CreateItem(item=user_text("words")),
        cmd.UpdateSession(auto_respond=True, respond_on_commit=True, model_native=True),
        cmd.UpdateSession(server_vad=False),
        cmd.UpdateSession(server_vad=True, idle_timeout_ms=100),
    ]
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_COMMANDS, st.floats(0.0, 1.0)), max_size=30))
def test_no_command_sequence_starts_a_response(steps):
    # Whatever the client sends, and however its settings are flipped, a session without
    # responses never asks the engine for one and never leaves for responding.
    clock = ManualClock(0.0)
    core = transcribing(clock)
    for command, wait in steps:
        clock.advance(wait)
        try:
            core.handle(command)
        except DuplexError:
            pass
        core.idle_timeout()  # as the shell's timer would, whenever it fires
        assert not [a for a in core.take_actions() if isinstance(a, SubmitTurn)], command
        assert core.state != RESPONDING
        assert not [e for e in core.take_events() if isinstance(e, ev.ResponseCreated)]


def test_committed_audio_is_not_kept_for_a_response_that_never_comes():
    # A captioning session runs for hours: each turn's audio goes to the recogniser and is let
    # go. Kept as a realtime session keeps it for its next response, it held its newest
    # max_committed_bytes (120 s) for nothing, counted in the runtime's audio budget.
    core = transcribing(server_vad=False)
    turn = CHUNK * 50  # 5 s
    for _ in range(30):
        for i in range(0, len(turn), len(CHUNK)):
            core.handle(cmd.AppendAudio(pcm=turn[i : i + len(CHUNK)]))
        core.handle(cmd.CommitInput())
        spoken = Item(id="", role="user", content=(ContentPart(type="input_audio"),))
        core.handle(cmd.CreateItem(item=spoken, audio=turn))
    assert core._committed.nbytes == 0 and core._input.nbytes == 0
    heard = [a for a in core.take_actions() if isinstance(a, TranscribeInput)]
    assert len(heard) == 60 and all(len(a.audio) == len(turn) for a in heard)
