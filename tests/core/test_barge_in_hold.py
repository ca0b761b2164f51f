"""Barge-in without talk-over: speech over a response holds its audio until the overlap policy
decides; an interruption drops it unheard, a backchannel sends it on (issue 30, item 4)."""

from __future__ import annotations

import pytest

from duplex_actors.core import commands as cmd
from duplex_actors.core.engine_io import AudioPacket, TextDelta, TurnDone
from duplex_actors.core.outbox import Outbox
from duplex_actors.core.session import AbortRequests

from .helpers import core_in

PCM = b"\x02\x00" * 1600  # 100 ms of user audio
PACKET = b"\x03\x00" * 320  # 20 ms of response audio


def _audio_types(events) -> list[str]:
    """The response's audio and transcript deltas among ``events`` (not their done events)."""
    return [
        e.type for e in events if e.type.startswith("response.output_audio") and e.type.endswith(".delta")
    ]


def _speaking(**config):
    core = core_in("responding_begun", server_vad=True, min_interruption_ms=500, **config)
    rid = core.fence.request_id()
    core.on_engine_output(AudioPacket(rid, PACKET, transcript="hello "))
    assert "response.output_audio.delta" in [e.type for e in core.take_events()]
    return core, rid


def test_no_audio_reaches_the_client_after_speech_started_until_the_policy_decides():
    core, rid = _speaking()
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    for _ in range(3):
        core.on_engine_output(AudioPacket(rid, PACKET, transcript="more "))
        core.handle(cmd.AppendAudio(pcm=PCM, speech=True))
    events = core.take_events()
    assert "input_audio_buffer.speech_started" in [e.type for e in events]
    assert _audio_types(events) == []  # held: not one packet, not its transcript
    assert core.state == "responding"


def test_an_interruption_drops_the_held_audio_and_cancels_with_turn_detected():
    core, rid = _speaking()
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.on_engine_output(AudioPacket(rid, PACKET, transcript="more "))
    for _ in range(5):  # 500 ms of speech: the policy calls it an interruption
        core.handle(cmd.AppendAudio(pcm=PCM, speech=True))
    events = core.take_events()
    assert _audio_types(events) == []
    done = [e for e in events if e.type == "response.done"]
    assert [(d.status, d.reason) for d in done] == [("cancelled", "turn_detected")]
    assert core.state == "barge_in"
    assert core.take_actions() == [AbortRequests((rid,), "turn_detected")]
    assert core.counters.dropped_audio_events == 2  # the packet and its transcript delta


def test_a_backchannel_releases_the_held_audio_in_order():
    core, rid = _speaking()
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    for i in range(3):
        core.on_engine_output(AudioPacket(rid, PACKET, transcript=f"w{i} "))
    core.handle(cmd.AppendAudio(pcm=PCM, speech=True))  # 100 ms: "yeah"
    assert _audio_types(core.take_events()) == []
    core.handle(cmd.SpeechStoppedSignal(audio_ms=100))
    events = core.take_events()
    kinds = [e.type for e in events]
    # speech_stopped first, then the held packets, each followed by its transcript delta
    assert kinds[0] == "input_audio_buffer.speech_stopped"
    assert (
        _audio_types(events) == ["response.output_audio.delta", "response.output_audio_transcript.delta"] * 3
    )
    assert [e.delta for e in events if e.type == "response.output_audio_transcript.delta"] == [
        "w0 ",
        "w1 ",
        "w2 ",
    ]
    assert core.state == "responding" and core.epoch == 0
    # later audio flows straight through again
    core.on_engine_output(AudioPacket(rid, PACKET))
    assert _audio_types(core.take_events()) == ["response.output_audio.delta"]
    assert core.counters.released_audio_events == 6


