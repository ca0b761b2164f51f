"""Server VAD's session under hypothesis: the pre-speech window and the idle timeout.

A rule-based machine drives one sans-IO core with server VAD and an idle timeout through any
order of appends, VAD signals, responses (created, streamed, finished, cancelled), detaches and
resumes, clock steps and idle timers (early, late and stale ones). After every step it checks
the invariants the statechart promises for this mode:

* outside speech the input holds at most the prefix window;
* the idle timer is never set while the user speaks, a turn is in flight, the session is
  detached or closed;
* an idle timer fires a prompt only once its deadline has passed, and then exactly one
  ``timeout_triggered`` precedes the commit and the response it starts;
* the client's event stream keeps its own invariants (one response at a time, each ending
  with exactly one ``response.done``), checked by the exported ``EventStreamChecker``.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from duplex_actors.core import commands as cmd
from duplex_actors.core.actions import AbortRequests, SubmitTurn
from duplex_actors.core.clock import ManualClock
from duplex_actors.core.engine_io import Aborted, AudioPacket, TextDelta, TurnDone
from duplex_actors.core.session import SessionConfig, SessionCore
from duplex_actors.testing.model import EventStreamChecker

RATE = 16000
PREFIX_MS = 60
WINDOW = PREFIX_MS * RATE * 2 // 1000
TIMEOUT_MS = 1000


class ServerVadSession(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock(0.0)
        config = SessionConfig(
            server_vad=True,
            respond_on_commit=False,
            speech_prefix_ms=PREFIX_MS,
            idle_timeout_ms=TIMEOUT_MS,
            min_interruption_ms=200,
        )
        self.core = SessionCore("sess_vadmachine00", config, self.clock)
        self.checker = EventStreamChecker()
        self.speaking = False
        self.requests: list[str] = []  # submitted, not yet ended
        self.detached = False
        self.prompts = 0
        self._drain()  # session.created

    def _drain(self) -> list:
        for action in self.core.take_actions():
            if isinstance(action, SubmitTurn):
                self.requests.append(action.request.request_id)
            elif isinstance(action, AbortRequests):
                for rid in action.request_ids:
                    if rid in self.requests:
                        self.requests.remove(rid)
                        self.core.on_engine_output(Aborted(rid))
        events = self.core.take_events()
        self.checker.feed(events)
        return events

    def _try(self, command) -> None:
        try:
            self.core.handle(command)
        except Exception as err:  # refusals are typed and change nothing; others are bugs
            assert type(err).__module__ == "duplex_actors.errors", err
        self._drain()

    @rule(ms=st.integers(1, 120), loud=st.booleans())
    def append(self, ms, loud):
        self._try(
            cmd.AppendAudio(pcm=(b"\x10\x27" if loud else b"\x01\x00") * (ms * RATE // 1000), speech=loud)
        )

    @rule()
    def speech_started(self):
        self._try(cmd.SpeechStartedSignal(audio_ms=int(self.core.received_audio_ms)))
        self.speaking = not self.core.closed

    @rule()
    def speech_stopped(self):
        self._try(cmd.SpeechStoppedSignal(audio_ms=int(self.core.received_audio_ms)))
        self.speaking = False

    @rule()
    def create_response(self):
        self._try(cmd.CreateResponse())

    @rule()
    def cancel(self):
        self._try(cmd.CancelResponse())

    @precondition(lambda self: self.requests)
    @rule(audio_ms=st.integers(0, 1500), text=st.booleans())
    def engine_streams(self, audio_ms, text):
        rid = self.requests[-1]
        if text:
            self.core.on_engine_output(TextDelta(rid, "hi"))
        if audio_ms:
            self.core.on_engine_output(AudioPacket(rid, b"\x02\x00" * (audio_ms * 24), 24000))
        self._drain()

    @precondition(lambda self: self.requests)
    @rule()
    def engine_finishes(self):
        rid = self.requests.pop()
        self.core.on_engine_output(TurnDone(rid))
        self._drain()

    @rule(seconds=st.sampled_from([0.01, 0.3, 0.999, 1.0, 2.5]))
    def time_passes(self, seconds):
        self.clock.advance(seconds)

    @rule()
    def idle_timer_fires(self):
        """The shell's timer, at any moment: early, on time, late, or stale."""
        deadline = self.core.idle_deadline
        due = deadline is not None and self.clock.now() >= deadline
        state = self.core.state
        self.core.idle_timeout()
        events = self._drain()
        types = [e.type for e in events]
        if due and state in ("idle", "listening", "barge_in"):
            assert types[:2] == ["input_audio_buffer.timeout_triggered", "input_audio_buffer.committed"]
            assert "response.created" in types
            assert self.core.state == "responding" and self.core.idle_deadline is None
            self.prompts += 1
        else:
            assert events == [], types

    @precondition(lambda self: not self.detached)
    @rule()
    def detach(self):
        self._try(cmd.Detach())
        self.detached = not self.core.closed

    @precondition(lambda self: self.detached)
    @rule()
    def resume(self):
        core = self.core
        self._try(
            cmd.Resume(
                generation=core.lease.generation, resume_token=core.lease.token, last_seq=core.last_seq
            )
        )
        self.detached = core.lease.detached

    @invariant()
    def the_window_holds_outside_speech(self):
        if not self.speaking:
            assert self.core.buffered_input_bytes <= WINDOW

    @invariant()
    def the_idle_timer_runs_only_while_the_user_is_quietly_there(self):
        core = self.core
        if core.idle_deadline is None:
            return
        assert not self.speaking
        assert core.in_flight_requests == frozenset() and core.response_id is None
        assert not core.lease.detached and not core.closed
        assert core.idle_deadline > 0.0


TestServerVadSession = ServerVadSession.TestCase
TestServerVadSession.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestServerVadSession.pytestmark = [pytest.mark.slow]


def test_the_machine_reaches_the_prompt():
    """The rules can reach a prompt: one fixed walk through them. (Counted over the drawn runs
    while writing this: 16 prompts in 150 runs of 50 steps.)"""
    machine = ServerVadSession()
    machine.create_response()
    machine.engine_streams(audio_ms=500, text=True)
    machine.engine_finishes()
    machine.time_passes(1.0)
    machine.time_passes(1.0)
    machine.idle_timer_fires()
    assert machine.prompts == 1
