"""The public entry point: ``async with Runtime(engine) as rt: session = await rt.open_session()``.

The runtime owns three things: the session actors (and the dispatcher that runs their
mailboxes), the one engine actor, and the lease reaper. Runs on asyncio or trio through
anyio (tests/runtime runs its end-to-end tests on both). What an application holds for each
session is a :class:`~.session_handle.SessionHandle`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import attrs
import structlog

from ..audio.turn_pieces import MAX_PIECE_S
from ..core import commands as cmd
from ..core.actions import InputTranscript, TranscribeInput
from ..core.audio_budget import AudioAccount, AudioBudget
from ..core.clock import MONOTONIC, Clock
from ..core.engine_io import SamplingOverrides
from ..core.fence import new_session_id
from ..core.journal import JournalBudget
from ..core.session import SessionCore
from ..core.session_config import SessionConfig
from ..core.text_budget import TextBudget
from ..engines.base import EngineBackend
from ..errors import NO_SUCH_SESSION, ResourceExhausted, RuntimeClosed, ServerDraining, UnknownSession
from ..logconfig import ensure_configured
from . import gc_policy as _gc
from .async_library import name_async_library, unname_async_library
from .engine_actor import EngineActor, EngineStatistics
from .loop_event import OneShotEvent, event_class
from .session_actor import SessionActor
from .session_handle import SessionHandle
from .timers import TimerQueue
from .transcription_queue import InputSpeculator, Speculation, TranscriptionJob, TranscriptionQueue

if TYPE_CHECKING:  # the recogniser is an optional extra
    from ..audio.transcription import Transcriber

log = structlog.get_logger("duplex_actors.runtime")


#: What all sessions' replay journals may hold together by default (their counted bytes). A
#: busy session journals up to ~3 MB a minute of output audio, so a thousand of them fit with
#: ~1 MB each (~20 s of replay) and a hundred are not touched; a client opening sessions only
#: to fill their journals gets this much, not 8 MiB a session.
JOURNAL_BUDGET_BYTES = 1 << 30
#: What all sessions' buffered and committed input audio may hold together (core/audio_budget.py):
#: a session holds up to about 7.7 MB of it, so a client holding many sessions, or many clients,
#: could hold far more than a machine has. Within it, 1,000 sessions may each hold 33 s at 16 kHz
#: before the ones holding the most are refused.
AUDIO_BUDGET_BYTES = 1 << 30
#: What all sessions' conversation text and settings (instructions, tools) may hold together
#: (core/text_budget.py): a session holds up to about 2 MB of it, and permessage-deflate lets a
#: client send each item in a few hundred bytes. Within it, 1,000 sessions may each hold 1 MB.
TEXT_BUDGET_BYTES = 1 << 30
#: Sessions the reaper looks at before it lets the loop run again (a slice never stalls it).
REAP_SLICE = 500


def _check_limits(
    max_sessions: int,
    mailbox_capacity: int,
    dispatch_budget: int,
    reaper_interval_s: float,
    stall_timeout_s: float | None,
) -> None:
    """Refuse, naming it, a limit no runtime could run with. Each of these was taken and then
    failed far from where it was given: a ``dispatch_budget`` of 0 dispatched nothing (every
    ask timed out), a negative ``reaper_interval_s`` ended the runtime's task group, a negative
    ``stall_timeout_s`` found every stream stalled, a ``mailbox_capacity`` of 0 failed each
    session's opening, and a ``max_sessions`` of 0 refused every session as retryable. Both
    intervals may be 0 (or None), which turns them off."""
    for name, value in (
        ("max_sessions", max_sessions),
        ("mailbox_capacity", mailbox_capacity),
        ("dispatch_budget", dispatch_budget),
    ):
        if not value >= 1:
            raise ValueError(f"{name} must be at least 1, not {value!r}")
    for name, seconds in (("reaper_interval_s", reaper_interval_s), ("stall_timeout_s", stall_timeout_s)):
        if seconds is not None and not seconds >= 0:  # NaN is refused too
            raise ValueError(f"{name} must be a number of seconds, 0 or more (0: off), not {seconds!r}")


@attrs.frozen(slots=True)
class RuntimeStatistics:
    """A snapshot of a runtime (``Runtime.statistics()``): sessions by state, opened and closed so far,
    sessions queued for the dispatcher, and the engine actor's own statistics.
    """

    sessions: int
    sessions_by_state: dict[str, int]
    opened: int
    closed: int
    ready: int
    engine: EngineStatistics
    #: closed sessions still holding an admission slot until engine cleanup succeeds
    draining: int = 0


class Runtime:
    """The actor runtime: every session's actor, the one shared engine actor that batches their model
    turns, the lease reaper and the session timers, in one anyio task group (``async with
    Runtime(engine) as runtime``).

    ``open_session()`` returns a :class:`SessionHandle`; :meth:`drain` begins a graceful shutdown.
    Works on asyncio and trio.
    """

    def __init__(
        self,
        engine: EngineBackend | None = None,
        *,
        config: SessionConfig | None = None,
        clock: Clock = MONOTONIC,
        max_sessions: int = 100_000,
        mailbox_capacity: int = 256,
        dispatch_budget: int = 64,
        # Expiry is late by at most this (plus a dispatch): 0.5 s keeps it under a second.
        reaper_interval_s: float = 0.5,
        stall_timeout_s: float | None = None,
        gc_policy: _gc.GcPolicy | None = None,
        transcriber: Transcriber | None = None,
        transcription_backlog_s: float = 30.0,
        transcription_piece_s: float = MAX_PIECE_S,
        journal_budget_bytes: int | None = JOURNAL_BUDGET_BYTES,
        audio_budget_bytes: int | None = AUDIO_BUDGET_BYTES,
        text_budget_bytes: int | None = TEXT_BUDGET_BYTES,
        session_ids: Callable[[], str] = new_session_id,
    ) -> None:
        """``gc_policy``: keep the cyclic collector's pauses off the hot path (see
        actors/gc_policy.py). Process-wide, so it is opt-in: ``serve`` and the benches turn it on.

        ``transcription_backlog_s``: seconds of one session's audio that may wait for the
        ``transcriber`` (actors/transcription_queue.py); turns are decoded in pieces of at
        most ``transcription_piece_s`` of audio, cut at a pause, sessions taking turns piece
        by piece, as many at once as the transcriber's ``max_concurrent`` (1 if it has none).

        ``journal_budget_bytes``: what all sessions' replay journals may hold together (the
        bytes they count); past it the sessions journaling the most give up the oldest part of
        their replay first (core/journal.py, JournalBudget). None: each journal's own bound
        only, which a client opening many sessions multiplies.

        ``audio_budget_bytes``: what all sessions' buffered and committed input audio may hold
        together; past it a client holding more than its share (split by tenant) has its
        appends refused as backpressure (core/audio_budget.py). None: each session's own
        bounds only, which a client opening many sessions multiplies.

        ``text_budget_bytes``: what all sessions' conversation text and settings' text may
        hold together; past it a client holding more than its share has its created items,
        function outputs and text-adding ``session.update``s refused as ``resource_exhausted``
        (core/text_budget.py). None: each session's own bounds only."""
        if engine is None:
            from ..engines.scripted import ScriptedEngine

            engine = ScriptedEngine()
        ensure_configured()
        _check_limits(max_sessions, mailbox_capacity, dispatch_budget, reaper_interval_s, stall_timeout_s)
        self.config = config or SessionConfig()
        self.clock = clock
        self.max_sessions = max_sessions
        self.mailbox_capacity = mailbox_capacity
        self.dispatch_budget = dispatch_budget
        self.reaper_interval_s = reaper_interval_s
        self.gc_policy = gc_policy
        #: Makes each new session's id; ``serve --workers`` puts the owning worker in it.
        self.session_ids = session_ids
        self.engine = EngineActor(engine, clock=clock, stall_timeout_s=stall_timeout_s)
        #: Input transcription for sessions that ask for it (audio/transcription.py); None:
        #: such requests get a transcription ``failed`` event.
        self.transcriber = transcriber
        #: Turns waiting for it, served piece by piece to the session served least recently,
        #: each session's backlog bounded in seconds of audio (actors/transcription_queue.py).
        self._transcripts = TranscriptionQueue(transcription_backlog_s, max_piece_s=transcription_piece_s)
        self.journal_budget = None if journal_budget_bytes is None else JournalBudget(journal_budget_bytes)
        self.audio_budget = None if audio_budget_bytes is None else AudioBudget(audio_budget_bytes)
        self.text_budget = None if text_budget_bytes is None else TextBudget(text_budget_bytes)
        self._transcription_workers = max(1, getattr(transcriber, "max_concurrent", 1))
        self._transcribing = 0  # worker tasks started (lazily: most servers never transcribe)
        self._decoding = 0  # pieces being decoded now
        #: Each session's decode started at the quiet before its commit (InputSpeculator), and
        #: the one running, if any: at most one at a time, only while the recogniser is idle.
        self._speculations: dict[str, Speculation] = {}
        #: Each session's speculator, whose kept audio counts in the audio budget.
        self._speculators: dict[str, InputSpeculator] = {}
        self._speculating: Speculation | None = None
        self._transcript_ready: anyio.Event | None = None
        self._sessions: dict[str, SessionActor] = {}
        #: Loop time the dispatcher spent on each tenant's sessions since it was last taken,
        #: while metered (meter_tenant_work); None: not metered.
        self._tenant_work: dict[str, float] | None = None
        self._work_clock: Callable[[], float] | None = None
        #: closed sessions whose aborted engine requests are not cleaned up yet
        self._draining: dict[str, tuple[str, ...]] = {}
        #: told the id of each session as it closes (the server drops its record at once)
        self._close_listeners: list[Callable[[str], None]] = []
        self._ready: deque[SessionActor] = deque()
        #: Every session's timers (server VAD's idle timeout), on one task of any anyio backend.
        self.timers = TimerQueue()
        self._wake: OneShotEvent | None = None
        #: True while the dispatcher runs a round: a session's append is then queued, never
        #: processed by its caller (SessionActor.tell_audio), since a round may be inside it.
        self.dispatching = False
        #: Makes the running backend's one-shot event directly (set by __aenter__):
        #: anyio.Event() looks the backend up on every call, and a turn makes several
        #: (waiters, wake-ups); on asyncio it is the leaner LoopEvent (actors/loop_event.py).
        self.new_event: Callable[[], OneShotEvent] = anyio.Event
        self._tg: anyio.abc.TaskGroup | None = None
        self._library_token: contextvars.Token[str | None] | None = None
        self._running = False
        #: Set by drain(): no new session opens and no session starts a new response.
        self.draining = False
        self.opened = 0
        self.closed = 0

    @property
    def backend(self) -> EngineBackend:
        return self.engine.backend

    # -- lifecycle --------------------------------------------------------------------------

    async def __aenter__(self) -> Runtime:
        # Before anything is made under this context: its tasks and callbacks copy it
        # (actors/async_library.py says why plain callbacks need the library named).
        self._library_token = name_async_library()
        self.new_event = event_class()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            await self._tg.start(self.engine.run)
        except BaseException:
            self._tg.cancel_scope.cancel()
            try:
                await self._tg.__aexit__(None, None, None)
            finally:
                unname_async_library(self._library_token)
            raise
        self._tg.start_soon(self._dispatch)
        self._tg.start_soon(self.timers.run)
        if self.gc_policy is not None:
            _gc.start(self.gc_policy)
            self._tg.start_soon(_gc.maintain, self.gc_policy)
        if self.reaper_interval_s:
            self._tg.start_soon(self._reap)
        self._running = True
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._running = False
        try:
            with anyio.CancelScope(shield=True):
                self.close_all("runtime_shutdown")
                with anyio.move_on_after(5):
                    while self._ready:
                        await anyio.sleep(0.001)
        finally:
            tg = self._tg
            assert tg is not None  # set by __aenter__
            tg.cancel_scope.cancel()
            try:
                await tg.__aexit__(*exc)
            finally:
                if self.gc_policy is not None:
                    _gc.stop()
                unname_async_library(self._library_token)

    def drain(self) -> None:
        """Begin a graceful shutdown: every open session finishes the response it has in flight
        and starts no other (the chart's ``drain`` trigger: response.create is refused with
        ``ServerDraining``), and no new session opens. Idempotent."""
        self.draining = True
        for actor in list(self._sessions.values()):
            actor.drain()

    @property
    def responses_in_flight(self) -> int:
        """Open sessions with a model turn in flight, begun or not (what a drain waits for)."""
        return sum(1 for actor in self._sessions.values() if actor.core.state == "responding")

    def close_all(self, reason: str) -> int:
        """Queue a close of every open session (never refused); returns how many."""
        return sum(self._force_close(actor, reason) for actor in list(self._sessions.values()))

    def force_close(self, session_id: str, reason: str) -> bool:
        """Queue a close the session's mailbox cannot refuse (a policy of the runtime's owner,
        e.g. the server's flood policy, must hold even when the client filled its lanes)."""
        actor = self._sessions.get(session_id)
        return actor is not None and self._force_close(actor, reason)

    def _force_close(self, actor: SessionActor, reason: str) -> bool:
        if actor.core.closed:
            return False
        actor.mailbox.put(cmd.Lane.CONTROL, (cmd.Close(reason=reason), None, self.clock.now()), force=True)
        self._schedule(actor)
        return True

    # -- sessions ---------------------------------------------------------------------------

    async def open_session(
        self,
        config: SessionConfig | None = None,
        *,
        owner: bytes | None = None,
        tenant: str | None = None,
        **overrides: Any,
    ) -> SessionHandle:
        return self.open_session_nowait(config, owner=owner, tenant=tenant, **overrides)

    def open_session_nowait(
        self,
        config: SessionConfig | None = None,
        *,
        owner: bytes | None = None,
        tenant: str | None = None,
        **overrides: Any,
    ) -> SessionHandle:
        """Open a session. ``owner``: digest of the API key that opened it (a transport's
        business); every resume must then present it (the chart's ``resume_key_matches``).
        ``tenant``: whom its work counts against where sessions share the engine, the
        synthesiser and the recogniser (core/fair_share.py): sessions of one tenant share one
        tenant's part. None: the session is a tenant of its own."""
        if not self._running:
            raise RuntimeClosed("the runtime is not running (use 'async with Runtime(...)')")
        if self.draining:
            raise ServerDraining("the server is shutting down: it opens no new session")
        if len(self._sessions) + self._draining_count() >= self.max_sessions:
            raise ResourceExhausted(f"session limit {self.max_sessions} reached; retry later")
        config = config or self.config
        if overrides:
            if "sampling" in overrides and isinstance(overrides["sampling"], dict):
                overrides["sampling"] = SamplingOverrides(**overrides["sampling"])
            config = attrs.evolve(config, **overrides)
        session_id = self.session_ids()
        budget, text_budget = self.audio_budget, self.text_budget
        # A session with no tenant is a client of its own (its id cannot be a tenant's name:
        # the server's tenants are keyed digests and addresses).
        client = tenant if tenant is not None else session_id
        core = SessionCore(
            session_id,
            config,
            self.clock,
            owner=owner,
            tenant=tenant,
            journal_budget=self.journal_budget,
            audio_account=None if budget is None else budget.join(client),
            text_account=None if text_budget is None else text_budget.join(client),
            # Known once the engine started (an engine process says in its hello).
            history=getattr(self.engine.backend.capabilities, "reads_history", False),
        )
        actor = SessionActor(core, self, self.mailbox_capacity)
        self._sessions[core.session_id] = actor
        self.opened += 1
        return SessionHandle(actor)

    def get(self, session_id: str) -> SessionHandle:
        actor = self._sessions.get(session_id)
        if actor is None:
            raise UnknownSession(NO_SUCH_SESSION)
        return SessionHandle(actor)

    async def resume(
        self,
        session_id: str,
        generation: int,
        resume_token: str,
        last_seq: int = 0,
        control_id: str | None = None,
    ) -> SessionHandle:
        handle = self.get(session_id)
        await handle.ask(
            cmd.Resume(
                generation=generation, resume_token=resume_token, last_seq=last_seq, control_id=control_id
            )
        )
        return handle

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[SessionHandle]:
        return [SessionHandle(a) for a in self._sessions.values()]

    def add_close_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(session_id)`` when a session closes, from the dispatcher: it must be
        quick and must not raise (a failing listener is logged and skipped)."""
        self._close_listeners.append(listener)

    def remove_close_listener(self, listener: Callable[[str], None]) -> None:
        with contextlib.suppress(ValueError):
            self._close_listeners.remove(listener)

    def _session_closed(self, actor: SessionActor) -> None:
        if self._sessions.pop(actor.session_id, None) is not None:
            self.closed += 1
            self._transcripts.forget(actor.session_id)  # nobody is left to tell
            self._discard_speculation(actor.session_id)
            speculator = self._speculators.pop(actor.session_id, None)
            if speculator is not None:
                speculator.release()
            actor.core.release_budgets()  # a closed session is never resumed
            for listener in self._close_listeners:
                try:
                    listener(actor.session_id)
                except Exception as exc:  # a listener's bug must not stop the dispatcher
                    log.error("runtime.close_listener_failed", session_id=actor.session_id, error=repr(exc))
            aborted = actor.core.aborted_request_ids
            if aborted and self.engine.cleanup_pending(aborted):
                # Closed, but the engine has not let go of what it aborted yet (a stream still
                # ending, or a failed backend abort being retried): the session keeps its
                # admission slot until then, so failing cleanup cannot overbook the engine.
                self._draining[actor.session_id] = aborted

    def _draining_count(self) -> int:
        if self._draining:
            pending = self.engine.cleanup_pending
            for sid in [s for s, ids in self._draining.items() if not pending(ids)]:
                del self._draining[sid]
        return len(self._draining)

    def statistics(self) -> RuntimeStatistics:
        by_state: dict[str, int] = {}
        for actor in self._sessions.values():
            by_state[actor.core.state] = by_state.get(actor.core.state, 0) + 1
        return RuntimeStatistics(
            len(self._sessions),
            by_state,
            self.opened,
            self.closed,
            len(self._ready),
            self.engine.statistics(),
            self._draining_count(),
        )

    # -- the dispatcher ---------------------------------------------------------------------

    def transcribe(
        self,
        action: TranscribeInput,
        deliver: Callable[[InputTranscript], None],
        session_id: str,
        tenant: str | None = None,
        account: AudioAccount | None = None,
    ) -> None:
        """Transcribe a committed turn off the event loop; ``deliver`` gets the result, once.
        The recogniser is shared by ``tenant`` first, then by session (None: the session is
        a tenant of its own). While the turn waits, its audio counts in ``account`` (the
        client's, in the audio budget; None: uncounted)."""
        if self.transcriber is None:
            deliver(
                InputTranscript(
                    action.item_id,
                    error="input transcription is not available on "
                    "this server (install the 'transcription' extra)",
                )
            )
            return
        supports = getattr(self.transcriber, "supports_language", None)
        if supports is not None and not supports(action.language):
            # An option the recogniser cannot honour fails the turn's transcription, never the
            # session (GA clients such as pipecat end the session on an error).
            deliver(
                InputTranscript(
                    action.item_id,
                    error=f"input transcription language {action.language!r} is not supported: "
                    f"the {self.transcriber.name} recogniser hears English only",
                )
            )
            return
        if self._tg is None:  # not running (closing): still answer the turn, never drop it
            deliver(InputTranscript(action.item_id, error="the runtime is not running"))
            return
        job = TranscriptionJob(session_id, action, deliver, tenant, account)
        speculation = self._speculations.pop(session_id, None)
        if speculation is not None:
            if speculation.claim(job):
                log.debug("transcription.speculation_claimed", session_id=session_id, item_id=action.item_id)
                if speculation.done:
                    self._answer_speculation(speculation)
                return
            speculation.cancel()
        self._queue_transcription(job)

    def _queue_transcription(self, job: TranscriptionJob) -> None:
        assert self._tg is not None
        queue = self._transcripts
        if not queue.offer(job):
            why = queue.refusal(job)
            log.info(
                "transcription_refused",
                session_id=job.session_id,
                item_id=job.action.item_id,
                backlog_s=round(queue.backlog_s(job.session_id), 2),
                why=why,
            )
            job.deliver(InputTranscript(job.action.item_id, error=why))
            return
        running = self._speculating
        if running is not None and running.job is None:
            running.cancel()  # a committed turn never waits for a guess
        while self._transcribing < self._transcription_workers:
            self._transcribing += 1
            self._tg.start_soon(self._transcribe_queued)
        if self._transcript_ready is not None:
            self._transcript_ready.set()

    # -- speculative transcription ----------------------------------------------------------

    def input_speculator(self, session_id: str) -> InputSpeculator | None:
        """An InputSpeculator for ``session_id``'s server VAD, when the recogniser can start a
        turn early and stop a started decode (``speculative``); else None."""
        actor = self._sessions.get(session_id)
        if actor is None or not getattr(self.transcriber, "speculative", False):
            return None
        core = actor.core
        speculator = InputSpeculator(
            lambda prefix, speech: self._speculate(session_id, prefix, speech),
            lambda: self._discard_speculation(session_id),
            sample_rate=core.config.sample_rate,
            wanted=lambda: core.config.transcription is not None,
            account=core.audio_account,
        )
        # One a session (a new server VAD, after an update or a resume, makes a new one): the
        # one it replaces gives its audio back, and so does the last when the session closes.
        old = self._speculators.get(session_id)
        if old is not None:
            old.release()
        self._speculators[session_id] = speculator
        return speculator

    def _speculate(self, session_id: str, prefix: bytes, speech: bytes) -> None:
        """The user went quiet: decode the turn so far, if its session transcribes and the
        recogniser has nothing committed to do (a guess never delays a committed turn)."""
        actor = self._sessions.get(session_id)
        transcriber = self.transcriber
        if actor is None or transcriber is None or self._tg is None:
            return
        config = actor.core.config
        supports = getattr(transcriber, "supports_language", None)
        if config.transcription is None or (
            supports is not None and not supports(config.transcription_language)
        ):
            return
        if self._speculating is not None or self._decoding or len(self._transcripts):
            return
        self._discard_speculation(session_id)
        speculation = self._speculations[session_id] = self._speculating = Speculation(
            prefix + speech, speech, config.sample_rate
        )
        self._tg.start_soon(self._run_speculation, speculation)

    def _discard_speculation(self, session_id: str) -> None:
        speculation = self._speculations.pop(session_id, None)
        if speculation is not None and speculation.job is None:
            speculation.cancel()
            log.debug("transcription.speculation_discarded", session_id=session_id)

    async def _run_speculation(self, speculation: Speculation) -> None:
        transcriber = self.transcriber
        assert transcriber is not None
        try:
            speculation.words = await transcriber.transcribe(  # type: ignore[call-arg]
                speculation.audio, speculation.sample_rate, cancelled=speculation.cancelled
            )
        except Exception as exc:  # cancelled, or the recogniser failed: the commit decodes anew
            speculation.error = repr(exc)
        finally:
            speculation.done = True
            if self._speculating is speculation:
                self._speculating = None
        if speculation.job is not None:
            self._answer_speculation(speculation)

    def _answer_speculation(self, speculation: Speculation) -> None:
        """The claimed turn's answer: the decode's words, or (it failed or was stopped) the
        turn goes the usual way, through the queue."""
        job = speculation.job
        assert job is not None and speculation.done
        if speculation.words is None:
            log.info("transcription.speculation_failed", item_id=job.action.item_id, error=speculation.error)
            if self._tg is None:
                job.deliver(InputTranscript(job.action.item_id, error="the runtime is not running"))
            else:
                self._queue_transcription(job)
            return
        words = speculation.words
        job.deliver(InputTranscript(job.action.item_id, words, delta=words))

    async def _transcribe_queued(self) -> None:
        """One recogniser worker: takes the queue's pieces of turns in its fair order, for ever,
        and answers each turn once its last piece is heard (or one of them failed)."""
        transcriber = self.transcriber
        assert transcriber is not None  # only started by transcribe()
        queue = self._transcripts
        while True:
            piece = queue.take()
            if piece is None:
                # One event for every idle worker: each would otherwise replace the other's.
                ready = self._transcript_ready
                if ready is None or ready.is_set():
                    ready = self._transcript_ready = anyio.Event()
                await ready.wait()
                continue
            action = piece.job.action
            self._decoding += 1
            try:
                words = await transcriber.transcribe(piece.audio, action.sample_rate)
            except Exception as exc:  # the recogniser's failure is this turn's, not the runtime's
                log.warning(
                    "transcription_failed", item_id=action.item_id, piece=piece.index, error=repr(exc)
                )
                failed = queue.failed(piece)
                if failed is not None:
                    error = f"transcription failed: {type(exc).__name__}"
                    failed.deliver(InputTranscript(action.item_id, error=error))
                continue
            finally:
                self._decoding -= 1
            heard = queue.heard(piece, words)
            if heard is not None:
                # A long turn's words go out piece by piece; the last carries the transcript.
                text = heard.transcript if heard.transcript is not None else ""
                heard.job.deliver(InputTranscript(action.item_id, text, delta=heard.delta, final=heard.final))

    def _schedule(self, actor: SessionActor) -> None:
        if not actor.scheduled:
            actor.scheduled = True
            self._ready.append(actor)
            wake = self._wake
            if wake is not None:
                # Set once per wake-up, not once per message of the burst that follows it: a
                # tick's appends to many sessions otherwise paid an Event.set each.
                self._wake = None
                wake.set()

    def meter_tenant_work(self, cpu_clock: Callable[[], float] | None) -> None:
        """Count the loop time the dispatcher spends on each tenant's sessions (a session
        without a tenant counts as its own), by ``cpu_clock`` (seconds; read on the loop);
        :meth:`take_tenant_work` hands it out. A server sharing the loop by client bills it:
        a session's state machine runs here for every engine output and command, and a client
        whose responses run in sessions it has left was otherwise billed for none of it.
        None: stop counting (nobody takes it any more)."""
        self._work_clock = cpu_clock
        self._tenant_work = None if cpu_clock is None else {}

    def take_tenant_work(self) -> dict[str, float]:
        """The loop time spent on each tenant's sessions since the last call ({} unmetered)."""
        work = self._tenant_work
        if not work:
            return {}
        self._tenant_work = {}
        return work

    async def _dispatch(self) -> None:
        ready = self._ready
        budget = self.dispatch_budget
        while True:
            if not ready:
                self._wake = self.new_event()
                await self._wake.wait()
                self._wake = None
                continue
            self.dispatching = True
            try:
                if self._tenant_work is None:  # the runtime's hot path, as lean as it was
                    for _ in range(len(ready)):
                        actor = ready.popleft()
                        actor.scheduled = False
                        if actor.process(budget):
                            self._schedule(actor)
                    # Not kept while the dispatcher waits: a session closed in this round would
                    # stay alive (its journal, its conversation) until the next one.
                    del actor
                else:
                    self._metered_round(ready, budget)
            finally:
                self.dispatching = False
            if ready:
                # Let engine pumps and event consumers run between rounds. With nothing left
                # the wait above yields instead: a checkpoint first was one more task step
                # for every engine output that arrived alone.
                await anyio.lowlevel.checkpoint()

    def _metered_round(self, ready: deque[SessionActor], budget: int) -> None:
        """One dispatcher round, its loop time split evenly between the sessions it ran: two
        clock reads a round, not two a session."""
        clock = self._work_clock
        assert clock is not None
        began = clock()
        tenants = []
        for _ in range(len(ready)):
            actor = ready.popleft()
            actor.scheduled = False
            tenants.append(actor.core.share_tenant)
            if actor.process(budget):
                self._schedule(actor)
        work = self._tenant_work
        if work is not None and tenants:
            each = (clock() - began) / len(tenants)
            for tenant in tenants:
                work[tenant] = work.get(tenant, 0.0) + each

    async def _reap(self) -> None:
        while True:
            await anyio.sleep(self.reaper_interval_s)
            # A pass in slices, the loop free between them: one pass over every session at
            # once held the loop for as long as the sessions are many, twice a second.
            actors = list(self._sessions.values())
            for start in range(0, len(actors), REAP_SLICE):
                if start:
                    await anyio.lowlevel.checkpoint()
                self._reap_some(actors[start : start + REAP_SLICE], self.clock.now())

    def reap_now(self) -> int:
        """Expire every session whose lease ran out; returns how many.

        The same pass ages out each session's replay journal: a session that stopped talking
        records nothing, and only recording evicts, so without it the journal's age limit
        would not bound what a quiet session holds."""
        return self._reap_some(list(self._sessions.values()), self.clock.now())

    def _reap_some(self, actors: list[SessionActor], now: float) -> int:
        expired = 0
        for actor in actors:
            core = actor.core
            if core.closed:
                continue  # closed between two slices of a pass: its journal is let go already
            # Only a hint: the expiry is queued behind what the session has yet to process
            # (a resume, say), and the chart decides when it comes to run.
            if core.lease.expiry(now) is not None and actor.expire():
                expired += 1
            core.expire_journal()
        return expired
