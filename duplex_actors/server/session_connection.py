"""One websocket connection carrying one session: its reader, its writer, and the effects of
the connection chart (:mod:`duplex_actors.core.connection_chart`).

The reader (:mod:`.session_reader`) hands each frame the client sends to the session; the
writer sends the session's events in the GA shape :mod:`.codec` gives them, all the events
ready at one wake-up in one socket write. How a connection ends, and what its end does to the
session (close, detach, nothing), is the chart's decision: the connection fires its triggers
(``socket_lost``, ``session_closed``, ``takeover``, ``flood``, ``slow_consumer``, ``drain``)
and performs the effects it gets back, each a ``_fx_<name>`` method here. What it sends is
billed through the loop-share ledger (:mod:`.billing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import TYPE_CHECKING

import anyio
import structlog
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from ..actors.deadline import fail_after
from ..core import commands as cmd
from ..core import events as ev
from ..core.connection_chart import NO_FACTS, SUPERSEDED, ConnectionLifecycle, Facts
from ..errors import DuplexError
from . import codec, frame_cost, guard, wire, ws_internals
from .client_address import describe_peer
from .config import (
    CLOSE_GOING_AWAY,
    CLOSE_POLICY_VIOLATION,
    CLOSE_SLOW_CONSUMER,
    CLOSE_SUPERSEDED,
)
from .session_reader import ReaderStop, SessionReader
from .worker_link import FrontLink

if TYPE_CHECKING:
    from .app import RealtimeServer
    from .session_record import SessionRecord

log = structlog.get_logger("duplex_actors.server")

#: A socket write stops taking events once it holds this many frames or bytes (checked after
#: each event); the rest of a burst goes in the next write, so a long backlog does not hold the
#: first event back.
BURST_MAX_FRAMES = 64
BURST_MAX_BYTES = 256 * 1024


class SessionConnection:
    """One websocket connection carrying one session: a reader and a writer over the
    connection chart (:mod:`duplex_actors.core.connection_chart`), which decides how the
    connection ends and what its end does to the session."""

    __slots__ = ("server", "ws", "record", "lifecycle", "reader", "writer_stopped", "key", "end_code")

    def __init__(self, server: RealtimeServer, ws: ServerConnection) -> None:
        self.server = server
        self.ws = ws
        self.record: SessionRecord | None = None
        self.lifecycle = ConnectionLifecycle()
        self.reader = SessionReader(server, ws, self.lifecycle)
        self.writer_stopped = anyio.Event()
        keys = server._keys
        assert ws.request is not None, "a connection is made after its handshake"
        self.key = guard.key_digest(guard.accepted_key(ws.request.headers, keys)) if keys else None
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
        self.record = self.reader.record = record
        try:
            # asyncio's own task group, not anyio's: the websockets server is asyncio-only, and
            # anyio's keeps the cancelled writer's CancelledError in a cycle with its frame,
            # so every closed connection left its objects to a full collection
            # (tests/server/test_connection_garbage.py).
            async with asyncio.TaskGroup() as tg:
                writer = tg.create_task(self._write_loop())
                if await self.reader.run() is ReaderStop.FLOOD:
                    await self._flood()
                writer.cancel()
        finally:
            self.writer_stopped.set()
            with anyio.CancelScope(shield=True):
                # What the client sent before it left reaches the session first.
                await self.reader.settle()
                await self._release()

    async def _flood(self) -> None:
        """Declared flood policy: the session closes (``invalid_frame_flood``, or
        ``backpressure_flood`` when the refused frames were valid ones refused for room), the client
        gets its session.closed, then close 1008. Frames after the budget are not read."""
        assert self.record is not None
        log.warning(
            "server.flood_closed",
            session_id=self.record.handle.id,
            reason=self.reader.flood_reason,
            refused=self.reader.flood.refused,
            remote=describe_peer(self.ws),
        )
        self.server.metrics.disconnects.labels("flood").inc()
        await self._fire("flood")

    async def _write_loop(self) -> None:
        record = self.record
        assert record is not None
        handle = record.handle
        observe = self.server.metrics.observe
        timeout = self.server.config.write_timeout_s
        pacer = record.frame_pacer
        loop_share = self.server.loop_share
        tenant = record.tenant
        now = self.server.runtime.clock.now
        link = self.server.front_link
        ended = False
        to_report: list[ev.ServerEvent] = []  # what the front must hear before this burst goes
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
                    # A replayed response.created (sent before, on this connection or an
                    # earlier one) is not news to the front: reported again, it reopened a
                    # response that had ended, and a worker killed before the replay reached
                    # its response.done left the front to send that client a second one.
                    kind = type(event)
                    if (
                        link is not None
                        and kind in _REPORTED
                        and (first_time or kind is not ev.ResponseCreated)
                    ):
                        to_report.append(event)
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
                # The front hears of a response just before its frames are written (send_burst
                # writes before it first waits), never after: a worker killed between the two
                # leaves the front to end a response the client did not see start
                # (protocol.md says how to read that), never one the client saw start with
                # nobody left to end it. Told as each event was encoded, the window was the
                # rest of the burst's encoding wide.
                if to_report:
                    assert link is not None  # listed only for a worker's connection
                    for event in to_report:
                        _report_to_front(link, event)
                    to_report.clear()
                # A client that stops reading is closed after write_timeout_s (guard.py's
                # policy), so it never pins its connection and outbox forever.
                async with fail_after(timeout):
                    cost += await ws_internals.send_burst(self.ws, frames)
                # Sent: not kept while the writer waits for the next events, which can be the
                # session's whole life. The last burst can be megabytes (a long item echoed).
                frames, frame = [], b""
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
        await self.reader.hold()

    def release_reading(self) -> None:
        self.reader.release()

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
            facts = Facts(session_closed=closed, client_said_goodbye=self.reader.said_goodbye)
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
        if self.reader.flood_reason == "backpressure_flood":
            self.end_code = (CLOSE_POLICY_VIOLATION, "too many frames sent after input_backpressure")
        else:
            self.end_code = (CLOSE_POLICY_VIOLATION, "too many invalid frames")

    async def _fx_force_close_session(self) -> None:
        assert self.record is not None
        # Forced: a flooder may have filled its control lane, and the policy must still hold.
        self.server.runtime.force_close(self.record.handle.id, self.reader.flood_reason)

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
            remote=describe_peer(self.ws),
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


#: The events the front is told of (_report_to_front): only these wait for a burst's write.
_REPORTED = frozenset({ev.ResponseCreated, ev.ResponseDone, ev.SessionClosedEvent})


def _report_to_front(link: FrontLink, event: ev.ServerEvent) -> None:
    """What the front must know to end the client's responses should this worker die."""
    if type(event) is ev.ResponseCreated:
        link.response_started(event.session_id, event.response_id)
    elif type(event) is ev.ResponseDone:
        link.response_ended(event.session_id, event.response_id)
    elif type(event) is ev.SessionClosedEvent:
        link.session_ended(event.session_id)
