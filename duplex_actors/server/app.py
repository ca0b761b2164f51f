"""The Realtime websocket server: sessions of a :class:`~duplex_actors.Runtime` on the wire.

Theory of operation
-------------------
This module is the server's front: it listens, admits connections, opens and resumes
sessions, and bills each client's work to its share of the loop (through the ledger of
:mod:`.billing`). What answers a request before any websocket exists (health, metrics, the
console, API keys, connect rates) is :mod:`.http_gate`; settings and close codes are in
:mod:`.config`.

One websocket connection is attached to at most one session at a time
(:mod:`.session_connection`; what the server keeps of a session across its connections is a
:mod:`.session_record`). A connection runs two tasks: the *reader* (:mod:`.session_reader`)
turns each text frame
into a typed client event (:mod:`.wire`) and ``tell``s it to the session without waiting for
it to be processed; the *writer* iterates the session's events and sends each in the GA shape
:mod:`.codec` gives it, all the events ready at one wake-up in one socket write (see
:func:`.ws_internals.send_burst`). Nothing a connection does awaits
another connection, so a client that stops reading only stalls its own writer (and, past the
session's outbox capacity, gets its session closed as ``slow_consumer`` by the runtime).

Errors: a frame that cannot become a command, or a command the session refuses, is answered
by an ``error`` event that goes through the session's own event stream, so it carries the next
``server_event_seq`` and is replayed after a resume like any other event. Only a connection
without a session (failed resume, admission refused) gets an out-of-stream error with
``server_event_seq: null``, followed by a close code.

Connection end, as the connection chart (:mod:`duplex_actors.core.connection_chart`) decides:
* the client closes cleanly with code 1000: the session is closed (it said goodbye);
* anything else (TCP reset, half-written frame, ping timeout): the session is *detached* and
  waits out its disconnect grace for a ``session.resume``;
* the server shuts down: the connection is *draining*, and ends with 1001 once the session
  has closed and its client got ``session.closed``.

Resume: connect to ``/v1/realtime?session_id=<id>`` and send ``session.resume`` as the first
frame. If an older connection still holds the session (its drop went unnoticed), it is closed
with 4001 after the new one proved it holds the current token; the session then replays every
journaled event after the client's ``last_seq``, in order, followed by ``session.resumed``.
"""

from __future__ import annotations

import asyncio
import contextvars
import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import anyio
import anyio.lowlevel
import attrs
import structlog
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.extensions import ServerExtensionFactory
from websockets.extensions.permessage_deflate import enable_server_permessage_deflate
from websockets.http11 import Request, Response
from websockets.server import ServerProtocol
from websockets.typing import Subprotocol

from ..actors.async_library import name_async_library, unname_async_library
from ..actors.deadline import fail_after
from ..actors.runtime import Runtime
from ..errors import WORKER_LOST as WORKER_LOST_MESSAGE
from ..errors import (
    DuplexError,
    ResourceExhausted,
    ResumeConflict,
    ResyncRequired,
    ServerDraining,
    SessionClosed,
    UnknownSession,
    WorkerLost,
)
from . import connection as edge
from . import frame_cost, guard, wire
from .audio_format import GA_DEFAULT
from .billing import LoopBilling
from .client_address import describe_peer, peername_ip
from .config import (
    CLOSE_BAD_RESUME,
    CLOSE_GOING_AWAY,
    CLOSE_POLICY_VIOLATION,
    CLOSE_RESUME_CONFLICT,
    CLOSE_RESYNC_REQUIRED,
    CLOSE_SLOW_CONSUMER,
    CLOSE_SUPERSEDED,
    CLOSE_TRY_AGAIN,
    CLOSE_UNKNOWN_SESSION,
    ServerConfig,
)
from .connection import paced_connection
from .console import ConsoleRoutes
from .http_gate import HttpGate, _address, _intent, _tenant
from .inflate import deflate_extensions
from .loop_share import LoopShare
from .metrics import ServerMetrics
from .opening_slots import OpeningSlots
from .read_ahead import ReadAheadLedger
from .session_connection import SessionConnection
from .session_reader import frame_bytes
from .session_record import SessionRecord
from .tls import server_ssl_context
from .tls_first import tls_after_counting
from .tls_relay import RelayedStream, RequestLineSniffer
from .vad_batch import VadBatcher
from .wire_items import DEFAULT_TRANSCRIPTION_MODEL
from .worker_link import FrontLink

if TYPE_CHECKING:
    from ..audio.vad import VoiceActivityModel

log = structlog.get_logger("duplex_actors.server")


