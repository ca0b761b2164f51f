"""The HTTP side of the Realtime server: what answers a request before any websocket exists.

``/health``, ``/metrics`` and the console's paths are answered here; a request for the
realtime endpoint is authenticated (API keys), held to the connect rates and per-address
limits, and, while its client is over its share of the event loop, made to wait before its
handshake completes. Whatever passes goes on to the websocket handshake (``app.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

import anyio
import structlog
from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from . import guard, wire
from .client_address import FORWARDED_FOR, client_ip, describe_peer, forwarded_client, peer_ip
from .connection import PacedConnection

if TYPE_CHECKING:
    from .app import RealtimeServer

log = structlog.get_logger("duplex_actors.server")

#: What a connection's opening and closing cost the loop, charged to its client's share at the
#: handshake (an estimate: the upgrade, the session, its first events and the close happen
#: around awaits and cannot be timed as one piece).
HANDSHAKE_COST_S = 0.001


class HttpGate:
    """``serve(process_request=...)`` of a :class:`~.app.RealtimeServer` (module docstring)."""

    __slots__ = ("server",)

    def __init__(self, server: RealtimeServer) -> None:
        self.server = server

    def __call__(self, connection: ServerConnection, request: Request) -> Response | Awaitable[None] | None:
        server = self.server
        if server.config.trusted_proxies and getattr(connection, "client_ip", None) is None:
            # Everything below (and the session's quotas and logs) counts the client the
            # proxy forwards: read once, from the request that has the header, unless the
            # opening slot already read it from the raw head (connection.py).
            connection.client_ip = forwarded_client(  # type: ignore[attr-defined]
                peer_ip(connection),
                request.headers.get_all(FORWARDED_FOR),
                guard.exempt_from(server.config.trusted_proxies),
            )
        path = urlsplit(request.path).path.rstrip("/") or "/"
        if path == "/health":
            body = {
                "status": "ok",
                "sessions": server.runtime.session_count,
                "connections": server._connections,
            }
            return _respond(connection, 200, json.dumps(body) + "\n", "application/json")
        if path == "/metrics":
            payload, content_type = server.metrics.render(
                server.runtime.clock.now(), server.config.metrics_max_age_s
            )
            return _respond(connection, 200, payload.decode("utf-8"), content_type)
        if server.console.handles(path):  # the web console and its operator JSON (console.py)
            return server.console.respond(connection, request, path)
        if path != server.config.path.rstrip("/"):
            return _respond(connection, 404, f"not found; the realtime endpoint is {server.config.path}\n")
        key = guard.accepted_key(request.headers, server._keys) if server._keys else None
        if server._keys and key is None:
            server.metrics.auth_refused.inc()
            log.info("server.auth_refused", remote=describe_peer(connection))
            response = _respond(
                connection, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'\n"
            )
            response.headers["WWW-Authenticate"] = 'Bearer realm="duplex-actors"'
            return response
        if server.connect_rates:
            refused = self._connect_rate_refusal(connection, key)
            if refused is not None:
                return refused
        refused = self._default_address_limit(connection, request)
        if refused is not None:
            return refused
        if server._connections >= server.config.max_connections:
            return _respond(connection, 503, "too many connections; retry later\n")
        if server.loop_share is not None:
            # A client over its share of the loop opens its next connection once it is back
            # within it. Held only at its frames, a client that opened a session, asked for a
            # response and dropped the connection, over and over, never waited: its next
            # connection was open before the held frame was handled.
            tenant = _tenant(guard.key_digest(key) if server._keys else None, _address(connection))
            now = server.runtime.clock.now()
            # A handshake's work (the HTTP upgrade, the session, its first events, the close)
            # happens around awaits and cannot be timed as one piece: it is charged at an
            # estimate.
            server.loop_share.charge(tenant, HANDSHAKE_COST_S, now)
            held = server.loop_share.hold(tenant, now)
            if held:
                # Waiting takes no CPU, so the wait holds no opening slot: a client over its
                # share must not keep the handshakes of everyone else waiting with it.
                if isinstance(connection, PacedConnection):
                    connection.handshake_done()
                return self._handshake_when_within_share(tenant, held)  # websockets awaits it
        return None

    async def _handshake_when_within_share(self, tenant: str, held: float) -> None:
        """Wait until ``tenant`` is within its loop share, then let its handshake go on
        (websockets' ``open_timeout``, 10 s, bounds the whole handshake)."""
        server = self.server
        share = server.loop_share
        assert share is not None
        while held:
            server.metrics.paced.labels("client_share").inc(held)
            await anyio.sleep(held)
            held = share.hold(tenant, server.runtime.clock.now())

    def _default_address_limit(self, connection: ServerConnection, request: Request) -> Response | None:
        """429 for a new session from an address already holding ``default_sessions_per_address``,
        or for a resume from one with that many connections waiting to resume (only while no
        ``max_sessions_per_address`` is set, which bounds both itself)."""
        server = self.server
        limit = server.config.default_sessions_per_address
        if limit is None or server.config.max_sessions_per_address is not None:
            return None
        address = _address(connection)
        resuming = "session_id" in parse_qs(urlsplit(request.path).query)
        held = server.quotas.resuming_of(address) if resuming else server.quotas.sessions_of(address)
        if held < limit:
            return None
        if guard.exempt_from(server.config.exempt_networks)(client_ip(connection)):
            return None
        server.metrics.connects_refused.labels("address_sessions").inc()
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
        server = self.server
        now = server.runtime.clock.now()
        for by, rate in server.connect_rates.items():
            subject = _address(connection) if by == "address" else guard.key_digest(key)
            if subject is None:
                continue  # no key configured or presented: only the address counts
            wait = rate.admit(subject, now)
            if wait > 0.0:
                server.metrics.connects_refused.labels(by).inc()
                retry = max(1, math.ceil(wait))
                response = _respond(
                    connection, 429, f"too many new connections for this {by}; retry in {retry} s\n"
                )
                response.headers["Retry-After"] = str(retry)
                return response
        return None


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
    return guard.client_subject(client_ip(ws))


def _intent(ws: ServerConnection) -> str | None:
    """What a new session's connection asks to be (its ``intent`` query parameter, as OpenAI
    reads it): None for a realtime session, "transcription" for a transcription session."""
    assert ws.request is not None, "websockets calls the handler after the handshake"
    intents = parse_qs(urlsplit(ws.request.path).query).get("intent")
    if not intents or intents[-1] in ("conversation", "realtime"):
        return None
    if intents[-1] == "transcription":
        return "transcription"
    raise wire.NotSupported(
        f"intent {intents[-1][:64]!r} is not supported: intent=transcription, or none for a realtime session",
        param="intent",
    )
