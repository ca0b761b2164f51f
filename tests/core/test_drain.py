"""The drain trigger (server shutdown) in the sans-IO core: the response in flight finishes, and
nothing starts another, whoever asks (fixed inputs, manual clock)."""

from __future__ import annotations

import pytest

from duplex_actors.core import commands as cmd
from duplex_actors.core.actions import SubmitTurn
from duplex_actors.core.engine_io import TurnDone
from duplex_actors.errors import ServerDraining

from .helpers import CHUNK, core_in, snapshot


def test_a_response_in_flight_finishes_then_response_create_is_refused_and_changes_nothing():
    core = core_in("responding_begun")
    rid = core.fence.request_id()
    core.drain()
    assert core.state == "responding" and core.take_actions() == []
    core.on_engine_output(TurnDone(rid))
    done = [e for e in core.take_events() if e.type == "response.done"]
    assert [e.status for e in done] == ["completed"]
    before = snapshot(core)
    with pytest.raises(ServerDraining):
        core.handle(cmd.CreateResponse())
    assert snapshot(core) == before and core.take_actions() == []


@pytest.mark.parametrize("state", ["idle", "listening", "barge_in"])
def test_response_create_is_refused_with_server_draining_in_every_state_that_would_start_one(state):
    core = core_in(state)
    core.drain()
    before = snapshot(core)
    with pytest.raises(ServerDraining) as refused:
        core.handle(cmd.CreateResponse())
    assert refused.value.code == "server_draining" and refused.value.retryable
    assert snapshot(core) == before


def test_server_vad_commits_the_users_turn_but_starts_no_response():
    core = core_in("idle", server_vad=True, auto_respond=True, respond_on_commit=False)
    core.drain()
    core.handle(cmd.SpeechStartedSignal())
    core.handle(cmd.AppendAudio(pcm=CHUNK))
    core.handle(cmd.SpeechStoppedSignal())
    kinds = [e.type for e in core.take_events()]
    assert "input_audio_buffer.committed" in kinds and "response.created" not in kinds
    assert not [a for a in core.take_actions() if isinstance(a, SubmitTurn)]
    assert core.state == "idle"


def test_an_embedders_commit_adds_the_audio_without_a_response():
    core = core_in("listening", respond_on_commit=True)
    core.drain()
    core.handle(cmd.CommitInput())
    assert core.state == "idle"
    assert not [a for a in core.take_actions() if isinstance(a, SubmitTurn)]


def test_without_a_drain_the_same_inputs_do_start_responses():
    # The control for the tests above: the guard is what stops them.
    core = core_in("listening", respond_on_commit=True)
    core.handle(cmd.CommitInput())
    assert core.state == "responding"
    assert [a for a in core.take_actions() if isinstance(a, SubmitTurn)]


def test_a_closed_session_consumes_a_drain():
    core = core_in("closed")
    core.drain()
    assert core.state == "closed" and core.take_events() == []
