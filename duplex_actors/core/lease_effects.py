"""The session's lease: the session core's guards and effects for liveness, detach and resume.

The chart decides whether a resume is accepted, with these guards over the
:class:`~.lease.Lease` (the API key, the credentials or a replay of the last resume, the
journal still holding what the client missed); :meth:`.Lease.resume` then performs the
compare-and-swap, and the journal's replay goes out ahead of anything new.
"""

from __future__ import annotations

from typing import cast

from . import events as ev
from .commands import (
    Resume,
)
from .session_parts import SessionParts
from .step import Step


class LeaseEffects(SessionParts):
    """Guards and effects over the lease: heartbeat, detach, resume, expiry (a part of
    :class:`~.session.SessionCore`)."""

    __slots__ = ()

    def _resume_command(self, step: Step) -> Resume | None:
        command = step.command
        return command if isinstance(command, Resume) else None

    def _g_resume_key_matches(self, step: Step) -> bool:
        c = self._resume_command(step)
        return c is not None and self.lease.owned_by(c.key_digest)

    def _g_replays_last_resume(self, step: Step) -> bool:
        c = self._resume_command(step)
        return c is not None and self.lease.replays(
            c.control_id, c.generation, c.resume_token, c.last_seq, step.now
        )

    def _g_resume_generation_current(self, step: Step) -> bool:
        c = self._resume_command(step)
        return c is not None and c.generation == self.lease.generation

    def _g_resume_token_matches(self, step: Step) -> bool:
        c = self._resume_command(step)
        return c is not None and self.lease.token_matches(c.resume_token)

    def _g_journal_holds_last_seq(self, step: Step) -> bool:
        c = self._resume_command(step)
        return c is not None and self._journal.holds_after(c.last_seq, step.now)

    def _g_lease_expired(self, step: Step) -> bool:
        return self.lease.expiry(step.now) is not None

    def _fx_touch_lease(self, step: Step) -> None:
        self._emit(ev.HeartbeatAck)

    def _fx_detach_lease(self, step: Step) -> None:
        self.lease.detach(step.now)
        # A detached session prompts nobody: responses made for an absent user would cost the
        # engine and fill the journal for the whole disconnect grace.
        self._idle_deadline = None

    def _fx_resume_lease(self, step: Step) -> None:
        # The chart accepted it (credentials or a replay of them, and a journal that holds
        # what the client missed): the lease performs the compare-and-swap.
        cmd = cast(Resume, step.command)
        now = step.now
        replay = self._journal.since(cmd.last_seq, now)
        generation, token = self.lease.resume(
            now, cmd.generation, cmd.resume_token, cmd.control_id, cmd.last_seq
        )
        # Replaces a replay not yet taken: the journal still holds all of it after last_seq
        # (else the chart refused the resume), and what came before, the client says it has.
        # Prepended, two resumes before any read sent those events twice.
        self._replay = replay
        self._emit(ev.SessionResumed, generation=generation, resume_token=token, replayed=len(replay))
        if self._idle_deadline is None and self.counters.responses:
            self._fx_start_idle_timer(step)  # back after a response: the quiet counts from now
