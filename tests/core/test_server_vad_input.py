"""Server VAD's input: the pre-speech window and the idle timeout (sans-IO, manual clock).

Under server VAD the session, not the client, decides what a turn's audio is: the speech with
``speech_prefix_ms`` of what came just before it. Outside speech the input keeps only that
window, so a microphone streaming quiet for minutes neither fills the buffer (appends refused
as input_backpressure) nor rides along with the next turn. After a response's audio has
played, ``idle_timeout_ms`` of quiet commits what the input holds and starts a response.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.core import commands as cmd
from duplex_actors.core.actions import SubmitTurn
from duplex_actors.core.clock import ManualClock
from duplex_actors.core.engine_io import AudioPacket, TurnDone
from duplex_actors.core.session import SessionConfig, SessionCore
from duplex_actors.errors import InvalidCommand

RATE = 16000
MS = RATE * 2 // 1000  # bytes of pcm16 per millisecond


def vad_core(**config) -> SessionCore:
    config.setdefault("server_vad", True)
    config.setdefault("respond_on_commit", False)
    return SessionCore("sess_vadinput0000", SessionConfig(**config), ManualClock(100.0))


def chunk(ms: int, fill: int) -> bytes:
    return bytes([fill, 0]) * (ms * MS // 2)


def types(events) -> list[str]:
    return [e.type for e in events]


# --- the pre-speech window --------------------------------------------------------------------

# One step of a stream under server VAD: an append of n bytes, or a VAD signal.
_step = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 600).map(lambda n: 2 * n)),
    st.tuples(st.just("speech_started"), st.just(0)),
    st.tuples(st.just("speech_stopped"), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(prefix_ms=st.integers(0, 40), steps=st.lists(_step, min_size=5, max_size=60))
def test_a_turn_is_its_speech_and_the_window_before_it_and_quiet_is_never_kept_beyond_it(prefix_ms, steps):
    """Against a model written from the rule: outside speech only the newest ``prefix_ms`` of
    audio is kept; from speech_started everything is; speech_stopped commits it all. Each
    chunk's bytes are distinct, so the committed audio names exactly which bytes were kept."""
    core = vad_core(speech_prefix_ms=prefix_ms, auto_respond=False)
    window = prefix_ms * MS
    expected_buffer = b""
    expected_committed = b""
    speaking = False
    trimmed = 0
    for i, (kind, size) in enumerate(steps):
        if kind == "append":
            pcm = bytes([i % 251 + 1, i % 7]) * (size // 2)
            core.handle(cmd.AppendAudio(pcm=pcm))
            expected_buffer += pcm
            if not speaking and len(expected_buffer) > window:
                trimmed += 1
                expected_buffer = expected_buffer[len(expected_buffer) - window :]
        elif kind == "speech_started":
            core.handle(cmd.SpeechStartedSignal(audio_ms=0))
            speaking = True
        else:
            core.handle(cmd.SpeechStoppedSignal(audio_ms=0))
            speaking = False
            expected_committed += expected_buffer
            expected_buffer = b""
        assert core.buffered_input_bytes == len(expected_buffer)
        if not speaking:
            assert core.buffered_input_bytes <= window
    core.handle(cmd.CreateResponse())
    (submit,) = [a for a in core.take_actions() if isinstance(a, SubmitTurn)]
    assert submit.request.audio == expected_committed


def test_quiet_streamed_for_longer_than_the_input_buffer_is_never_refused():
    # 3 s of input buffer, 10 s of quiet: every append is accepted, the buffer holds 300 ms.
    core = vad_core(max_input_bytes=3 * 1000 * MS)
    for _ in range(500):
        core.handle(cmd.AppendAudio(pcm=chunk(20, 1)))
    assert core.counters.rejected == 0
    assert core.buffered_input_bytes == 300 * MS
    assert core.received_audio_ms == pytest.approx(10_000.0)


def test_without_server_vad_the_client_commits_everything_it_sent():
    core = vad_core(server_vad=False)
    for _ in range(50):
        core.handle(cmd.AppendAudio(pcm=chunk(20, 1)))
    assert core.buffered_input_bytes == 1000 * MS


def test_speech_in_progress_is_kept_whole_however_long():
    core = vad_core(speech_prefix_ms=100)
    core.handle(cmd.AppendAudio(pcm=chunk(500, 1)))
    core.handle(cmd.SpeechStartedSignal(audio_ms=400))
    for _ in range(100):
        core.handle(cmd.AppendAudio(pcm=chunk(20, 2)))
    assert core.buffered_input_bytes == (100 + 2000) * MS
    core.handle(cmd.SpeechStoppedSignal(audio_ms=2500))
    (submit,) = core.take_actions()
    assert submit.request.audio == chunk(100, 1) + chunk(2000, 2)


def test_new_turn_detection_settings_forget_speech_the_old_detector_had_open():
    # The server builds a new VAD for each turn_detection update: a speech_stopped for speech
    # the old one heard start never comes, and the window must apply again at once.
    core = vad_core()
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.handle(cmd.UpdateSession(server_vad=True, speech_prefix_ms=100))
    for _ in range(20):
        core.handle(cmd.AppendAudio(pcm=chunk(20, 1)))
    assert core.buffered_input_bytes == 100 * MS


def test_update_values_are_checked():
    with pytest.raises(InvalidCommand):
        cmd.UpdateSession(idle_timeout_ms=-1)
    with pytest.raises(InvalidCommand):
        cmd.UpdateSession(speech_prefix_ms=True)


# --- the idle timeout -------------------------------------------------------------------------


def respond(core: SessionCore, audio_ms: int = 0) -> None:
    """A response.create answered with ``audio_ms`` of audio delivered at once, then done."""
    core.handle(cmd.CreateResponse())
    (submit,) = core.take_actions()
    rid = submit.request.request_id
    if audio_ms:
        core.on_engine_output(AudioPacket(rid, chunk(audio_ms, 3), RATE))
    core.on_engine_output(TurnDone(rid))
    core.take_events()


def test_the_timeout_counts_from_when_the_response_finishes_playing():
    core = vad_core(idle_timeout_ms=5000)
    clock = core.clock
    assert core.idle_deadline is None  # no response yet: nothing to be idle after
    respond(core, audio_ms=2000)  # sent at 100.0, plays until 102.0
    assert core.idle_deadline == pytest.approx(107.0)
    clock.advance(6.9)
    core.idle_timeout()  # early (a stale timer): nothing happens
    assert core.take_events() == [] and core.take_actions() == []
    # The client streams its (quiet) microphone meanwhile: 7 s of it.
    for _ in range(350):
        core.handle(cmd.AppendAudio(pcm=chunk(20, 1)))
    clock.advance(0.1)
    core.idle_timeout()
    events = core.take_events()
    assert types(events)[:5] == [
        "input_audio_buffer.timeout_triggered",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
        "response.created",
    ]
    triggered, committed = events[0], events[1]
    assert triggered.item_id == committed.item_id
    assert (triggered.audio_start_ms, triggered.audio_end_ms) == (2000, 7000)
    assert committed.audio_ms == 300  # the pre-speech window, not 7 s of quiet
    (submit,) = core.take_actions()
    assert isinstance(submit, SubmitTurn) and len(submit.request.audio) == 300 * MS
    assert core.state == "responding" and core.idle_deadline is None


def test_without_audio_from_the_client_the_timeout_commits_an_empty_item():
    core = vad_core(idle_timeout_ms=1000)
    respond(core)
    core.clock.advance(1.0)
    core.idle_timeout()
    events = core.take_events()
    assert (events[0].audio_start_ms, events[0].audio_end_ms) == (0, 0)
    assert events[1].type == "input_audio_buffer.committed" and events[1].audio_ms == 0
    assert core.state == "responding"


def test_speech_holds_the_timer_and_its_end_starts_it_again():
    core = vad_core(idle_timeout_ms=1000, auto_respond=False)
    respond(core)
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    assert core.idle_deadline is None
    core.clock.advance(5.0)
    core.idle_timeout()
    assert core.take_actions() == []  # the user is speaking: never idle
    core.handle(cmd.AppendAudio(pcm=chunk(200, 2)))
    core.handle(cmd.SpeechStoppedSignal(audio_ms=200))
    assert core.idle_deadline == pytest.approx(106.0)  # create_response off: the quiet counts


def test_a_response_in_flight_holds_the_timer():
    core = vad_core(idle_timeout_ms=1000)
    respond(core)
    core.handle(cmd.CreateResponse())
    assert core.idle_deadline is None
    (submit,) = core.take_actions()
    core.take_events()
    core.clock.advance(2.0)
    core.idle_timeout()
    assert core.take_actions() == [] and core.take_events() == []
    assert core.response_id is not None and core.state == "responding"


def test_a_cancelled_response_counts_from_the_cancel_not_from_its_unplayed_audio():
    core = vad_core(idle_timeout_ms=1000)
    core.handle(cmd.CreateResponse())
    (submit,) = core.take_actions()
    core.on_engine_output(AudioPacket(submit.request.request_id, chunk(3000, 3), RATE))
    core.clock.advance(0.5)
    core.handle(cmd.CancelResponse())
    assert core.idle_deadline == pytest.approx(101.5)


def test_turning_the_timeout_off_or_server_vad_off_clears_it_and_a_closed_session_has_none():
    core = vad_core(idle_timeout_ms=1000)
    respond(core)
    core.handle(cmd.UpdateSession(idle_timeout_ms=0))
    assert core.idle_deadline is None and core.config.idle_timeout_ms is None
    core.handle(cmd.UpdateSession(idle_timeout_ms=2000))  # set again after a response: from now
    assert core.idle_deadline == pytest.approx(102.0)
    core.handle(cmd.UpdateSession(server_vad=False))
    assert core.idle_deadline is None
    core.handle(cmd.UpdateSession(server_vad=True))
    respond(core)
    assert core.idle_deadline == pytest.approx(102.0)
    core.handle(cmd.Close())
    assert core.idle_deadline is None
    core.clock.advance(10.0)
    core.idle_timeout()  # a timer racing the close changes nothing
    assert types(core.take_events()) == ["session.closed"]


def test_without_a_timeout_no_timer_is_ever_set():
    core = vad_core()
    respond(core, audio_ms=100)
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    core.handle(cmd.SpeechStoppedSignal(audio_ms=0))
    assert core.idle_deadline is None


# --- speech that may not interrupt (GA interrupt_response: false) ------------------------------


def test_without_interrupt_response_speech_over_an_answer_lets_it_play_and_becomes_the_next_turn():
    core = vad_core(interrupt_response=False, min_interruption_ms=100)
    core.handle(cmd.CreateResponse())
    (submit,) = core.take_actions()
    rid = submit.request.request_id
    core.on_engine_output(AudioPacket(rid, chunk(500, 3), RATE))
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    for _ in range(20):  # 2 s of speech: far past min_interruption_ms
        core.handle(cmd.AppendAudio(pcm=chunk(100, 2), speech=True))
    assert core.state == "responding" and core.epoch == 0  # not cancelled
    core.handle(cmd.SpeechStoppedSignal(audio_ms=2000))
    events = types(core.take_events())
    assert events[-4:] == [
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
    ]
    assert core.take_actions() == []  # no second response while this one plays
    core.on_engine_output(TurnDone(rid))
    done = [e for e in core.take_events() if e.type == "response.done"]
    assert [d.status for d in done] == ["completed"]
    core.handle(cmd.CreateResponse())
    (nxt,) = core.take_actions()
    assert nxt.request.audio == chunk(2000, 2)  # the committed speech, whole


def test_with_interrupt_response_the_same_speech_cancels_the_answer():
    core = vad_core(min_interruption_ms=100)
    core.handle(cmd.CreateResponse())
    core.take_actions()
    core.handle(cmd.SpeechStartedSignal(audio_ms=0))
    for _ in range(2):
        core.handle(cmd.AppendAudio(pcm=chunk(100, 2), speech=True))
    assert core.state == "barge_in"


def test_a_detached_session_prompts_nobody_and_the_quiet_counts_again_from_the_resume():
    core = vad_core(idle_timeout_ms=1000)
    respond(core)
    assert core.idle_deadline == pytest.approx(101.0)
    core.handle(cmd.Detach())
    assert core.idle_deadline is None
    core.clock.advance(5.0)
    core.idle_timeout()  # a timer set before the detach: nothing happens
    assert core.take_actions() == []
    respond(core)  # an answer that completes while nobody is attached does not set it either
    assert core.idle_deadline is None
    gen, token = core.lease.generation, core.lease.token
    core.handle(cmd.Resume(generation=gen, resume_token=token, last_seq=core.last_seq))
    assert core.idle_deadline == pytest.approx(106.0)


def test_a_model_native_session_hears_every_unit_quiet_included():
    core = vad_core(model_native=True, unit_samples=16000)
    for _ in range(50):  # 1 s of quiet: one full unit goes to the model
        core.handle(cmd.AppendAudio(pcm=chunk(20, 1)))
    (unit,) = [a for a in core.take_actions() if isinstance(a, SubmitTurn)]
    assert len(unit.request.audio) == 1000 * MS
