"""A failing example prints audio as its length, not every byte: hypothesis prints values with
its pretty printer (which ignores attrs' repr settings unless told), and a program of appends
would otherwise print tens of kilobytes of pcm per step."""

from __future__ import annotations

import pytest
from hypothesis.vendor.pretty import pretty

from duplex_actors.core import commands as cmd
from duplex_actors.core.engine_io import AudioPacket, ModelTurnRequest, TurnKind
from duplex_actors.core.fence import Fence

PCM = b"\x01\x00" * 3200  # 200 ms


@pytest.mark.parametrize(
    "value",
    [
        cmd.AppendAudio(pcm=PCM, event_id="evt_1"),
        AudioPacket("sess_x/e0/t0", PCM, 16000, "hi"),
        ModelTurnRequest("sess_x/e0/t0", Fence("sess_x", 0, 0), TurnKind.RESPONSE, PCM),
    ],
    ids=lambda v: type(v).__name__,
)
def test_hypothesis_prints_audio_values_as_their_short_repr(value):
    printed = pretty(value)
    assert printed == repr(value)
    # The bound tells "audio as its length" from "audio as bytes" (200 ms of pcm prints as
    # ~25,000 characters); it is not a budget for the number of fields a value has.
    assert "6400 bytes" in printed and len(printed) < 1000
