"""The thin actor shell around one SessionCore.

Sessions do not own a task each: an idle session is just data (core + mailbox), and the
runtime's dispatcher runs a session's mailbox when it has messages, one message at a time and
never two for the same session at once. The core is synchronous, so a message is processed
start to finish without an await: nothing can interleave inside a transition (the trap that
makes transitions' AsyncMachine cancel running transitions does not exist here).
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import anyio
import structlog

from ..core.actions import AbortRequests, InputTranscript, SubmitTurn, TranscribeInput
from ..core.commands import AppendAudio, CancelResponse, Command, CommitInput, CreateResponse, Lane
from ..core.engine_io import AudioPacket, EngineOutput
from ..core.events import ServerEvent, SessionClosedEvent
from ..core.session import SessionCore
from ..core.statechart import CLOSED
from ..errors import AskTimeout, DuplexError, SessionClosed
from .deadline import fail_after
from .loop_event import OneShotEvent
from .mailbox import Mailbox
from .timers import Timer, TimerQueue


def _starts_a_response(message: object) -> bool:
    command = message[0] if isinstance(message, tuple) else message
    return isinstance(command, (CreateResponse, CommitInput))


if TYPE_CHECKING:
    from ..core.audio_budget import AudioAccount
    from .engine_actor import EngineActor

log = structlog.get_logger("duplex_actors.actor")

_CONTROL, _ENGINE, _DATA = Lane.CONTROL, Lane.ENGINE, Lane.DATA

#: Reported (out-of-core) errors a session queues at most; more are counted and dropped.
MAX_QUEUED_ERRORS = 64


class SessionHost(Protocol):
    """What a session actor needs of whatever runs it (the Runtime), named here so that this
    module does not import the runtime that imports it."""

    engine: EngineActor
    timers: TimerQueue
    new_event: Callable[[], OneShotEvent]
    #: True while the dispatcher runs a round (sessions' messages being processed)
    dispatching: bool

    def _schedule(self, actor: SessionActor) -> None: ...

    def _session_closed(self, actor: SessionActor) -> None: ...

    def transcribe(
        self,
        action: TranscribeInput,
        deliver: Callable[[InputTranscript], None],
        session_id: str,
        tenant: str | None = None,
        account: AudioAccount | None = None,
    ) -> None: ...


class _Reply:
    __slots__ = ("done", "error")

    def __init__(self, done: OneShotEvent) -> None:
        self.done = done
        self.error: BaseException | None = None


class _Expire:
    """The reaper saw this session's lease run out; the chart decides when it is processed."""

    __slots__ = ()


class _Drain:
    """The server began to shut down; the chart stops starting responses when it is processed."""

    __slots__ = ()


class _IdleTimeout:
    """Server VAD's idle timer fired; the chart decides whether its deadline still stands."""

    __slots__ = ()


class _Barrier:
    """Processed after everything queued before it, on every lane: :meth:`SessionActor.barrier`."""

    __slots__ = ("reached",)

    def __init__(self) -> None:
        self.reached = anyio.Event()


class _ReportError:
    """An error found outside the core (e.g. by the wire codec), queued in order with data."""

    __slots__ = ("error",)

    def __init__(self, error: DuplexError) -> None:
        self.error = error


