"""A session's memory does not grow with the number of responses it has served.

What a session keeps per response (timing, engine-metric cursors, aborted ids, playback
positions, resume answers) is dropped or capped; the replay journal holds only what is younger
than its age limit, also for a session that has gone quiet. Checked on the sans-IO core, which
is where per-session state lives, both structure by structure and with tracemalloc over
hundreds of responses (a leak of one id string per response would be tens of KiB).
"""

import gc
import tracemalloc

import pytest

from duplex_actors.core import commands as cmd
from duplex_actors.core.clock import ManualClock
from duplex_actors.core.engine_io import Aborted, AudioPacket, Decision, EngineMetrics, TextDelta, TurnDone
from duplex_actors.core.events import HeartbeatAck
from duplex_actors.core.journal import ReplayJournal
from duplex_actors.core.session import SessionConfig, SessionCore, SubmitTurn
from duplex_actors.errors import ResyncRequired

from .helpers import CHUNK

PCM = b"\x02\x00" * 1600  # 100 ms

# One cycle of what a client does, one step per second of clock: every response path
# (completed, barge-in, cancel), a detach/resume with a fresh control id, a heartbeat.
CYCLE = (
    "complete",
    "complete",
    "barge",
    "complete",
    "cancel",
    "resume",
    "complete",
    "barge",
    "heartbeat",
    "complete",
)


def _start_turn(core: SessionCore) -> str:
    core.handle(cmd.AppendAudio(pcm=CHUNK))
    core.handle(cmd.CommitInput())
    (submit,) = [a for a in core.take_actions() if isinstance(a, SubmitTurn)]
    rid = submit.request.request_id
    core.on_engine_output(Decision(rid, True))
    core.on_engine_output(TextDelta(rid, "Hi"))
    core.on_engine_output(AudioPacket(rid, PCM, 16000, transcript="Hi"))
    return rid


def _step(core: SessionCore, kind: str, i: int) -> None:
    if kind == "complete":
        rid = _start_turn(core)
        response_id = core.response_id
        core.on_engine_output(TextDelta(rid, " there"))
        core.on_engine_output(TurnDone(rid, metrics=EngineMetrics("engine:test", 0.01, 2, (0.01,))))
        core.handle(cmd.PlaybackAck(response_id=response_id, played_ms=100))
    elif kind in ("barge", "cancel"):
        rid = _start_turn(core)
        core.handle(cmd.BargeIn() if kind == "barge" else cmd.CancelResponse())
        core.take_actions()
        core.on_engine_output(Aborted(rid))
    elif kind == "resume":
        core.handle(cmd.Detach())
        core.take_events()
        core.handle(
            cmd.Resume(
                generation=core.lease.generation,
                resume_token=core.lease.token,
                last_seq=core.last_seq,
                control_id=f"c{i}",
            )
        )
    else:
        core.handle(cmd.Heartbeat())
    core.take_events()
    core.clock.advance(1.0)


def _run(core: SessionCore, cycles: int, start: int) -> int:
    i = start
    for _ in range(cycles):
        for kind in CYCLE:
            _step(core, kind, i)
            i += 1
    return i


def _per_session_state(core: SessionCore) -> dict:
    return {
        "journal": core.journaled_events,
        "timing_empty": core.timing.is_empty,
        "windows": len(core._windows or ()),
        "aborted_ids": len(core._aborted_ids or ()),
        "playback": len(core._playback or ()),
        "pending": core.pending_events,
        "input": core.buffered_input_bytes,
        "in_flight": len(core.in_flight_requests),
        "aborting": len(core.aborting_requests),
    }


@pytest.mark.slow
def test_per_response_state_stays_bounded_over_many_responses():
    core = SessionCore(
        "sess_bounded000000", SessionConfig(journal_max_age_s=15.0, max_items=16), ManualClock(100.0)
    )  # a small item cap, reached during the warm-up
    tracemalloc.start()  # before the warm-up, so what it leaves alive is traced too
    try:
        i = _run(core, 20, 0)  # warm-up: past the journal's age limit and every cap (64 playbacks)
        gc.collect()
        warm_state = _per_session_state(core)
        warm_traced = tracemalloc.get_traced_memory()[0]
        i = _run(core, 100, i)  # 1000 more steps, 600 more responses, 100 more resumes
        gc.collect()
        end_traced = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    end_state = _per_session_state(core)
    assert core.counters.responses >= 600
    # Same phase of the cycle: every structure is exactly where it was after warm-up.
    assert end_state == warm_state
    assert end_state["timing_empty"] and end_state["windows"] == 0
    assert end_state["pending"] == end_state["input"] == end_state["in_flight"] == 0
    assert end_state["aborted_ids"] <= 16 and end_state["playback"] <= 64
    # And nothing else grew: one leaked id per response would be ~45 KiB here.
    assert end_traced - warm_traced < 8 * 1024, end_traced - warm_traced


