"""What an application holds for one session: a cheap handle over its actor.

Reads (state, epoch, the lease's token, the config, what the outbox holds) look at the actor's
sans-IO core; calls become mailbox commands, told (fire and forget, errors come back as
``error`` events) or asked (the typed refusal is raised at the call). Many handles may share one
session; a handle holds nothing of its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from ..core import commands as cmd
from ..core.events import ServerEvent
from ..core.session import SessionCore
from ..core.session_config import SessionConfig
from ..errors import DuplexError, RuntimeClosed
from .deadline import fail_after
from .mailbox import MailboxStatistics
from .session_actor import SessionActor
from .transcription_queue import InputSpeculator

_append_of = cmd.AppendAudio.of


class SessionHandle:
    """What an application holds for one session. Cheap; many handles may share a session."""

    __slots__ = ("_actor",)

    def __init__(self, actor: SessionActor) -> None:
        self._actor = actor

    @property
    def id(self) -> str:
        return self._actor.session_id

    @property
    def state(self) -> str:
        return self._actor.core.state

    @property
    def epoch(self) -> int:
        return self._actor.core.epoch

    @property
    def turn_id(self) -> int:
        return self._actor.core.turn_id

    @property
    def core(self) -> SessionCore:
        """The sans-IO core, for inspection (tests, metrics). Do not drive it directly."""
        return self._actor.core

    @property
    def resume_token(self) -> str:
        return self._actor.core.lease.token

    @property
    def generation(self) -> int:
        return self._actor.core.lease.generation

    # A read-only view for the server, so that it never reaches into the core.
    @property
    def config(self) -> SessionConfig:
        """The session's settings now (frozen: an update replaces the whole value)."""
        return self._actor.core.config

    @property
    def tenant(self) -> str:
        """Whom the session's work is billed to at shared resources: its client (key, else
        address), or the session itself when no client was named."""
        return self._actor.core.share_tenant

    @property
    def detached(self) -> bool:
        """Whether no transport is attached: the session waits out its disconnect grace."""
        return self._actor.core.lease.detached

    @property
    def response_id(self) -> str | None:
        """The response in flight, if any."""
        return self._actor.core.response_id

    @property
    def journaled(self) -> tuple[int, int]:
        """Events the session's journal holds for a resume, and its bytes (an estimate)."""
        core = self._actor.core
        return core.journaled_events, core.journaled_bytes

    @property
    def events_produced(self) -> int:
        """How many events the session has produced so far, numbered or still waiting to be
        (a detached session's events wait unnumbered until a writer takes them)."""
        core = self._actor.core
        return core.last_seq + core.pending_events

    @property
    def unsent_audio_bytes(self) -> int:
        """Response audio produced for this session and not yet taken by its reader: in its
        outbox, and on its way there from the engine. The engine waits while this reaches the
        config's ``unsent_audio_bytes``."""
        return self._actor.unsent_audio()

    def mailbox_statistics(self) -> MailboxStatistics:
        return self._actor.mailbox.statistics()

    def input_speculator(self) -> InputSpeculator | None:
        """What the session's server VAD tells its audio to, so the runtime can start the
        turn's transcription before the commit (None: its recogniser does not speculate)."""
        make = getattr(self._actor.runtime, "input_speculator", None)
        return make(self.id) if make is not None else None

    def mailbox_depth(self) -> int:
        return self._actor.mailbox.depth()

    # fire-and-forget: errors arrive as ``error`` events
    def tell(self, command: cmd.Command) -> None:
        self._actor.tell(command)

    def check(self, command: cmd.Command) -> None:
        """Raise the refusal the session's chart would answer ``command`` with now; changes
        nothing (see SessionCore.check). ``ask`` the command afterwards to apply it."""
        self._actor.core.check(command)

    # request/reply: errors are raised here
    async def ask(self, command: cmd.Command, timeout: float | None = 5.0) -> None:
        await self._actor.ask(command, timeout)

    async def barrier(self) -> None:
        """Wait until the session has processed everything queued for it before this call."""
        await self._actor.barrier()

    def report_error(self, error: DuplexError) -> None:
        """Queue an ``error`` event for this session's client (e.g. a frame that failed to
        parse), so it arrives numbered and in order with the session's other events."""
        self._actor.report_error(error)

    def append_audio(self, pcm: bytes, *, sample_rate: int = 16000, event_id: str | None = None) -> None:
        self._actor.tell_audio(_append_of(pcm, sample_rate, event_id=event_id))

    async def commit(self, **kw: Any) -> None:
        await self.ask(cmd.CommitInput(**kw))

    async def clear(self, **kw: Any) -> None:
        await self.ask(cmd.ClearInput(**kw))

    async def create_response(self, instructions: str | None = None, **kw: Any) -> None:
        await self.ask(cmd.CreateResponse(instructions=instructions, **kw))

    async def barge_in(self, reason: str = "turn_detected", **kw: Any) -> None:
        await self.ask(cmd.BargeIn(reason=reason, **kw))

    async def cancel(self, **kw: Any) -> None:
        await self.ask(cmd.CancelResponse(**kw))

    async def heartbeat(self, **kw: Any) -> None:
        await self.ask(cmd.Heartbeat(**kw))

    async def update(self, **changes: Any) -> None:
        await self.ask(cmd.UpdateSession(**changes))

    async def acknowledge_playback(self, response_id: str, played_ms: int) -> None:
        await self.ask(cmd.PlaybackAck(response_id=response_id, played_ms=played_ms))

    async def detach(self) -> None:
        await self.ask(cmd.Detach())

    async def close(self, reason: str = "client_closed") -> None:
        await self.ask(cmd.Close(reason=reason))

    def events(self) -> AsyncIterator[ServerEvent]:
        return self._actor.events()

    def ready_events(self) -> Iterator[ServerEvent]:
        """The events ready now, without waiting (see :meth:`SessionActor.ready_events`)."""
        return self._actor.ready_events()

    async def wait_events(self) -> bool:
        """Wait until an event is ready; False once none will come (closed and drained)."""
        return await self._actor.wait_events()

    async def next_event(self, timeout: float = 5.0) -> ServerEvent:
        """The next event (for tests and simple clients)."""
        async with fail_after(timeout):
            async for event in self._actor.events():
                return event
        raise RuntimeClosed("the session has no more events")


__all__ = ["SessionHandle"]
