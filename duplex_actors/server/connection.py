"""The server's websocket connection: websockets' own, with the client's control frames paced.

Why a subclass
--------------
websockets answers each ping with a pong from inside ``data_received``, before any reader of
ours sees a frame. Pings are therefore outside every other defence: the frame budget is charged
by the server's reader, the write deadline wraps the server's own sends, and the websocket's
read queue (``max_queue``) counts data frames only. A client sending 125-byte pings as fast as
its socket allows, and never reading, had the server answer 55,000 a second on this machine:
the pongs piled up in the transport's write buffer at ~6 MB/s until the keepalive gave up on
the client (20-40 s later, so ~250 MB for one connection, and a client may open many).

The pacing is the same as for the other intake budgets: a token bucket
(:class:`~.guard.IntakePacer`) over pings and pongs, and past it the connection reads its next
bytes later (``transport.pause_reading``), so TCP pushes back on the client. Nothing is refused.
websockets parses everything one read returns, so what a single read holds (at most 256 KiB,
~2,000 pings) is answered before the pause takes effect; that bounds the pongs a client can
leave unread. A client that stays paused past the keepalive's ping timeout cannot answer our
ping either, and is dropped as any unresponsive peer is.

websockets' own read queue pauses and resumes the same transport; the two reasons are kept
apart, and reading resumes only when neither holds it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial

import structlog
from websockets.asyncio.server import ServerConnection
from websockets.frames import Frame, Opcode
from websockets.http11 import Request

from .guard import IntakePacer

log = structlog.get_logger("duplex_actors.server")

#: Pings and pongs a client may send a second, and at once. Library clients ping every 5-30 s
#: and browsers never do; past this a client is flooding, and is paced, not refused.
CONTROL_FRAMES_PER_S = 5.0
CONTROL_FRAMES_BURST = 50


class ControlPacedConnection(ServerConnection):
    """A :class:`ServerConnection` that pauses reading while its client owes control frames.

    Configured per server by :func:`control_paced_connection` (class attributes, because
    websockets builds connections itself from a class)."""

    control_frames_per_s: float = CONTROL_FRAMES_PER_S
    control_frames_burst: float = CONTROL_FRAMES_BURST
    #: Told each wait (seconds) the pacing imposes: the server counts it in its metrics.
    on_paced: Callable[[float], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._holds: set[str] = set()
        self._control = IntakePacer(self.control_frames_per_s, self.control_frames_burst, self.loop.time())
        self._control_wait: asyncio.TimerHandle | None = None
        # The read queue's own flow control goes through the same gate.
        self.recv_messages.pause = partial(self._hold, "queue")
        self.recv_messages.resume = partial(self._release, "queue")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._control_wait is not None:
            # A flooder's debt can be minutes long: do not keep the connection alive for it.
            self._control_wait.cancel()
            self._control_wait = None
        super().connection_lost(exc)

    def process_event(self, event: Request | Frame) -> None:  # type: ignore[override]
        super().process_event(event)
        if isinstance(event, Frame) and event.opcode in (Opcode.PING, Opcode.PONG):
            self._control.spend(1.0, self.loop.time())
            if self._control_wait is None:
                self._pay_control_debt()

    @property
    def control_paced_s(self) -> float:
        """How long, in all, this connection's reads were held back for its control frames."""
        return self._control.waited_s

    def _pay_control_debt(self) -> None:
        self._control_wait = None
        wait = self._control.due(self.loop.time())
        if wait <= 0.0:
            self._release("control")
            return
        self._hold("control")
        if self._control.waited_s == wait:  # the first time: once per connection
            log.info(
                "server.client_paced",
                what="control",
                rate=self._control.rate,
                burst=self._control.burst,
                remote=str(self.remote_address),
            )
        if self.on_paced is not None:
            self.on_paced(wait)
        self._control_wait = self.loop.call_later(wait, self._pay_control_debt)

    def _hold(self, reason: str) -> None:
        if not self._holds:
            self.transport.pause_reading()
        self._holds.add(reason)

    def _release(self, reason: str) -> None:
        if reason in self._holds:
            self._holds.discard(reason)
            if not self._holds:
                self.transport.resume_reading()


def control_paced_connection(
    rate: float, burst: float, on_paced: Callable[[float], None] | None = None
) -> type[ServerConnection]:
    """The connection class a server hands websockets' ``serve(create_connection=...)``."""
    return type(
        "ControlPacedConnection",
        (ControlPacedConnection,),
        {
            "control_frames_per_s": rate,
            "control_frames_burst": burst,
            "on_paced": staticmethod(on_paced) if on_paced is not None else None,
        },
    )
