"""The web console's HTTP side: its static files at ``/`` and ``/console/*``, and the operator
view's JSON at ``/v1/operator``.

The page and its scripts live in the package (``duplex_actors/console/``) and are served as
they are: nothing is fetched from elsewhere at run time. The page itself is public (it holds no
secret; it asks the user for the API key and sends it as the websocket subprotocol
``openai-insecure-api-key.<key>``, as browsers must). The operator JSON says what sessions
exist and in what state, so it is behind the same key as ``/v1/realtime``.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import time
from http import HTTPStatus
from importlib import resources
from typing import TYPE_CHECKING, Any

from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from . import guard

if TYPE_CHECKING:
    from websockets.asyncio.server import ServerConnection

    from .app import RealtimeServer

OPERATOR_PATH = "/v1/operator"
CONSOLE_PREFIX = "/console/"
#: Sessions listed one by one in the operator JSON at most (the counts cover all of them).
OPERATOR_SESSIONS = 200

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
# The page may talk only to this server (its own origin, over ws/wss), and load only its own
# files: a console must not pull scripts from anywhere else.
_CSP = (
    "default-src 'self'; connect-src 'self' ws: wss:; img-src 'self' data:; "
    "media-src 'self' blob:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)


def console_files() -> dict[str, bytes]:
    """The console's files by name, read once from the package."""
    root = resources.files("duplex_actors").joinpath("console")
    out = {}
    for entry in root.iterdir():
        name = entry.name
        suffix = name[name.rfind(".") :] if "." in name else ""
        if entry.is_file() and suffix in _TYPES:
            out[name] = entry.read_bytes()
    return out


class ConsoleRoutes:
    """What ``http_gate.HttpGate`` hands the console's paths to."""

    def __init__(self, server: RealtimeServer) -> None:
        self._server = server
        self._files: dict[str, bytes] | None = None
        self._lag = LoopLagProbe()
        #: The last operator body and when it was made; ``renders`` counts snapshots taken.
        self._operator_body: tuple[float, bytes] | None = None
        self.renders = 0

    def handles(self, path: str) -> bool:
        return path == "/" or path == OPERATOR_PATH or path.startswith(CONSOLE_PREFIX)

    def respond(self, connection: ServerConnection, request: Request, path: str) -> Response:
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return _plain(
                connection,
                404,
                f"not a websocket endpoint; the realtime endpoint is {self._server.config.path}\n",
            )
        if path == OPERATOR_PATH:
            return self._operator(connection, request)
        if self._files is None:
            self._files = console_files()
        name = "index.html" if path == "/" else path[len(CONSOLE_PREFIX) :]
        body = self._files.get(name)  # only the package's own files: no path is ever joined
        if body is None:
            return _plain(connection, 404, "not found\n")
        return _response(200, body, _TYPES[name[name.rfind(".") :]], {"Content-Security-Policy": _CSP})

    def close(self) -> None:
        self._lag.stop()

    def _operator(self, connection: ServerConnection, request: Request) -> Response:
        server = self._server
        keys = server._keys
        if keys and guard.accepted_key(request.headers, keys) is None:
            server.metrics.auth_refused.inc()
            response = _plain(
                connection, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'\n"
            )
            response.headers["WWW-Authenticate"] = 'Bearer realm="duplex-actors"'
            return response
        self._lag.start()
        # A snapshot walks every session on the event loop: made at most once per
        # metrics_max_age_s, as /metrics is, however many operators poll.
        now = server.runtime.clock.now()
        cached = self._operator_body
        if cached is None or now - cached[0] >= server.config.metrics_max_age_s:
            body = json.dumps(operator_snapshot(server, self._lag), separators=(",", ":")) + "\n"
            cached = self._operator_body = (now, body.encode())
            self.renders += 1
        return _response(200, cached[1], "application/json", {"Cache-Control": "no-store"})


def operator_snapshot(server: RealtimeServer, lag: LoopLagProbe | None = None) -> dict[str, Any]:
    """Live sessions by state, the engine's load, queue depths and the event loop's lag."""
    runtime = server.runtime
    stats = runtime.statistics()
    engine = stats.engine
    depth_total = depth_max = detached = 0
    sessions: list[dict[str, Any]] = []
    for handle in runtime.sessions():
        depth = handle.mailbox_depth()
        depth_total += depth
        depth_max = max(depth_max, depth)
        if handle.detached:
            detached += 1
        if len(sessions) < OPERATOR_SESSIONS:
            sessions.append(
                {
                    "id": handle.id,
                    "state": handle.state,
                    "epoch": handle.epoch,
                    "turn_id": handle.turn_id,
                    "response_id": handle.response_id,
                    "mailbox": depth,
                    "detached": handle.detached,
                }
            )
    return {
        "engine": getattr(runtime.backend, "name", type(runtime.backend).__name__),
        "sessions": {
            "open": stats.sessions,
            "by_state": dict(stats.sessions_by_state),
            "detached": detached,
            "listed": sessions,
        },
        "engine_requests": {
            "in_flight": engine.in_flight,
            "submitted": engine.submitted,
            "completed": engine.completed,
            "aborted": engine.aborted,
            "failed": engine.failed,
        },
        "queues": {"mailbox_total": depth_total, "mailbox_max": depth_max, "sessions_ready": stats.ready},
        "connections": server.connection_count,
        "loop_lag_ms": None if lag is None else lag.snapshot(),
    }


class LoopLagProbe:
    """How late the event loop runs a timer: a task sleeps ``interval_s`` and records by how
    much it overslept. Started by the first operator request (a server nobody watches pays
    nothing), stopped with the server."""

    def __init__(self, interval_s: float = 0.1, window: int = 50) -> None:
        self.interval_s = interval_s
        self._window = window
        self._samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            late = time.perf_counter() - before - self.interval_s
            self._samples.append(max(0.0, late) * 1000.0)
            del self._samples[: -self._window]

    def snapshot(self) -> dict[str, Any] | None:
        if not self._samples:
            return None
        return {
            "last": round(self._samples[-1], 2),
            "max": round(max(self._samples), 2),
            "mean": round(sum(self._samples) / len(self._samples), 2),
            "window_s": round(len(self._samples) * self.interval_s, 1),
        }


def _plain(connection: ServerConnection, status: int, text: str) -> Response:
    return connection.respond(status, text)


def _response(status: int, body: bytes, content_type: str, extra: dict[str, str]) -> Response:
    headers = Headers(
        [
            ("Date", email.utils.formatdate(usegmt=True)),
            ("Connection", "close"),
            ("Content-Length", str(len(body))),
            ("Content-Type", content_type),
            ("Cache-Control", "no-cache"),
            ("X-Content-Type-Options", "nosniff"),
        ]
    )
    for name, value in extra.items():
        if name in headers:
            del headers[name]
        headers[name] = value
    return Response(status, HTTPStatus(status).phrase, headers, body)
