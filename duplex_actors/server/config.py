"""The Realtime server's settings (:class:`ServerConfig`) and the close codes it ends
connections with."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from . import connection as edge
from . import guard, wire
from .connection import CONTROL_FRAMES_BURST, CONTROL_FRAMES_PER_S, FRAMES_BURST, FRAMES_PER_S
from .inflate import InflateBudget
from .read_ahead import READ_AHEAD_BYTES_PER_CLIENT

if TYPE_CHECKING:
    from ..audio.vad import VoiceActivityModel

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


def _none_or(validator: Callable[[Any, Any, Any], Any]) -> Callable[[Any, attrs.Attribute[Any], Any], Any]:
    """``attrs.validators.optional(validator)``, typed for any field: mypy takes an attrs
    field's type from its default alone, so an optional validator does not match a field whose
    default is not None."""
    return attrs.validators.optional(validator)


def _networks(_instance: Any, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    """Each entry a network (``10.0.0.0/8``) or an address: a typo is an error at start, not a
    limit that silently never applies."""
    for network in value:
        try:
            ipaddress.ip_network(network, strict=False)
        except ValueError:
            raise ValueError(f"{attribute.name}: {network!r} is not an IP network or address") from None


@attrs.frozen(slots=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    # 0 picks a free port (see RealtimeServer.port)
    port: int = attrs.field(default=8765, validator=[attrs.validators.ge(0), attrs.validators.le(65535)])
    #: When set, every /v1/realtime connection must present it (Authorization: Bearer <key>,
    #: an ``api-key`` header, or the ``openai-insecure-api-key.<key>`` subprotocol).
    api_key: str | None = None
    limits: wire.WireLimits = wire.WireLimits()
    path: str = "/v1/realtime"
    #: How long a resuming connection may take to send its session.resume frame.
    resume_wait_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    max_connections: int = attrs.field(default=10_000, validator=attrs.validators.ge(1))
    #: Websocket keepalive; a peer that stops answering pings is treated as dropped (detach).
    ping_interval_s: float | None = attrs.field(default=20.0, validator=_none_or(attrs.validators.gt(0)))
    ping_timeout_s: float | None = attrs.field(default=20.0, validator=_none_or(attrs.validators.gt(0)))
    #: permessage-deflate ("deflate") when a client offers it, or None: never compress.
    compression: str | None = "deflate"
    #: More accepted keys (each session is bound to the key that opened it; see guard.py).
    api_keys: tuple[str, ...] = ()
    #: A send that has not drained after this long means the client stopped reading: the
    #: connection is closed with CLOSE_SLOW_CONSUMER (the session detaches, as for any drop).
    write_timeout_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    #: Flood policy: refused frames allowed per second (sustained) and at once (burst); past it
    #: the session closes (reason invalid_frame_flood, or backpressure_flood when the refusal
    #: that put the client over was of a valid frame, for room) and the connection with 1008.
    invalid_frames_per_s: float = attrs.field(default=20.0, validator=attrs.validators.gt(0))
    invalid_frames_burst: int = attrs.field(default=100, validator=attrs.validators.ge(1))
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
    #: per byte than audio does. A frame is billed the loop thread's CPU time, collections
    #: excepted (frame_cost). The default leaves a real-time client about twice what its audio
    #: through server VAD costs on an otherwise idle server (where an idle core runs the same
    #: work slower than a busy one does) before it is paced (docs/benchmarks.md). Past it, the
    #: session's next frame is read later, nothing refused. None: no pacing.
    frame_handling_s_per_s: float | None = attrs.field(
        default=0.1, validator=_none_or(attrs.validators.gt(0))
    )
    frame_handling_burst_s: float = attrs.field(default=0.25, validator=attrs.validators.gt(0))
    #: The loop shared by client (loop_share.py): once the frames of all clients together take
    #: more than this many seconds of the loop a second, a client (API key, else address) whose
    #: sessions take more than its fair share reads its next frames later. The per-session
    #: budgets above multiply with a client's sessions: many sessions of one key sending audio
    #: as fast as theirs allowed slowed a neighbour's turn many times over. None: not shared.
    loop_share_s_per_s: float | None = attrs.field(default=0.5, validator=_none_or(attrs.validators.gt(0)))
    #: ...and what each client may always take of it (seconds a second), however many share
    #: the loop: one real-time session's worth (audio through server VAD and a response's
    #: events). A storm of many addresses otherwise split the loop so thin that a user talking
    #: on one session was held.
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
    max_sessions_per_key: int | None = attrs.field(default=None, validator=_none_or(attrs.validators.ge(1)))
    max_sessions_per_address: int | None = attrs.field(
        default=None, validator=_none_or(attrs.validators.ge(1))
    )
    max_detached_sessions: int | None = attrs.field(default=None, validator=_none_or(attrs.validators.ge(1)))
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
    session_overrides: dict[str, Any] = attrs.field(factory=dict)
    #: Builds the voice activity model for server VAD, given the session's sample rate
    #: (None: Silero, which needs the 'embedded' extra). Tests plug a deterministic one in.
    vad_factory: Callable[[int], VoiceActivityModel] | None = None
    #: New sessions start as OpenAI's GA sessions do: server VAD on (when a VAD model can be
    #: loaded) with create_response. False: manual turns until a session.update turns it on.
    server_vad_by_default: bool = True
    #: Server VAD's windows of all sessions are scored together, in batches that fill for at
    #: most this long (vad_batch.py; a window that may end the user's turn never waits). At 40
    #: real-time sessions the VAD was half of the server's CPU one window at a time. 0: batch
    #: what arrives in one pass of the event loop. None: each window on its own, as its frame
    #: is handled.
    vad_batch_window_s: float | None = attrs.field(default=0.01, validator=_none_or(attrs.validators.ge(0)))
    #: A client's append is handled as websockets' parser hands it over, when nothing would
    #: hold it back, without waking the connection's reader for it (session_reader.py,
    #: "Frames handled as they are parsed"). False: every frame goes through the reader.
    handle_frames_as_parsed: bool = True
    #: Server VAD's quiet gate (audio/vad.py QUIET_DBFS): a stream's windows under this level,
    #: once it has been quiet a while and the network heard no speech, are answered without
    #: running the network. None: every window is scored. Not used with a ``vad_factory``.
    vad_quiet_dbfs: float | None = attrs.field(default=-60.0, validator=_none_or(attrs.validators.lt(0)))
    #: Server VAD's network: "float32" (Silero as shipped) or "int8" (its encoder's
    #: convolutions in int8: about half the VAD's CPU in batches, probabilities a few
    #: hundredths off; audio/vad.py). int8 is the 16 kHz network only: a session at another
    #: rate gets float32. Not used with a ``vad_factory``.
    vad_precision: str = attrs.field(default="float32", validator=attrs.validators.in_(("float32", "int8")))
    #: ``/metrics`` is rendered at most once in this long; scrapes in between get the last
    #: render (a render walks every session on the event loop, and the endpoint needs no key).
    metrics_max_age_s: float = attrs.field(default=1.0, validator=attrs.validators.ge(0))
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
    #: the rest wait unread, client addresses taking turns. In a mass resume this keeps each
    #: loop pass short for the sessions already talking. None: no limit.
    max_opening_connections: int | None = attrs.field(default=4, validator=_none_or(attrs.validators.gt(0)))
    #: Sessions one client address may hold while ``max_sessions_per_address`` is not set:
    #: past it a new session's handshake gets 429 (``exempt_networks`` excepted). None: none.
    default_sessions_per_address: int | None = attrs.field(
        default=256, validator=_none_or(attrs.validators.gt(0))
    )
    #: Client networks the default-on per-address limits above leave alone: loopback, where the
    #: clients are the operator's own (tests, benchmarks). Behind a reverse proxy, name it in
    #: ``trusted_proxies``: the limits then count the clients it forwards, and exempt them only
    #: where they are themselves in these networks.
    exempt_networks: tuple[str, ...] = attrs.field(default=guard.LOOPBACK_NETWORKS, validator=_networks)
    #: Reverse proxies (networks) whose ``X-Forwarded-For`` names the client (client_address.py):
    #: for a connection from one, quotas, connect rates, shares, exemptions and logs go by the
    #: address it forwards. Empty: every connection's client is its socket's peer.
    trusted_proxies: tuple[str, ...] = attrs.field(default=(), validator=_networks)
    #: How far permessage-deflate may inflate what a client sends (inflate.py); past it, close
    #: 1009. None: websockets' own limit only (``max_size``, the transport cap, per message).
    inflate_budget: InflateBudget | None = InflateBudget()
    #: What one client may hold parsed and not yet handled, over all its connections
    #: (read_ahead.py): past it, none of its connections is read until its readers have handled
    #: some of it. Never less than a whole message (the transport cap) and a piece
    #: (``PIECE_INFLATION_BYTES``), whatever is set. ``exempt_networks`` excepted. None: no
    #: bound over connections (each connection still bounds its own read queue).
    read_ahead_bytes_per_client: int | None = attrs.field(
        default=READ_AHEAD_BYTES_PER_CLIENT, validator=_none_or(attrs.validators.gt(0))
    )


#: How Realtime sessions differ from the runtime's embedder defaults: a commit only adds audio
#: to the conversation (a response needs response.create or server VAD's create_response), an
#: audio response streams its words once, as the audio's transcript, and the engine is asked
