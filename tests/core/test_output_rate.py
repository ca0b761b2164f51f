"""The listener's output rate reaches the engine: model turns carry the rate the client plays
audio at, so a speaking engine synthesises at it and the edge sends the audio unconverted."""

import pytest

from duplex_actors.core import commands as cmd
from duplex_actors.core.engine_io import ModelTurnRequest
from duplex_actors.core.session import SubmitTurn
from duplex_actors.errors import InvalidCommand

from .helpers import CHUNK, core_in


def _request(core) -> ModelTurnRequest:
    core.handle(cmd.AppendAudio(pcm=CHUNK))
    core.handle(cmd.CommitInput())
    (request,) = [a.request for a in core.take_actions() if isinstance(a, SubmitTurn)]
    return request


def test_without_an_output_rate_audio_is_asked_for_at_the_session_rate():
    request = _request(core_in("idle"))
    assert request.output_sample_rate is None
    assert request.audio_out_rate == request.sample_rate == 16000


def test_the_configured_output_rate_reaches_the_engine_request():
    request = _request(core_in("idle", output_sample_rate=24000))
    assert (request.sample_rate, request.output_sample_rate, request.audio_out_rate) == (16000, 24000, 24000)


def test_a_session_update_changes_the_rate_of_later_turns_and_leaves_it_when_silent():
    core = core_in("idle", output_sample_rate=24000)
    core.handle(cmd.UpdateSession(output_sample_rate=8000))
    assert core.config.output_sample_rate == 8000
    core.handle(cmd.UpdateSession(instructions="shorter"))  # says nothing about the rate
    assert core.config.output_sample_rate == 8000
    assert _request(core).audio_out_rate == 8000


@pytest.mark.parametrize("rate", [0, 44100, -16000])
def test_an_unsupported_output_rate_is_a_typed_error(rate):
    with pytest.raises(InvalidCommand, match="sample rate"):
        cmd.UpdateSession(output_sample_rate=rate)