def test_a_quiet_session_lets_go_of_its_journal_after_the_age_limit():
    core = SessionCore("sess_quiet00000000", SessionConfig(journal_max_age_s=60.0), ManualClock(100.0))
    _step(core, "complete", 0)
    held = core.journaled_events
    assert held > 10
    last = core.last_seq
    core.clock.advance(30.0)
    assert core.expire_journal() == 0  # younger than the limit: kept
    core.clock.advance(31.0)
    assert core.expire_journal() == held  # nothing was recorded since, and still it goes
    assert core.journaled_events == 0 and core._journal._items is None
    # What it dropped can no longer be replayed: declared, and nothing changes ...
    with pytest.raises(ResyncRequired):
        core.handle(cmd.Resume(generation=0, resume_token=core.lease.token, last_seq=1))
    assert core.lease.generation == 0
    # ... while a client that missed nothing resumes as before.
    core.handle(cmd.Resume(generation=0, resume_token=core.lease.token, last_seq=last))
    assert core.lease.generation == 1
    assert core.expire_journal() == 0  # an empty journal is a no-op


def test_journal_expire_keeps_the_young_and_counts_what_it_dropped():
    journal = ReplayJournal(max_events=100, max_bytes=1 << 20, max_age_s=10.0)
    assert journal.expire(0.0) == 0  # never used: nothing allocated, nothing to drop
    for seq in range(1, 6):
        journal.record(HeartbeatAck(seq=seq, epoch=0, session_id="s"), float(seq))
    assert journal.expire(12.5) == 2  # seq 1 and 2 are older than 10 s
    assert [e.seq for e in journal.since(2, 12.5)] == [3, 4, 5]
    with pytest.raises(ResyncRequired):
        journal.since(1, 12.5)
    assert journal.expire(100.0) == 3 and len(journal) == 0


def test_committed_audio_waiting_for_a_response_is_bounded_and_the_newest_is_kept():
    """GA commits do not start responses: a client committing and never asking for one held
    every commit's audio (and each commit copied all of it). Now the newest
    max_committed_bytes are kept, to the sample."""
    second = 16000 * 2
    config = SessionConfig(respond_on_commit=False, max_committed_bytes=second * 5 // 2)
    core = SessionCore("sess_commitbound0", config, ManualClock(0.0))
    chunks = [bytes([i % 250 + 1, 0]) * (second // 2) for i in range(200)]
    for pcm in chunks:
        core.handle(cmd.AppendAudio(pcm=pcm))
        core.handle(cmd.CommitInput())
    core.handle(cmd.CreateResponse())
    (submit,) = [a for a in core.take_actions() if isinstance(a, SubmitTurn)]
    assert submit.request.audio == (chunks[-3][second // 2 :] + chunks[-2] + chunks[-1])
    core.handle(cmd.AppendAudio(pcm=chunks[0]))
    core.handle(cmd.CommitInput())
    core.handle(cmd.CancelResponse())
    core.take_actions()
    core.take_events()
    core.handle(cmd.CreateResponse())
    (after,) = [a for a in core.take_actions() if isinstance(a, SubmitTurn)]
    assert after.request.audio == chunks[0]  # what the last response took is gone


def test_the_playback_ledger_stays_bounded_when_a_client_only_truncates():
    # Eviction ran on acknowledgements only: a client cancelling and truncating its answers
    # (never acknowledging one) grew the ledger by an entry a response, for good.
    from duplex_actors.core.playback import RECENT_RESPONSES, PlaybackLedger

    ledger = PlaybackLedger()
    for n in range(10 * RECENT_RESPONSES):
        ledger.truncated(f"item_{n}", 0)
    assert len(ledger) == RECENT_RESPONSES
    assert next(iter(ledger.snapshot())) == f"item_{9 * RECENT_RESPONSES}"  # the oldest went
    ledger.acknowledge("resp_x", 10)
    assert len(ledger) == RECENT_RESPONSES and ledger.played_ms("resp_x") == 10


def test_the_journal_counts_a_responses_metadata_and_an_errors_client_fields():
    # Uncounted, 10 sessions creating and cancelling responses with the largest metadata
    # OpenAI allows held ~21 MB of journal each against 5.2 MB counted.
    from duplex_actors.core import events as ev
    from duplex_actors.core.journal import event_size

    metadata = {f"k{i}": "\U0001f600" * 512 for i in range(16)}
    bare = ev.ResponseCreated(seq=1, epoch=0, session_id="s", response_id="r", turn_id=0)
    rich = ev.ResponseCreated(seq=1, epoch=0, session_id="s", response_id="r", turn_id=0, metadata=metadata)
    assert event_size(rich) - event_size(bare) >= 16 * 512 * 4
    done = ev.ResponseDone(
        seq=2, epoch=0, session_id="s", response_id="r", turn_id=0, status="cancelled", metadata=metadata
    )
    assert event_size(done) >= 16 * 512 * 4
    error = ev.ErrorEvent(
        seq=3, epoch=0, session_id="s", code="x", message="m", client_event_id="e" * 512, param="p" * 100
    )
    assert event_size(error) >= 128 + 1 + 512 + 100
