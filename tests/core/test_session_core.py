"""Behaviour of the sans-IO session core beyond the state table."""

import pytest

from duplex_actors.core import commands as cmd
from duplex_actors.core.engine_io import Aborted, AudioPacket, Decision, EngineFailure, TextDelta, TurnDone
from duplex_actors.core.session import AbortRequests, SubmitTurn
from duplex_actors.errors import Backpressure, InvalidCommand, ResumeConflict, ResyncRequired, StaleFence

from .helpers import CHUNK, core_in

PCM = b"\x02\x00" * 1600  # 100 ms


def types(events):
    return [e.type for e in events]


def test_full_turn_event_order_and_metrics():
    core = core_in("listening")
    clock = core.clock
    core.handle(cmd.CommitInput())
    (submit,) = core.take_actions()
    rid = submit.request.request_id
    assert rid == "sess_table000000/e0/t0"
    clock.advance(0.050)
    core.on_engine_output(Decision(rid, True))
    clock.advance(0.010)
    core.on_engine_output(TextDelta(rid, "Hi"))
    clock.advance(0.020)
    core.on_engine_output(AudioPacket(rid, PCM, 16000, transcript="Hi"))
    clock.advance(0.030)
    core.on_engine_output(TextDelta(rid, " you"))
    core.on_engine_output(TurnDone(rid))
    evs = core.take_events()
    assert types(evs) == [
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_audio.delta",
        "response.output_audio_transcript.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    done = evs[-1]
    assert done.status == "completed"
    m = done.metrics
    assert m.source == "server"
    assert m.ttft_ms == pytest.approx(60.0)
    assert m.ttfp_ms == pytest.approx(80.0)
    assert m.tpot_ms == pytest.approx(50.0)
    assert m.token_count == 2
    assert m.rtf == pytest.approx(0.080 / 0.100)
    first_text = evs[7]
    assert first_text.metrics.ttft_ms == pytest.approx(60.0)
    assert evs[8].metrics.ttfp_ms == pytest.approx(80.0)
    assert evs[10].metrics is None  # only the first delta carries TTFT
    assert [e.seq for e in evs] == sorted(e.seq for e in evs)
    assert core.state == "idle" and core.turn_id == 1 and core.timing.is_empty


def test_barge_in_cancels_once_drops_unheard_audio_and_fences_off_late_output():
    core = core_in("responding_begun")
    rid = core.fence.request_id()
    for _ in range(5):
        core.on_engine_output(AudioPacket(rid, PCM, 16000))
    core.clock.advance(0.001)
    core.handle(cmd.BargeIn(), received_at=core.clock.now() - 0.0005)
    assert core.state == "barge_in" and core.epoch == 1
    assert core.take_actions() == [AbortRequests((rid,), "turn_detected")]
    # late output of the cancelled request: consumed and counted, never delivered
    core.on_engine_output(AudioPacket(rid, PCM, 16000))
    core.on_engine_output(TextDelta(rid, "late"))
    assert core.counters.stale_outputs == 2
    core.on_engine_output(Aborted(rid))
    assert core.state == "idle"
    evs = core.take_events()
    assert "response.output_audio.delta" not in types(evs)
    assert core.counters.dropped_audio_events == 5
    done = [e for e in evs if e.type == "response.done"]
    assert len(done) == 1 and done[0].status == "cancelled" and done[0].reason == "turn_detected"
    assert done[0].metrics.stop_latency_ms == pytest.approx(0.5, abs=0.01)
    assert core.timing.is_empty


def test_cancel_has_reason_client_cancelled_and_epoch_moves_once():
    core = core_in("responding_begun")
    core.handle(cmd.CancelResponse())
    assert core.epoch == 1
    done = [e for e in core.take_events() if e.type == "response.done"]
    assert [d.reason for d in done] == ["client_cancelled"]


def test_stale_fenced_command_is_refused():
    core = core_in("responding_begun")
    core.handle(cmd.BargeIn())
    with pytest.raises(StaleFence):
        core.handle(cmd.CancelResponse(epoch=0))
    core.handle(cmd.Heartbeat(epoch=1))


def test_short_overlap_is_a_backchannel_long_one_barges_in():
    core = core_in("responding_begun", min_interruption_ms=500)
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    for _ in range(4):  # 400 ms of speech over the response
        core.handle(cmd.AppendAudio(pcm=PCM))
    core.handle(cmd.SpeechStoppedSignal(audio_ms=400))
    assert core.state == "responding" and core.epoch == 0
    core.handle(cmd.SpeechStartedSignal(audio_ms=900))
    for _ in range(5):  # 500 ms: barge-in
        core.handle(cmd.AppendAudio(pcm=PCM))
    assert core.state == "barge_in" and core.epoch == 1
    done = [e for e in core.take_events() if e.type == "response.done"]
    assert done[0].reason == "turn_detected"


def test_engine_failure_ends_the_response_failed_and_next_turn_works():
    core = core_in("responding_begun")
    rid = core.fence.request_id()
    core.on_engine_output(EngineFailure(rid, "boom"))
    evs = core.take_events()
    assert [e.status for e in evs if e.type == "response.done"] == ["failed"]
    assert any(e.type == "error" for e in evs)
    core.handle(cmd.AppendAudio(pcm=CHUNK))
    core.handle(cmd.CommitInput())
    (submit,) = core.take_actions()
    assert submit.request.fence.turn_id == 1


def test_model_native_units_listen_then_speak():
    core = core_in("idle", model_native=True, unit_samples=1600)
    core.handle(cmd.AppendAudio(pcm=PCM))  # exactly one unit
    (unit,) = core.take_actions()
    assert isinstance(unit, SubmitTurn) and unit.request.kind.value == "unit"
    core.on_engine_output(Decision(unit.request.request_id, False))
    assert core.state == "listening"
    core.handle(cmd.AppendAudio(pcm=PCM))
    (unit2,) = core.take_actions()
    core.on_engine_output(Decision(unit2.request.request_id, True))
    assert core.state == "responding"
    core.on_engine_output(TextDelta(unit2.request.request_id, "yes"))
    core.on_engine_output(TurnDone(unit2.request.request_id))
    evs = types(core.take_events())
    assert evs.count("duplex.decision") == 1  # the listen decision
    assert evs.count("response.created") == 1 and evs.count("response.done") == 1


def test_a_listen_decision_ends_an_aborted_unit_request_but_not_an_aborted_response():
    # Response request: only a real terminal ends it, so barge_in waits for one.
    core = core_in("barge_in")
    rid = f"{core.session_id}/e0/t0"
    core.on_engine_output(Decision(rid, False))
    assert core.state == "barge_in" and core.aborting_requests == {rid}
    core.on_engine_output(Aborted(rid))
    assert core.state == "idle" and not core.aborting_requests

    # Model-native units: u2 speaks (and is promoted, staying a UNIT request), u1 is
    # superseded; after a barge-in a listen decision ends each of them.
    core = core_in("idle", model_native=True, unit_samples=1600)
    core.handle(cmd.AppendAudio(pcm=PCM))
    core.handle(cmd.AppendAudio(pcm=PCM))
    u1, u2 = (a.request.request_id for a in core.take_actions())
    core.on_engine_output(Decision(u2, True))
    assert core.state == "responding" and core.aborting_requests == {u1}
    core.handle(cmd.BargeIn())
    assert core.state == "barge_in" and core.aborting_requests == {u1, u2}
    core.on_engine_output(Decision(u1, False))
    assert core.aborting_requests == {u2}
    core.on_engine_output(Decision(u2, False))
    assert core.state != "barge_in" and not core.aborting_requests


def test_input_backpressure_and_bad_audio_change_nothing():
    core = core_in("idle", max_input_bytes=len(PCM))
    core.handle(cmd.AppendAudio(pcm=PCM))
    with pytest.raises(Backpressure):
        core.handle(cmd.AppendAudio(pcm=CHUNK))
    assert core.buffered_input_bytes == len(PCM)
    with pytest.raises(InvalidCommand):
        core.handle(cmd.AppendAudio(pcm=CHUNK, sample_rate=24000))
    with pytest.raises(InvalidCommand):
        cmd.AppendAudio(pcm=b"\x00")


def test_resume_replays_missed_events_once_and_refuses_stale_resumes():
    core = core_in("listening")
    core.handle(cmd.Heartbeat())
    seen = core.take_events()
    core.handle(cmd.Detach())
    core.handle(cmd.Heartbeat())
    missed = core.take_events()  # handed to a socket that died
    gen, token = core.lease.generation, core.lease.token
    core.handle(cmd.Resume(generation=gen, resume_token=token, last_seq=seen[-1].seq, control_id="r1"))
    replay = core.take_events()
    assert [e.seq for e in replay[: len(missed)]] == [e.seq for e in missed]
    assert replay[-1].type == "session.resumed"
    # the same resume again (same control id) is idempotent; an old generation conflicts
    core.handle(cmd.Resume(generation=gen, resume_token=token, last_seq=replay[-1].seq, control_id="r1"))
    with pytest.raises(ResumeConflict):
        core.handle(cmd.Resume(generation=gen, resume_token=token, last_seq=0, control_id="r2"))


def test_resume_past_the_journal_requires_resync():
    core = core_in("idle", journal_max_events=4)
    for _ in range(10):
        core.handle(cmd.Heartbeat())
    core.take_events()
    with pytest.raises(ResyncRequired):
        core.handle(cmd.Resume(generation=0, resume_token=core.lease.token, last_seq=1))
    assert core.lease.generation == 0  # nothing changed


def test_close_mid_response_emits_one_done_then_one_closed_and_aborts():
    core = core_in("responding_begun")
    rid = core.fence.request_id()
    core.handle(cmd.Close())
    assert core.take_actions() == [AbortRequests((rid,), "client_closed")]
    evs = types(core.take_events())
    assert evs[-2:] == ["response.done", "session.closed"]
    core.on_engine_output(TextDelta(rid, "late"))
    assert core.counters.stale_outputs == 1 and core.take_events() == []


def test_server_vad_speech_stopped_commits_and_starts_a_turn():
    core = core_in("idle", server_vad=True)
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.handle(cmd.AppendAudio(pcm=PCM))
    core.handle(cmd.SpeechStoppedSignal(audio_ms=100))
    assert core.state == "responding"
    (submit,) = core.take_actions()
    assert len(submit.request.audio) == len(PCM)
    # The response is created; its message opens with its first words (none yet).
    assert types(core.take_events())[-5:] == [
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
        "response.created",
    ]


def test_without_server_vad_speech_stopped_only_reports():
    core = core_in("listening")
    core.handle(cmd.SpeechStoppedSignal(audio_ms=100))
    assert core.state == "listening" and core.take_actions() == []


def test_close_is_never_fenced_off_and_future_epochs_are_refused():
    from duplex_actors.errors import FenceAhead

    core = core_in("listening")
    with pytest.raises(FenceAhead):
        core.handle(cmd.CommitInput(epoch=3))
    assert core.state == "listening"
    core.handle(cmd.BargeIn(epoch=0))
    core.handle(cmd.Close(epoch=99))
    assert core.state == "closed"


def test_a_second_resume_before_the_first_replay_was_read_replaces_it():
    """Two resumes before any read (the first connection died at once): each missed event is
    re-sent once. The second replay replaced the first; prepended, it sent them twice."""
    core = core_in("listening")
    core.handle(cmd.Heartbeat())
    seen = core.take_events()
    core.handle(cmd.Detach())
    for _ in range(3):
        core.handle(cmd.Heartbeat())
    core.take_events()  # handed to a socket that died
    for control_id in ("r1", "r2"):
        core.handle(
            cmd.Resume(
                generation=core.lease.generation,
                resume_token=core.lease.token,
                last_seq=seen[-1].seq,
                control_id=control_id,
            )
        )
    seqs = [e.seq for e in core.take_events() if e.seq]
    assert len(seqs) == len(set(seqs)) and seqs == sorted(seqs)
    assert seqs[:3] == [seen[-1].seq + 1, seen[-1].seq + 2, seen[-1].seq + 3]
