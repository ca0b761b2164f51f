"""A resume's exact retry is answered from the cache only while its answer may have been lost.

Until 2026-12-02 a resume frame with a control_id stayed a credential for the session's whole
life: replayed by whoever had captured it while the session was detached, it attached them,
replayed the journal (the client's later items and, after a later resume, its current token)
and let them write into the session (found by a hostile probe over a socket;
tests/server/test_resume.py has the probe's own form)."""

from __future__ import annotations

import attrs
import pytest

from duplex_actors.core import commands as cmd
from duplex_actors.core.clock import ManualClock
from duplex_actors.core.lease import REPLAY_WINDOW_S
from duplex_actors.core.session import SessionConfig, SessionCore
from duplex_actors.errors import ResumeConflict

from .helpers import OWNER
from .helpers import resume as current


def resumed_once(*, then: cmd.Command | None = None) -> tuple[SessionCore, ManualClock, cmd.Resume]:
    """A session that dropped and resumed with a control_id (the client sending ``then`` on
    the resumed connection), after which the link dropped again."""
    clock = ManualClock(100.0)
    core = SessionCore("sess_retry", SessionConfig(), clock, owner=OWNER)
    core.handle(cmd.Heartbeat())
    core.take_events()
    core.handle(cmd.Detach())
    first = current(core, control_id="resume_1")
    core.handle(first)
    core.take_events()
    if then is not None:
        core.handle(then)
        core.take_events()
    core.handle(cmd.Detach())
    return core, clock, first


def test_the_exact_retry_gets_the_same_answer_while_nothing_shows_the_client_has_it():
    core, clock, first = resumed_once()
    lease = (core.lease.generation, core.lease.token)
    clock.advance(REPLAY_WINDOW_S / 2)
    core.handle(first)  # the same frame: its answer was lost with the link
    assert (core.lease.generation, core.lease.token) == lease
    assert not core.lease.detached
    core.handle(cmd.Detach())
    core.handle(attrs.evolve(first, last_seq=first.last_seq + 1))  # it had read one more


@pytest.mark.parametrize("since", ["a client command", "a resume without control_id", "the window"])
def test_the_old_frame_is_refused_once_the_answer_has_arrived_or_is_too_old(since):
    core, clock, first = resumed_once(then=cmd.Heartbeat() if since == "a client command" else None)
    if since == "a resume without control_id":
        core.handle(current(core))
        core.handle(cmd.Detach())
    elif since == "the window":
        clock.advance(REPLAY_WINDOW_S + 0.1)
    before = (core.lease.generation, core.lease.token)
    with pytest.raises(ResumeConflict):
        core.handle(first)
    assert (core.lease.generation, core.lease.token) == before
    assert core.lease.detached


def test_a_retry_may_not_ask_for_more_of_the_journal_than_the_original():
    core, _clock, first = resumed_once()
    with pytest.raises(ResumeConflict):
        core.handle(attrs.evolve(first, last_seq=first.last_seq - 1))
    assert core.lease.detached


def test_the_servers_detach_does_not_count_as_the_client_having_the_answer():
    core, _clock, first = resumed_once()  # a Detach came after the resume
    core.handle(first)