def test_a_short_answer_that_ends_while_held_is_cancelled_by_an_interruption_not_completed():
    core, rid = _speaking()
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.on_engine_output(AudioPacket(rid, PACKET))
    core.on_engine_output(TurnDone(rid))  # the engine is done; the client has not heard it all
    assert core.state == "responding"
    assert "response.done" not in [e.type for e in core.take_events()]
    for _ in range(5):
        core.handle(cmd.AppendAudio(pcm=PCM, speech=True))
    done = [e for e in core.take_events() if e.type == "response.done"]
    assert [(d.status, d.reason) for d in done] == [("cancelled", "turn_detected")]
    # nothing to abort (the request ended) and nothing to wait for: the user's turn goes on
    assert core.take_actions() == []
    assert core.state == "listening" and not core.in_flight_requests
    core.handle(cmd.SpeechStoppedSignal(audio_ms=500))
    assert core.state == "responding"  # the interruption is answered
    (submit,) = core.take_actions()
    assert submit.request.fence.epoch == 1


def test_a_short_answer_that_ends_while_held_completes_after_a_backchannel():
    core, rid = _speaking()
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.on_engine_output(AudioPacket(rid, PACKET))
    core.on_engine_output(TurnDone(rid))
    core.handle(cmd.AppendAudio(pcm=PCM, speech=True))
    core.handle(cmd.SpeechStoppedSignal(audio_ms=100))
    events = core.take_events()
    kinds = [e.type for e in events]
    assert kinds.index("response.output_audio.delta") < kinds.index("response.done")
    done = [e for e in events if e.type == "response.done"]
    assert [d.status for d in done] == ["completed"]
    assert core.state in ("idle", "listening") and core.turn_id == 1 and not core.in_flight_requests


def test_without_the_hold_audio_plays_on_until_the_interruption():
    core, rid = _speaking(hold_audio_on_speech=False)
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.on_engine_output(AudioPacket(rid, PACKET))
    assert _audio_types(core.take_events()) == ["response.output_audio.delta"]


def test_interrupt_response_false_never_holds():
    core, rid = _speaking(interrupt_response=False)
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.on_engine_output(AudioPacket(rid, PACKET))
    assert _audio_types(core.take_events()) == ["response.output_audio.delta"]


def test_speech_before_the_engine_speaks_holds_its_first_audio():
    core = core_in("responding", server_vad=True)  # submitted, no engine output yet
    rid = core.fence.request_id()
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.on_engine_output(AudioPacket(rid, PACKET))
    assert _audio_types(core.take_events()) == []


def test_close_while_held_sends_none_of_it():
    core, rid = _speaking()
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.on_engine_output(AudioPacket(rid, PACKET))
    core.handle(cmd.Close())
    events = core.take_events()
    assert _audio_types(events) == [] and events[-1].type == "session.closed"


def test_a_text_only_response_is_never_held():
    core = core_in("responding_begun", server_vad=True, modalities=("text",))
    rid = core.fence.request_id()
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.on_engine_output(TextDelta(rid, "word"))
    assert "response.output_text.delta" in [e.type for e in core.take_events()]
    core.on_engine_output(TurnDone(rid))  # nothing held: it ends at once
    assert [e.status for e in core.take_events() if e.type == "response.done"] == ["completed"]


def test_text_beside_audio_is_held_with_it_and_released_in_order():
    core, rid = _speaking()  # modalities ("text", "audio"): the runtime's default
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.on_engine_output(AudioPacket(rid, PACKET))
    core.on_engine_output(TextDelta(rid, "word"))
    assert not [e for e in core.take_events() if e.type.endswith(".delta")]
    core.handle(cmd.SpeechStoppedSignal(audio_ms=100))
    kinds = [e.type for e in core.take_events() if e.type.endswith(".delta")]
    assert kinds.index("response.output_audio.delta") < kinds.index("response.output_text.delta")


def test_outbox_counts_held_events_against_its_capacity():
    from duplex_actors.core.events import AudioDeltaEvent

    box = Outbox(capacity=8, reserve=2)
    box.hold("r")

    def delta():
        return AudioDeltaEvent(seq=0, epoch=0, session_id="s", response_id="r", item_id="i", pcm=b"")

    assert all(box.push(delta()) for _ in range(6))
    assert len(box) == 0 and box.held == 6
    assert not box.push(delta()) and box.overflowed