class SessionActor:
    __slots__ = (
        "core",
        "mailbox",
        "runtime",
        "scheduled",
        "_waiter",
        "_finished",
        "_expiring",
        "_unread",
        "_queued_errors",
        "dropped_errors",
        "_voiced_request",
        "_idle_timer",
        "_idle_at",
        "_audio_on_its_way",
        "_engine_waits",
        "__weakref__",
    )

    def __init__(self, core: SessionCore, runtime: SessionHost, mailbox_capacity: int) -> None:
        self.core = core
        self.runtime = runtime
        self.mailbox = Mailbox(mailbox_capacity)
        self.scheduled = False
        self._waiter: OneShotEvent | None = None
        self._finished = False  # closed and fully drained
        self._expiring = False  # an expiry is queued (the reaper queues it once)
        self._unread: deque[ServerEvent] | None = None  # taken from the core, not yet handed out
        self._queued_errors = 0  # reported errors waiting in the data lane
        self.dropped_errors = 0  # reported errors refused past MAX_QUEUED_ERRORS
        self._voiced_request: str | None = None  # the last request whose first audio went out
        # The timer set for the core's idle deadline, and the deadline it was set for. Only
        # sessions with server VAD's idle_timeout_ms ever have one.
        self._idle_timer: Timer | None = None
        self._idle_at: float | None = None
        # Audio the engine delivered that the core has not yet put in its outbox: counted with
        # the outbox's, since a stream that never yields to the loop delivers a whole answer
        # before the dispatcher runs once.
        self._audio_on_its_way = 0
        # Set while a request's stream waits for the listener (listener_caught_up).
        self._engine_waits: OneShotEvent | None = None

    @property
    def session_id(self) -> str:
        return self.core.session_id

    # -- inbound ----------------------------------------------------------------------------

    def tell(self, command: Command) -> None:
        """Queue a command; errors come back as ``error`` events. Raises MailboxFull/SessionClosed."""
        if type(command) is AppendAudio:
            self.tell_audio(command)  # processed at once when nothing is queued before it
            return
        self._check_open(command)
        self.mailbox.put(self._lane(command), (command, None, self.core.clock.now()))
        self.runtime._schedule(self)

    def tell_audio(self, command: AppendAudio) -> None:
        """:meth:`tell` for an append, the runtime's most frequent message: audio always goes
        on the data lane, so the lane choice (a cancel's, above) is skipped. Same contract:
        accepted (processed exactly once) or refused with MailboxFull/SessionClosed."""
        if self._finished:
            raise SessionClosed("closed", command.TRIGGER, event_id=command.event_id)
        if not self.scheduled and not self.runtime.dispatching:
            # Nothing of this session is queued (a queued message always has the session
            # scheduled) and the dispatcher is not inside a round, so processing the append
            # here, now, is what the dispatcher would do next for this session: same order,
            # same core call, same settling. It saves the mailbox, the ready queue and a
            # dispatcher wake-up per chunk, the runtime's most frequent path.
            self.mailbox.accepted += 1  # accepted, and never waited: the high water stays
            # What the dispatcher does for a told command (_handle_command, then _settle),
            # inline for the most frequent message.
            core = self.core
            try:
                try:
                    core.handle(command, received_at=core.clock.now())
                except DuplexError as err:
                    core.emit_error(err)
            except Exception as exc:  # a bug in one session fails that session only
                self._failed(exc)
            self._settle()
            return
        self.mailbox.put(_DATA, (command, None, self.core.clock.now()))
        if not self.scheduled:  # Runtime._schedule's own test, saving the call per append
            self.runtime._schedule(self)

    async def ask(self, command: Command, timeout: float | None = 5.0) -> None:
        """Queue a command and wait until it was processed; its error is raised here."""
        self._check_open(command)
        reply = _Reply(self.runtime.new_event())
        self.mailbox.put(self._lane(command), (command, reply, self.core.clock.now()))
        self.runtime._schedule(self)
        try:
            async with fail_after(timeout):
                await reply.done.wait()
        except TimeoutError:
            # The command stays accepted and will still be processed exactly once.
            raise AskTimeout(f"{command.TRIGGER!r} not processed within {timeout}s") from None
        if reply.error is not None:
            raise reply.error

    async def barrier(self) -> None:
        """Return once everything queued before this call has been processed (or the session
        has finished). Data is the last lane drained, so a barrier queued at its end comes after
        every message already queued on any lane. Never refused: it is the server's, not the
        client's, and one is queued at a time per resume."""
        if self._finished:
            return
        barrier = _Barrier()
        self.mailbox.put(Lane.DATA, barrier, force=True)
        self.runtime._schedule(self)
        await barrier.reached.wait()

    def _lane(self, command: Command) -> Lane:
        # A cancel must not overtake the response.create it cancels: while one is still queued
        # on the data lane, the cancel queues behind it (OpenAI: cancel right after create
        # gets that response's created + cancelled done). Otherwise it jumps the audio.
        if isinstance(command, CancelResponse) and self.mailbox.holds(Lane.DATA, _starts_a_response):
            return Lane.DATA
        return command.LANE

    def _check_open(self, command: Command) -> None:
        if self._finished and command.TRIGGER != "close":
            raise SessionClosed("closed", command.TRIGGER, event_id=command.event_id)

    def deliver(self, output: EngineOutput) -> None:
        """Engine output for one of this session's requests (engine lane, never refused)."""
        if type(output) is AudioPacket:
            self._audio_on_its_way += len(output.pcm)
        self.mailbox.put(_ENGINE, output)
        if not self.scheduled:
            self.runtime._schedule(self)

    def deliver_transcript(self, result: InputTranscript) -> None:
        """A committed turn's transcript (engine lane: it is work the session asked for)."""
        self.mailbox.put(Lane.ENGINE, result, force=True)
        self.runtime._schedule(self)

    def report_error(self, error: DuplexError) -> None:
        """Put an ``error`` event into this session's stream, after what is already queued."""
        if self._finished:
            return
        if self._queued_errors >= MAX_QUEUED_ERRORS:
            # A client producing errors faster than its session processes them gets them
            # counted, not queued: forced puts must not make the mailbox unbounded.
            self.dropped_errors += 1
            return
        self._queued_errors += 1
        # In the data lane so it follows the frames before it; forced past the lane's capacity
        # (bounded by MAX_QUEUED_ERRORS instead) since a full lane is itself what it reports.
        self.mailbox.put(Lane.DATA, _ReportError(error), force=True)
        self.runtime._schedule(self)

    def expire(self) -> bool:
        """Queue an expiry once; returns whether this call queued it. Never refused."""
        if self._expiring:
            return False
        self._expiring = True
        self.mailbox.put(Lane.CONTROL, _Expire(), force=True)
        self.runtime._schedule(self)
        return True

    def drain(self) -> None:
        """Queue the drain trigger (never refused): it follows what the client already sent,
        in the control lane, so a response.create accepted before it is still answered."""
        if self._finished:
            return
        self.mailbox.put(Lane.CONTROL, _Drain(), force=True)
        self.runtime._schedule(self)

    # -- processing (called by the dispatcher) ----------------------------------------------

    def process(self, budget: int) -> bool:
        """Process up to ``budget`` messages; returns whether more are waiting."""
        core = self.core
        # The mailbox's lanes read in place, in its priority order (Mailbox.pop, unrolled): a
        # message costs no (lane, message) pair, and a session usually has one or two waiting.
        lanes = self.mailbox._lanes
        handle = core.handle
        for _ in range(budget):
            q = lanes[0]
            if q:
                lane = _CONTROL
            else:
                q = lanes[1]
                if q:
                    lane = _ENGINE
                else:
                    q = lanes[2]
                    if not q:
                        break
                    lane = _DATA
            message = q.popleft()
            try:
                # Client commands are (command, reply, received_at) tuples and nothing else is:
                # test for them first, they are nearly all the traffic (audio appends).
                if type(message) is tuple:
                    command, reply, received_at = message
                    if reply is None:
                        # _handle_command for a told command, inline (the common case).
                        try:
                            handle(command, received_at=received_at)
                        except DuplexError as err:
                            core.emit_error(err)
                        else:
                            if command.TRIGGER == "resume":
                                self._unread = None
                    else:
                        self._handle_command(command, reply, received_at)
                elif lane == _ENGINE:
                    # Engine outputs and transcripts only (deliver, deliver_transcript): tested
                    # before the data lane's own kinds, an output is the next most frequent.
                    if isinstance(message, InputTranscript):
                        core.on_transcript(message)
                        continue  # (nothing follows the try in this loop)
                    core.on_engine_output(message)
                    if type(message) is AudioPacket:
                        self._audio_on_its_way -= len(message.pcm)  # now in the outbox, or dropped
                        if message.request_id != self._voiced_request and self._waiter is not None:
                            # A response's first audio is what its listener waits for: the rest
                            # of the batch (a phrase's later packets, or the response's end)
                            # waits one dispatcher round, so the waiting writer sends it first.
                            self._voiced_request = message.request_id
                            break
                elif isinstance(message, _ReportError):
                    self._queued_errors -= 1
                    core.emit_error(message.error)
                elif isinstance(message, _Barrier):
                    message.reached.set()
                elif isinstance(message, _Expire):
                    self._expiring = False
                    core.expire()  # the chart asks the lease again (lease_expired)
                elif isinstance(message, _Drain):
                    core.drain()
                elif isinstance(message, _IdleTimeout):
                    core.idle_timeout()  # the chart asks the deadline again
                else:
                    self._handle_command(*message)
            except Exception as exc:  # a bug in one session fails that session only
                self._failed(exc)
        self._settle()
        return bool(lanes[0] or lanes[1] or lanes[2])

    def _failed(self, exc: Exception) -> None:
        log.error("session_failed", session_id=self.session_id, error=repr(exc))
        self.core.emit_error(_internal_error(exc))
        self.core.fail("session_failed")

    def _settle(self) -> None:
        """What follows processing: the core's actions, its idle deadline, its end, and the
        waiting reader's wake-up."""
        core = self.core
        # The core's fields read directly, not through its properties: this runs once per
        # dispatch of every session, mostly after a single append that changed none of them.
        if core._actions:
            self._flush_actions()
        if core._idle_deadline != self._idle_at:
            self._set_idle_timer(core._idle_deadline)
        if core._state == CLOSED and not self._finished:
            self._finish()
        if self._waiter is not None and core.has_events():
            self._waiter.set()
        if self._engine_waits is not None:  # a barge-in may have dropped the unsent audio
            self._wake_engine()

    def _set_idle_timer(self, deadline: float | None) -> None:
        """Follow the core's idle deadline: one timer per session at most, moved when it moves."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._idle_at = deadline
        if deadline is not None and not self.core.closed:
            # A millisecond late rather than a hair early: the loop's clock may run a timer
            # just before the core's clock reaches the deadline, and the chart would then
            # (rightly) change nothing. One timer per deadline: it is never set again.
            delay = max(deadline - self.core.clock.now(), 0.0) + 0.001
            self._idle_timer = self.runtime.timers.call_later(delay, self._idle_timer_fired)

    def _idle_timer_fired(self) -> None:
        self._idle_timer = None
        if self._finished:
            return
        self.mailbox.put(Lane.CONTROL, _IdleTimeout(), force=True)
        self.runtime._schedule(self)

    def _handle_command(self, command: Command, reply: _Reply | None, received_at: float) -> None:
        try:
            self.core.handle(command, received_at=received_at)
            if command.TRIGGER == "resume":
                # Taken but never handed out: the resume's replay re-sends them, in order.
                self._unread = None
        except DuplexError as err:
            if reply is not None:
                reply.error = err
            else:
                self.core.emit_error(err)
        finally:
            if reply is not None:
                reply.done.set()

    def _flush_actions(self) -> None:
        actions = self.core.take_actions()
        if not actions:  # nearly every message (an append) makes none
            return
        engine = self.runtime.engine
        for action in actions:
            if isinstance(action, SubmitTurn):
                engine.submit(action.request, self.deliver, self)
            elif isinstance(action, AbortRequests):
                engine.abort(action.request_ids)
            elif isinstance(action, TranscribeInput):
                core = self.core
                self.runtime.transcribe(
                    action, self.deliver_transcript, self.session_id, core.tenant, core.audio_account
                )

    def _finish(self) -> None:
        """The session closed: refuse what is still queued, exactly once each."""
        self._finished = True
        self._audio_on_its_way = 0  # the engine's outputs still queued are consumed as stale
        if self._idle_timer is not None:
            # Its callback is this actor: left set, it kept the closed session (its journal,
            # its conversation) alive until the timeout it was set for.
            self._idle_timer.cancel()
            self._idle_timer = None
        for lane, message in self.mailbox.drain():
            if isinstance(message, _ReportError):
                continue  # the session is closed: nobody is left to tell
            if isinstance(message, _Barrier):
                message.reached.set()
                continue
            if isinstance(message, InputTranscript):
                self.core.on_transcript(message)  # the chart consumes it: closed
            elif lane == Lane.ENGINE:
                self.core.on_engine_output(message)  # consumed and counted as stale
            elif isinstance(message, tuple):
                command, reply, _ = message
                if reply is not None:
                    if command.TRIGGER != "close":
                        reply.error = SessionClosed("closed", command.TRIGGER, event_id=command.event_id)
                    reply.done.set()
        self.runtime._session_closed(self)

    # -- outbound ---------------------------------------------------------------------------

    async def events(self) -> AsyncIterator[ServerEvent]:
        """Every event of this session, in order, ending with ``session.closed``."""
        while await self.wait_events():
            # ready_events, inline (one generator per event less; the same reads, in order),
            # one batch a pass: once a batch is handed out, wait_events asks the core whether
            # there is more (has_events), where a take after nearly every batch found nothing.
            while True:
                unread = self._unread
                if unread:
                    event = unread.popleft()
                    if not unread:
                        self._unread = None  # an idle session keeps no empty deque
                else:
                    batch = self.core.take_events()
                    if self._engine_waits is not None:
                        self._wake_engine()
                    if not batch:
                        break
                    if len(batch) == 1:
                        event = batch[0]  # nothing left over to keep (an output's one delta)
                    else:
                        unread = self._unread = deque(batch)
                        event = unread.popleft()
                yield event
                # TERMINAL first (a class attribute): only the few terminal events are tested.
                if event.TERMINAL and isinstance(event, SessionClosedEvent):
                    return
                if not self._unread:  # read afresh: a resume meanwhile may have discarded it
                    break

    def ready_events(self) -> Iterator[ServerEvent]:
        """The events ready now, in order, one at a time, without waiting.

        For a reader that handles a burst of events as one unit (the server's writer sends a
        wake-up's events under one write deadline); :meth:`events` is built on it."""
        # One event at a time from a buffer the actor owns: a reader that stops between two
        # events of a batch (break, cancel) leaves the rest to the next reader instead of
        # taking them (seq-stamped, journaled) down with it. ``_unread`` is read afresh for
        # every event: a resume processed while the reader was suspended discards it.
        while True:
            if not self._unread:
                batch = self.core.take_events()
                if self._engine_waits is not None:
                    self._wake_engine()
                if not batch:
                    return
                self._unread = deque(batch)
            event = self._unread.popleft()
            if not self._unread:
                self._unread = None  # an idle session keeps no empty deque
            yield event

    # -- output flow control (the engine actor asks: engine_actor.Listener) -----------------

    def listener_behind(self) -> bool:
        """Whether this session holds as much unsent output as it may: ``unsent_audio_bytes`` of
        audio, or half its outbox's capacity in events (at the capacity it would close as a slow
        consumer). The engine then waits for :meth:`listener_caught_up` before producing more."""
        core = self.core
        config = core.config
        # The counts read directly, not through unsent_audio and _unsent_events: this is asked
        # between every two outputs of every response.
        outbox = core._outbox
        lane = self.mailbox._lanes[_ENGINE]
        limit = config.unsent_audio_bytes
        if len(outbox._q) + len(outbox._held) + (len(lane) if lane else 0) < config.outbox_capacity >> 1 and (
            limit is None or self._audio_on_its_way + outbox.audio_bytes < limit
        ):
            return False
        # Not while the runtime drains: the server takes no resume then, so a client that is
        # away would be waited for until the drain's deadline, holding the shutdown up; its
        # response runs to its end as before, and the drain ends with it.
        return not self._finished and not core.draining

    async def listener_caught_up(self) -> None:
        """Return once half the audio allowance and three quarters of the outbox are free again
        (the client took what it was sent, or a barge-in dropped it) or the session has
        finished. A client that is away for a resume is waited for until it resumes or its
        grace runs out (the close aborts the request)."""
        while not self._caught_up():
            waits = self._engine_waits
            if waits is None:
                waits = self._engine_waits = self.runtime.new_event()
            await waits.wait()

    def _caught_up(self) -> bool:
        core = self.core
        if self._finished or core.draining:
            return True
        config = core.config
        limit = config.unsent_audio_bytes
        if limit is not None and self.unsent_audio() > limit // 2:
            return False
        return self._unsent_events() <= config.outbox_capacity // 4

    def unsent_audio(self) -> int:
        """Audio in the outbox and on its way there (SessionHandle.unsent_audio_bytes)."""
        return self._audio_on_its_way + self.core.outbox_audio_bytes

    def _unsent_events(self) -> int:
        # The outbox's events, queued and held, and the engine's outputs on their way to it.
        return self.core.outbox_depth + self.mailbox.lane_depth(_ENGINE)

    def _wake_engine(self) -> None:
        """Wake the waiting streams if they may go on (the wait asks again)."""
        waits = self._engine_waits
        if waits is not None and self._caught_up():
            self._engine_waits = None
            waits.set()

    async def wait_events(self) -> bool:
        """Wait until an event is ready; False once none will come (closed and drained)."""
        while not (self._unread or self.core.has_events()):
            if self._finished:
                return False
            self._waiter = self.runtime.new_event()
            try:
                await self._waiter.wait()
            finally:
                self._waiter = None
        return True


def _internal_error(exc: BaseException) -> DuplexError:
    err = DuplexError(f"internal error: {type(exc).__name__}")
    err.code = "internal_error"
    return err