#: How often the work no frame of a client's measured (its sessions' state machines, its
#: detached sessions' events) is billed to it (RealtimeServer._charge_unsent_work): well within
#: the loop share's one-second window.
UNSENT_WORK_BILLING_S = 0.1
#: Frames the websocket may hold for a connection's reader before it stops reading the socket
#: (websockets' default is 16). While audio pacing holds a reader back, what the client sent
#: meanwhile waits here, up to this many frames of up to ``WireLimits.transport_cap`` each; the
#: rest stays in the kernel's socket buffers, where TCP flow control pushes back on the client.
READ_QUEUE_FRAMES = 4
#: Session records one sweep looks at before it lets the loop run (RealtimeServer._sweep).
SWEEP_SLICE = 1024
#: How long a connection pushed out by a resume may take to answer its close frame before
#: it is aborted (it holds a connection slot meanwhile; a client still there got the frame).
TAKEOVER_CLOSE_WAIT_S = 0.1

_RESUME_CLOSE_CODES = {
    ResumeConflict: CLOSE_RESUME_CONFLICT,
    ResyncRequired: CLOSE_RESYNC_REQUIRED,
    UnknownSession: CLOSE_UNKNOWN_SESSION,
    SessionClosed: CLOSE_UNKNOWN_SESSION,
}

#: How Realtime sessions differ from the runtime's embedder defaults: a commit only adds audio
#: to the conversation (a response needs response.create or server VAD's create_response), an
#: audio response streams its words once, as the audio's transcript, and the engine is asked
#: for audio at the client's output rate (GA's 24 kHz until the client declares another).
GA_SESSION = {"respond_on_commit": False, "modalities": ("audio",), "output_sample_rate": GA_DEFAULT.rate}