def test_a_client_cancel_while_a_turn_end_is_held_cancels_with_nothing_left_to_abort():
    core, rid = _speaking()
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.on_engine_output(AudioPacket(rid, PACKET))
    core.on_engine_output(TurnDone(rid))
    core.handle(cmd.CancelResponse())
    events = core.take_events()
    assert _audio_types(events) == []
    done = [e for e in events if e.type == "response.done"]
    assert [(d.status, d.reason) for d in done] == [("cancelled", "client_cancelled")]
    assert core.take_actions() == []  # the request had ended: no abort that nobody confirms
    assert core.state == "listening"


def test_a_barge_in_command_while_held_drops_the_held_audio():
    core, rid = _speaking()
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.on_engine_output(AudioPacket(rid, PACKET))
    core.handle(cmd.BargeIn())
    events = core.take_events()
    assert _audio_types(events) == []
    assert core.state == "barge_in" and core.take_actions() == [AbortRequests((rid,), "turn_detected")]


def test_an_engine_failure_while_held_sends_the_held_audio_before_the_failure():
    from duplex_actors.core.engine_io import EngineFailure

    core, rid = _speaking()
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.on_engine_output(AudioPacket(rid, PACKET))
    core.on_engine_output(EngineFailure(rid, "boom"))
    kinds = [e.type for e in core.take_events()]
    assert kinds.index("response.output_audio.delta") < kinds.index("response.done")
    # the hold ended with the response: the next response's audio is not held
    assert core.state in ("idle", "listening")


def test_the_idle_timer_counts_from_the_end_of_released_audio():
    from duplex_actors.core.clock import ManualClock
    from duplex_actors.core.session import SessionConfig, SessionCore

    clock = ManualClock(100.0)
    core = SessionCore("sess_hold00000000", SessionConfig(server_vad=True, idle_timeout_ms=1000), clock)
    core.handle(cmd.AppendAudio(pcm=PCM))
    core.handle(cmd.CommitInput())
    rid = core.fence.request_id()
    core.on_engine_output(AudioPacket(rid, PACKET * 10))  # 200 ms of answer, until 100.2
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    clock.advance(0.5)  # held for 0.5 s: the answer now ends 0.5 s later than sent
    core.handle(cmd.SpeechStoppedSignal(audio_ms=100))
    core.on_engine_output(TurnDone(rid))
    assert core._idle_deadline is not None
    assert core._idle_deadline == pytest.approx(100.2 + 0.5 + 1.0)


def test_an_update_that_restarts_turn_detection_releases_what_was_held():
    """The server starts a new detector on such an update: the open speech never stops, so
    the hold must not wait for it (the answer would never play, nor end)."""
    core, rid = _speaking()
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.on_engine_output(AudioPacket(rid, PACKET))
    core.on_engine_output(TurnDone(rid))
    core.handle(cmd.UpdateSession(instructions="be brief"))  # no bearing on the overlap: still held
    assert _audio_types(core.take_events()) == []
    core.handle(cmd.UpdateSession(server_vad=False))
    events = core.take_events()
    assert _audio_types(events) == ["response.output_audio.delta"]
    assert [e.status for e in events if e.type == "response.done"] == ["completed"]
    assert core.state in ("idle", "listening")


def test_a_turn_ended_by_a_failure_after_its_held_end_leaves_no_held_end_for_the_next_turn():
    # Found by the session machine: an end that waited on held audio, then a failure of the same
    # request, ended the turn but left the waiting end behind; the next turn's barge-in then
    # took its (live) request for ended and aborted nothing.
    from duplex_actors.core.engine_io import EngineFailure

    core, rid = _speaking()
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.on_engine_output(TurnDone(rid))  # waits: the audio is held
    core.on_engine_output(EngineFailure(rid, "engine gone"))
    assert core.state in ("idle", "listening")
    core.take_actions()
    core.take_events()
    core.handle(cmd.AppendAudio(pcm=PCM))
    core.handle(cmd.CreateResponse())
    live = core.fence.request_id()
    core.take_actions()
    core.handle(cmd.BargeIn(reason="turn_detected"))
    aborts = [a for a in core.take_actions() if isinstance(a, AbortRequests)]
    assert [a.request_ids for a in aborts] == [(live,)]