class RealtimeServer:
    """``async with RealtimeServer(runtime, ServerConfig(port=0)) as server: ... server.url``."""

    def __init__(self, runtime: Runtime, config: ServerConfig = ServerConfig()) -> None:
        self.runtime = runtime
        self.config = config
        self._library_token: contextvars.Token[str | None] | None = None
        limit = config.read_ahead_bytes_per_client
        #: What each client holds parsed and unhandled over its connections (read_ahead.py).
        self.read_ahead = (
            None
            if limit is None
            # At least a whole message and a piece: a fragmented message at the cap must be
            # able to complete on its own, or its reader would wait for it for ever.
            else ReadAheadLedger(max(limit, config.limits.transport_cap + edge.PIECE_INFLATION_BYTES))
        )
        self.metrics = ServerMetrics(runtime, records=lambda: len(self._records), read_ahead=self.read_ahead)
        self.console = ConsoleRoutes(self)
        self._ssl = server_ssl_context(config.tls_cert, config.tls_key)
        self._records: dict[str, SessionRecord] = {}
        self._server: Server | None = None
        self._extensions: Sequence[ServerExtensionFactory] | None = None
        self._ws_connection: type[ServerConnection] = ServerConnection
        self._connections = 0
        self._opened = 0
        self._vad_ok: bool | None = None
        self._swept_at = runtime.clock.now()
        self._sweep_queue: list[str] = []  # session ids the sweep has yet to look at
        self._shutting_down = False
        #: A second stop signal came (hurry): the drain does not wait for responses in flight.
        self._hurried = False
        self._drain_wait: anyio.CancelScope | None = None
        #: In a ``serve --workers`` worker: the reports to the front (worker_link.py), the
        #: front's id of each connection it handed over, and which session ids name sessions
        #: lost with an earlier worker process (a resume of one is refused with WorkerLost).
        self.front_link: FrontLink | None = None
        self.lost_session: Callable[[str], bool] | None = None
        self._handed: dict[ServerConnection, int] = {}
        #: In a worker under TLS: the relay socket of the worker that minted a session id, when
        #: that is another worker (tls_relay.py); None here means "serve it here".
        self.relay_path: Callable[[str | None], str | None] | None = None
        #: Its TLS connections not (or not yet) a websocket connection here: reading their
        #: request line, or relayed to their owner; and its own relay socket's server.
        self._sniffers: set[RequestLineSniffer] = set()
        self._relay_server: asyncio.AbstractServer | None = None
        self.loop_share = (
            None
            if config.loop_share_s_per_s is None
            else LoopShare(
                config.loop_share_s_per_s,
                loop_cpu=time.thread_time,
                tenant_floor_s_per_s=config.loop_share_floor_s_per_s,
            )
        )
        #: Detached sessions, whose events are billed as if they were sent (_charge_unsent_work),
        #: at what sending an event has recently cost (seconds; updated by every writer).
        self._detached: set[SessionRecord] = set()
        #: What each client is billed beyond its frames (billing.py), and what an event costs.
        self.billing = LoopBilling()
        #: How long a connection pushed out by a resume may take to answer its close frame.
        self.takeover_close_wait_s = TAKEOVER_CLOSE_WAIT_S
        self._charging: asyncio.Task[None] | None = None
        self.vad_batcher = (
            None if config.vad_batch_window_s is None else VadBatcher(config.vad_batch_window_s)
        )
        self.quotas = guard.AdmissionQuotas(
            max_per_key=config.max_sessions_per_key,
            max_per_address=config.max_sessions_per_address,
            max_detached=config.max_detached_sessions,
        )
        self.connect_rates = guard.connect_rates(config)

    # -- lifecycle --------------------------------------------------------------------------

    async def __aenter__(self) -> RealtimeServer:
        # Before the listener is made: every connection's callbacks copy this context, and an
        # append handled in one may start engine work through anyio (actors/async_library.py).
        self._library_token = name_async_library()
        # Kept for adopt(), which makes a connection from them as serve() makes one.
        self._extensions = self._negotiated_extensions()
        self._ws_connection = edge.with_edge_limits(
            self._connection_class(),
            max_head_bytes=self.config.max_request_head_bytes,
            max_headers=self.config.max_request_headers,
            handshakes=guard.PendingHandshakes(
                per_address=self.config.max_handshakes_per_address,
                total=self.config.max_handshakes,
                # A trusted proxy's connections are all its clients': counted by the client
                # it forwards once the head is read (http_gate), not here by the proxy.
                exempt=guard.exempt_from(self.config.exempt_networks + self.config.trusted_proxies),
            ),
            opening_slots=(
                OpeningSlots(self.config.max_opening_connections)
                if self.config.max_opening_connections is not None
                else None
            ),
            trusted_proxies=(
                guard.exempt_from(self.config.trusted_proxies) if self.config.trusted_proxies else None
            ),
            read_ahead=self.read_ahead,
            read_ahead_exempt=guard.exempt_from(self.config.exempt_networks),
        )
        # Under TLS the listener accepts plain TCP and each connection runs its TLS handshake
        # once it is counted among those opening (tls_first.py); adopted and relayed ones are
        # counted where they arrive.
        self._accepted_connection = (
            self._ws_connection
            if self._ssl is None
            else tls_after_counting(self._ws_connection, self._ssl, self.config.handshake_timeout_s)
        )
        self._server = await serve(
            self._handle,
            self.config.host,
            self.config.port,
            process_request=HttpGate(self),
            process_response=self._answering,
            select_subprotocol=_select_subprotocol,
            max_size=self.config.limits.transport_cap,
            **self._connection_options(),
            compression=None,  # the extensions are the compression (_negotiated_extensions)
            extensions=self._extensions,
            open_timeout=self.config.handshake_timeout_s,
            create_connection=self._accepted_connection,
            backlog=self.config.listen_backlog,
        )
        self.runtime.add_close_listener(self._session_closed)
        frame_cost.install()
        if self.loop_share is not None:
            self.runtime.meter_tenant_work(frame_cost.billable_clock)
            self._charging = asyncio.get_running_loop().create_task(self._charge_unsent_work())
        log.info("server.listening", url=self.url)
        return self

    async def _charge_unsent_work(self) -> None:
        """Bill each client, every UNSENT_WORK_BILLING_S, for the work done for it that no frame
        of its own measured: the dispatcher's time on its sessions (their state machines, for
        every engine output and command; Runtime.meter_tenant_work), and its detached sessions'
        new events, as if they had been sent.

        A detached session's response goes on into its outbox (for a resume), and with no
        writer nothing of it was billed: a client opening a session, asking for a response and
        dropping the connection, over and over, made a neighbour's response x17-24 slower, and
        was never held back. Billed at what sending an event costs (what the client would have
        been billed had it stayed), its next frames wait like any client's over its share."""
        share = self.loop_share
        assert share is not None
        now = self.runtime.clock.now
        while True:
            await anyio.sleep(UNSENT_WORK_BILLING_S)
            try:
                self._charge_once(share, now())
            except Exception as exc:  # a bug here must not end the billing for good
                log.error("server.billing_failed", error=repr(exc))

    def _charge_once(self, share: LoopShare, now: float) -> None:
        detached = self._detached
        for record in list(detached):
            if record.attached is not None or record.handle.state == "closed":
                detached.discard(record)
        away = [(record, record.handle.tenant, record.handle.events_produced) for record in detached]
        self.billing.unsent(share, self.runtime.take_tenant_work(), away, now)

    def _negotiated_extensions(self) -> Sequence[ServerExtensionFactory] | None:
        """What ``serve(compression=...)`` would negotiate: permessage-deflate, budgeted when the
        config has an inflate budget."""
        config = self.config
        if config.compression is None:
            return None
        if config.compression != "deflate":
            raise ValueError(f"unsupported compression: {config.compression}")
        budgeted = (
            deflate_extensions(config.inflate_budget, config.limits.max_frame_bytes, time.monotonic)
            if config.inflate_budget is not None
            else None
        )
        return enable_server_permessage_deflate(budgeted)

    def _connection_options(self) -> dict[str, Any]:
        """A connection's queue, keepalive and close settings, accepted or adopted alike."""
        return {
            "max_queue": READ_QUEUE_FRAMES,
            "ping_interval": self.config.ping_interval_s,
            "ping_timeout": self.config.ping_timeout_s,
            "close_timeout": 2.0,
        }

    def _adopted_connection(
        self,
        relayed_peer: tuple[str, int] | None = None,
        connection_class: type[ServerConnection] | None = None,
    ) -> ServerConnection:
        """The websocket connection for a socket accepted elsewhere, made from websockets'
        public pieces as its serve() makes one for a socket it accepted: the same protocol
        settings, connection class and server, whose handler runs the handshake.
        ``relayed_peer``: the client of a connection another worker relays (tls_relay.py);
        ``connection_class``: another than the server's (the one that runs TLS itself)."""
        assert self._server is not None, "use 'async with RealtimeServer(...)'"
        connection: ServerConnection | None = None

        def select(protocol: ServerProtocol, subprotocols: Sequence[Subprotocol]) -> Subprotocol | None:
            assert connection is not None
            return _select_subprotocol(connection, subprotocols)

        protocol = ServerProtocol(
            extensions=self._extensions,
            select_subprotocol=select,
            max_size=self.config.limits.transport_cap,
        )
        connection = (connection_class or self._ws_connection)(
            protocol, self._server, **self._connection_options()
        )
        if relayed_peer is not None:
            connection.relayed_peer = relayed_peer  # type: ignore[attr-defined]
        return connection

    def _connection_class(self) -> type[ServerConnection]:
        config = self.config
        return paced_connection(
            frames_per_s=config.frames_per_s,
            frames_burst=config.frames_burst,
            control_frames_per_s=config.control_frames_per_s,
            control_frames_burst=config.control_frames_burst,
            on_paced=lambda what, wait: self.metrics.paced.labels(what).inc(wait),
        )

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.aclose()
        finally:
            unname_async_library(self._library_token)

    async def shutdown(self, drain_timeout_s: float = 10.0) -> None:
        """Graceful stop (SIGTERM): stop accepting connections; let responses in flight finish
        for up to ``drain_timeout_s``; close every session (``session.closed`` with reason
        ``runtime_shutdown``, after a ``response.done`` for any response cut short); let each
        connection deliver that, then close it with 1001 (going away)."""
        if self._server is None or self._shutting_down:
            return
        self._shutting_down = True
        self._server.close(close_connections=False)  # stop listening; connections stay
        # From here no session opens and none starts a response (response.create is refused
        # with ServerDraining): the wait below ends with the last response in flight.
        self.runtime.drain()
        for record in self._records.values():
            if record.attached is not None:
                record.attached.drain()  # its connection ends with 1001 once the session closes
        log.info(
            "server.draining",
            sessions=self.runtime.session_count,
            connections=self._connections,
            responses=self.runtime.responses_in_flight,
        )
        with anyio.move_on_after(0.0 if self._hurried else drain_timeout_s) as self._drain_wait:
            await anyio.lowlevel.checkpoint()  # the drain triggers queued above are processed first
            # A connection relayed to its owner worker (TLS) ends with the owner's drain.
            while self.runtime.responses_in_flight or self._sniffers:
                await anyio.sleep(0.02)
        self._drain_wait = None
        self.runtime.close_all("runtime_shutdown")
        with anyio.move_on_after(max(self.config.write_timeout_s, 1.0)):
            while self._connections or self._sniffers:
                await anyio.sleep(0.02)
        log.info("server.drained", connections_left=self._connections + len(self._sniffers))
        await self.aclose()

    def hurry(self) -> None:
        """Cut the drain short (a second SIGINT/SIGTERM): stop waiting for responses in flight.
        Each still ends with its ``response.done`` (cancelled), and every session closes as in
        any drain. Before :meth:`shutdown`, it makes that drain wait for nothing."""
        self._hurried = True
        if self._drain_wait is not None:
            self._drain_wait.cancel()

    async def aclose(self) -> None:
        self.runtime.remove_close_listener(self._session_closed)
        self.console.close()
        if self._charging is not None:
            self._charging.cancel()
            self._charging = None
            self.runtime.meter_tenant_work(None)
        if self._relay_server is not None:
            self._relay_server.close()
            self._relay_server = None
        for sniffer in list(self._sniffers):
            sniffer.abort()
        if self._server is not None:
            frame_cost.uninstall()
            self._server.close(close_connections=True)
            await self._server.wait_closed()
            self._server = None

    async def serve_forever(self) -> None:
        assert self._server is not None, "use 'async with RealtimeServer(...)'"
        await self._server.serve_forever()

    async def adopt(self, sock: socket.socket, handed_id: int | None = None) -> None:
        """Serve a connection that was accepted elsewhere: ``serve --workers`` front process
        accepts, reads only the request line, and passes the socket here; the handshake, auth
        and everything after it run exactly as for a connection this server accepted.
        ``handed_id``: the front's id of the connection, named in the reports to it."""
        assert self._server is not None, "use 'async with RealtimeServer(...)'"
        loop = asyncio.get_running_loop()
        if self._ssl is not None and self.relay_path is not None:
            await self._adopt_tls(sock, handed_id)
            return
        # Under TLS the connection counts itself, then runs its handshake (tls_first.py).
        _, connection = await loop.connect_accepted_socket(
            lambda: self._adopted_connection(connection_class=self._accepted_connection), sock
        )
        self._track_handed(connection, handed_id)

    def _answering(self, connection: ServerConnection, request: Request, response: Response) -> None:
        """websockets' process_response: under ``serve --workers``, the front is told that a
        handed connection's handshake is answered just before the answer goes out. Should this
        worker die, the front then ends that client's connection in websocket frames, and one
        still waiting for its answer with an HTTP 503 (front_ledger.py)."""
        link = self.front_link
        if link is not None and response.status_code == 101:
            handed_id = self._handed.get(connection)
            if handed_id is not None:
                link.answering(handed_id)

    def _track_handed(self, connection: ServerConnection, handed_id: int | None) -> None:
        if handed_id is not None and self.front_link is not None:
            self._handed[connection] = handed_id
            asyncio.get_running_loop().create_task(self._report_released(connection, handed_id))

    async def _adopt_tls(self, sock: socket.socket, handed_id: int | None) -> None:
        """A worker under TLS: its TLS is terminated here, then the request line says whether
        the connection is served here or relayed to the worker that owns its session."""
        loop = asyncio.get_running_loop()
        sniffer: RequestLineSniffer | None = None

        def serve_here(transport: asyncio.Transport, buffered: bytes) -> None:
            self._sniffers.discard(sniffer)
            self._track_handed(self._connection_on(transport, buffered), handed_id)

        def ended() -> None:  # relayed (or never served): the front may close its duplicate
            self._sniffers.discard(sniffer)
            if handed_id is not None and self.front_link is not None:
                self.front_link.released(handed_id)

        def made() -> RequestLineSniffer:
            nonlocal sniffer
            assert self.relay_path is not None
            sniffer = RequestLineSniffer(
                self.relay_path,
                serve_here,
                ended,
                on_relay=self.metrics.relays.labels("out").inc,
                handshakes=handshakes,
                counted=address,
            )
            self._sniffers.add(sniffer)
            return sniffer

        # Counted among the connections opening before its TLS handshake starts, as one this
        # server accepted (tls_first.py); the sniffer takes the count over once it is made.
        handshakes = getattr(self._ws_connection, "handshakes", None)
        try:
            address = peername_ip(sock.getpeername())
        except OSError:  # the client is gone already
            address = "?"
        if handshakes is not None and handshakes.admit(address) is not None:
            sock.close()  # no plaintext to say why in
            if handed_id is not None and self.front_link is not None:
                self.front_link.released(handed_id)
            return
        try:
            await loop.connect_accepted_socket(
                made, sock, ssl=self._ssl, ssl_handshake_timeout=self.config.handshake_timeout_s
            )
        except BaseException:
            self._sniffers.discard(sniffer)
            if handshakes is not None and (sniffer is None or not sniffer.took_count):
                handshakes.leave(address)
            raise

    def _connection_on(
        self, transport: asyncio.Transport, read: bytes, relayed_peer: tuple[str, int] | None = None
    ) -> ServerConnection:
        """A websocket connection takes over ``transport``, from a protocol that has already
        ``read`` the start of its request (tls_relay.py)."""
        connection = self._adopted_connection(relayed_peer)
        transport.set_protocol(connection)
        connection.connection_made(transport)
        if read:
            connection.data_received(read)
        return connection

    async def serve_relays(self, path: str) -> None:
        """Listen on ``path`` for connections other workers relay here (tls_relay.py)."""

        def serve_relayed(transport: asyncio.Transport, rest: bytes, peer: tuple[str, int]) -> None:
            self.metrics.relays.labels("in").inc()
            self._connection_on(transport, rest, relayed_peer=peer)

        loop = asyncio.get_running_loop()
        self._relay_server = await loop.create_unix_server(lambda: RelayedStream(serve_relayed), path)

    async def _report_released(self, connection: ServerConnection, handed_id: int) -> None:
        # Every way a connection ends (a session's close, a refused handshake, /health) ends
        # here: the front holds a duplicate of the socket, and closes it once told.
        try:
            await connection.wait_closed()
        finally:
            self._handed.pop(connection, None)
            if self.front_link is not None:
                self.front_link.released(handed_id)

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]  # getsockname() is typed Any
        return port

    @property
    def url(self) -> str:
        return f"{'wss' if self._ssl else 'ws'}://{self._netloc}{self.config.path}"

    @property
    def http_url(self) -> str:
        return f"{'https' if self._ssl else 'http'}://{self._netloc}"

    @property
    def _netloc(self) -> str:
        host = self.config.host
        # An IPv6 literal goes in brackets in a URL (RFC 3986): ws://[::1]:8000/...
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def connection_count(self) -> int:
        return self._connections

    @property
    def _keys(self) -> tuple[str, ...]:
        return ((self.config.api_key,) if self.config.api_key is not None else ()) + self.config.api_keys

    # -- websocket side ---------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        if isinstance(ws, edge.PacedConnection):
            # Its handshake is done: its opening slot goes to the next connection in line (a
            # resume may wait on the session's old connection from here, which takes no CPU).
            ws.handshake_done()
        conn = SessionConnection(self, ws)
        self._connections += 1
        self.metrics.connections.inc()
        self.metrics.connections_total.inc()
        record: SessionRecord | None = None
        try:
            assert ws.request is not None, "websockets calls the handler after the handshake"
            resume_ids = parse_qs(urlsplit(ws.request.path).query).get("session_id")
            if resume_ids:
                record = await self._resume(conn, resume_ids[0])
            else:
                record = await self._open(conn)
            if record is not None:
                link = self.front_link
                if link is not None and ws in self._handed:
                    link.attached(self._handed[ws], record.handle.id)
                await conn.run(record)
        except Exception as exc:  # one connection's bug never takes the server down
            log.error("server.connection_failed", error=repr(exc))
        finally:
            self._connections -= 1
            self.metrics.connections.dec()
            if record is not None and self.front_link is not None and record.handle.state == "closed":
                # Its writer tells the front when it writes session.closed; a connection that
                # ended first (dropped mid-close) never does, and the front kept the session's
                # responses for good. Told twice is harmless.
                self.front_link.session_ended(record.handle.id)

    async def _open(self, conn: SessionConnection) -> SessionRecord | None:
        try:
            intent = _intent(conn.ws)
        except DuplexError as err:
            await conn.refuse(err, CLOSE_POLICY_VIOLATION)
            return None
        self._opened += 1
        now = self.runtime.clock.now()
        # Sessions that expired while detached are only found by a sweep: often enough that a
        # slow trickle of opens does not keep their journals for long either.
        if self._opened % 256 == 0 or now - self._swept_at >= 10.0:
            self._swept_at = now
            self._sweep()
        vad = self.config.server_vad_by_default and self._vad_available()
        overrides = {**GA_SESSION, "server_vad": vad, "auto_respond": vad, **self.config.session_overrides}
        if intent == "transcription":
            # GA's transcription session: its committed turns are transcribed and nothing
            # answers them (the chart refuses response.create: SessionConfig.responses).
            overrides["responses"] = False
            overrides["transcription"] = overrides.get("transcription") or DEFAULT_TRANSCRIPTION_MODEL
        address = _address(conn.ws)
        try:
            self.quotas.check(conn.key, address, sweep=self._sweep)
            # The session binds its resume token to this key (the chart's resume_key_matches),
            # and shares the engine, synthesiser and recogniser as its key's (else its
            # address's) tenant: a client's many sessions get one client's part.
            handle = self.runtime.open_session_nowait(
                owner=conn.key, tenant=_tenant(conn.key, address), **overrides
            )
        except DuplexError as err:
            log.warning("server.admission_refused", code=err.code, remote=address)
            retry = isinstance(err, (ResourceExhausted, ServerDraining))
            await conn.refuse(err, CLOSE_TRY_AGAIN if retry else 1011)
            return None
        record = SessionRecord(handle, self.config.model_name, self._new_pacers(), self._engine_caps())
        if vad and handle.config.server_vad:
            record.set_vad(wire.TurnDetection(), handle.config.auto_respond)
        self._attach(record, conn)
        self._records[handle.id] = record
        self.quotas.opened(handle.id, conn.key, address)
        log.info("server.session_opened", session_id=handle.id, remote=describe_peer(conn.ws))
        return record

    async def _resume(self, conn: SessionConnection, session_id: str) -> SessionRecord | None:
        ws = conn.ws
        address = _address(ws)
        try:
            self.quotas.resume_waiting(conn.key, address)
        except DuplexError as err:
            self.metrics.resumes.labels(err.code).inc()
            log.info("server.resume_refused", session_id=session_id, code=err.code)
            await conn.refuse(err, CLOSE_TRY_AGAIN)
            return None
        try:
            # Counted until attached or refused, not only until its frame is read: resumes of
            # one session queue on its lock behind one paying its replay's debt, and a client
            # with a valid token held 40 of 40 connection slots that way.
            return await self._resume_counted(conn, session_id)
        finally:
            self.quotas.resume_read(conn.key, address)

    async def _resume_counted(self, conn: SessionConnection, session_id: str) -> SessionRecord | None:
        ws = conn.ws
        try:
            request, size = await self._first_resume_frame(ws, session_id)
            record = self._record_for(session_id)
            async with record.lock:
                handle = record.handle
                old = record.attached
                # The session's chart decides (API key, credentials, replay, journal); the
                # server only says who is asking.
                resume = attrs.evolve(request.command, key_digest=conn.key)
                # Asked before the old connection is pushed out, which cannot be undone: it
                # would otherwise stop reading for a resume the session then refuses.
                handle.check(resume)
                if record.frame_pacer is not None:
                    # The replay (up to the journal's 8 MiB) is charged to the session's bytes
                    # as it goes out, like any reply; a client resuming in a loop waits here
                    # for what its last replays cost. Only once its credentials hold: someone
                    # else's bad resume never waits on, nor spends, this session's budget.
                    wait = record.frame_pacer.charge(size, self.runtime.clock.now())
                    if wait:
                        self.metrics.paced.labels("frames").inc(wait)
                        await anyio.sleep(wait)
                        handle.check(resume)  # the session may have moved on meanwhile
                if old is not None:
                    # What the old connection's client sent before it is pushed out reaches the
                    # session first, and the chart is asked again after it: a session.close it
                    # sent a moment before got the session closed, and that client is still
                    # there to get its session.closed (kicked, it got 4001 and no terminal
                    # event, and this resume was refused anyway: 7 in 200 races).
                    await old.hold_reading()
                    try:
                        await handle.barrier()
                        handle.check(resume)
                    except BaseException:
                        old.release_reading()
                        raise
                    await old.kick()  # the chart's takeover: the session no longer its
                await handle.ask(resume)
                self._attach(record, conn)
                self.quotas.attached(session_id)
        except DuplexError as err:
            self.metrics.resumes.labels(err.code).inc()
            code = next((c for t, c in _RESUME_CLOSE_CODES.items() if isinstance(err, t)), CLOSE_BAD_RESUME)
            log.info("server.resume_refused", session_id=session_id, code=err.code)
            await conn.refuse(err, code)
            return None
        self.metrics.resumes.labels("ok").inc()
        log.info(
            "server.session_resumed",
            session_id=session_id,
            last_seq=request.command.last_seq,
            generation=handle.generation,
        )
        return record

    async def _first_resume_frame(
        self, ws: ServerConnection, session_id: str
    ) -> tuple[wire.ResumeRequest, int]:
        """The resuming connection's session.resume, and its size in bytes."""
        frame: Any = None
        try:
            async with fail_after(self.config.resume_wait_s):
                frame = await ws.recv()
        except (ConnectionClosed, TimeoutError):
            # Gone before it said anything (or silent): no session to refuse, nothing to log
            # as a failure (2,000 such connections made 2,000 error lines).
            frame = None
        if frame is None:
            raise wire.WireError(f"no session.resume within {self.config.resume_wait_s}s")
        if isinstance(ws, edge.PacedConnection):
            # Taken from the read queue, and out of the client's read-ahead (read_ahead.py): it
            # is decoded now, or refused unparsed just below.
            ws.read_done()
            ws.handled()
        limit = self.config.limits.max_resume_frame_bytes
        if frame_bytes(frame) > limit:
            # Refused unparsed: nothing paces this frame (no session, no budget yet), and a
            # padded one costs the loop far more to parse than it cost to send (deflated).
            raise wire.FrameTooLarge(f"a session.resume frame is at most {limit} bytes")
        request = wire.decode(frame, self.config.limits)
        if not isinstance(request, wire.ResumeRequest):
            raise wire.WireError(
                "a connection opened with ?session_id= must send session.resume first",
                event_id=getattr(request, "event_id", None),
            )
        if request.session_id != session_id:
            raise wire.InvalidField(
                "session_id", "does not match the session_id of the URL", event_id=request.event_id
            )
        return request, frame_bytes(frame)

    def _vad_available(self) -> bool:
        """Whether server VAD can run here: tried once per server (one model load, ~90 ms)."""
        if self._vad_ok is None:
            try:
                self._vad_model(16000)
                self._vad_ok = True
            except wire.NotSupported as err:
                log.info("server.vad_unavailable", reason=err.message)
                self._vad_ok = False
        return self._vad_ok

    def _vad_model(self, sample_rate: int) -> VoiceActivityModel:
        try:
            from ..audio.vad import SileroVad

            if self.config.vad_factory is not None:
                return self.config.vad_factory(sample_rate)
            # int8 is the 16 kHz network only; a session at another rate runs float32
            precision = self.config.vad_precision if sample_rate == 16000 else "float32"
            return SileroVad(sample_rate, quiet_dbfs=self.config.vad_quiet_dbfs, precision=precision)
        except ImportError as exc:
            raise wire.NotSupported(
                f"server VAD is not available on this server ({exc}); "
                "set turn_detection to null and commit explicitly"
            ) from None

    def _record_for(self, session_id: str) -> SessionRecord:
        record = self._records.get(session_id)
        if record is not None and record.handle.state != "closed":
            return record
        if self.lost_session is not None and self.lost_session(session_id):
            raise WorkerLost(WORKER_LOST_MESSAGE)
        handle = self.runtime.get(session_id)  # raises UnknownSession once closed or expired
        record = self._records[session_id] = SessionRecord(
            handle, self.config.model_name, self._new_pacers(), self._engine_caps()
        )
        return record

    def _engine_caps(self) -> object:
        """The engine's capabilities (an engine in another process: those its hello said)."""
        return getattr(self.runtime.backend, "capabilities", None)

    def _new_pacers(self) -> tuple[guard.IntakePacer | None, ...]:
        config, now = self.config, self.runtime.clock.now()
        audio = config.audio_intake_rate
        frames = config.frame_intake_bytes_per_s
        handling = config.frame_handling_s_per_s
        return (
            None if audio is None else guard.IntakePacer(audio, config.audio_intake_burst_s, now),
            None if frames is None else guard.IntakePacer(frames, config.frame_intake_burst_bytes, now),
            None if handling is None else guard.IntakePacer(handling, config.frame_handling_burst_s, now),
        )

    def _attach(self, record: SessionRecord, conn: SessionConnection) -> None:
        """``conn`` carries ``record``'s session from now on (any older one was taken over)."""
        assert record.attached is None or not record.attached.lifecycle.carrying
        record.attached = conn
        if self._shutting_down:
            conn.drain()

    def _forget(self, record: SessionRecord) -> None:
        self._detached.discard(record)
        if self._records.get(record.handle.id) is record:
            del self._records[record.handle.id]
        self.quotas.released(record.handle.id)

    def _session_closed(self, session_id: str) -> None:
        """A session closed. Without a connection (it expired while detached, or was closed
        from the API) nothing else would drop its record, which holds the session's core and
        journal: drop it now. An attached connection's writer forgets it after session.closed."""
        record = self._records.get(session_id)
        if record is not None and record.attached is None:
            self._forget(record)
        if (record is None or record.attached is None) and self.front_link is not None:
            # No connection will write its session.closed: the front hears of the end here,
            # or it kept the responses it was told of (a client that dropped its connection
            # mid-response) for as long as it ran, a few hundred bytes a session.
            self.front_link.session_ended(session_id)

    def _sweep(self, limit: int = SWEEP_SLICE) -> None:
        """Drop records of sessions that closed while no connection was attached (expiry),
        looking at up to ``limit`` records, from where the last sweep stopped.

        A backstop: ``_session_closed`` drops them as they close. In slices because it runs on
        the way to a session's first frame: all at once it held the loop 10 ms at 10,000."""
        queue = self._sweep_queue
        if not queue:
            queue.extend(self._records)
        records = self._records
        for _ in range(min(limit, len(queue))):
            record = records.get(queue.pop())
            if record is not None and record.handle.state == "closed" and record.attached is None:
                self._forget(record)


# --- helpers --------------------------------------------------------------------------------


def _select_subprotocol(
    connection: ServerConnection, subprotocols: Sequence[Subprotocol]
) -> Subprotocol | None:
    # Browsers send "realtime" next to the key-carrying protocol; echo only the former.
    return Subprotocol("realtime") if "realtime" in subprotocols else None


__all__ = [
    "RealtimeServer",
    "CLOSE_GOING_AWAY",
    "CLOSE_POLICY_VIOLATION",
    "CLOSE_SLOW_CONSUMER",
    "CLOSE_TRY_AGAIN",
    "ServerConfig",
    "CLOSE_SUPERSEDED",
    "CLOSE_BAD_RESUME",
    "CLOSE_UNKNOWN_SESSION",
    "CLOSE_RESUME_CONFLICT",
    "CLOSE_RESYNC_REQUIRED",
]
