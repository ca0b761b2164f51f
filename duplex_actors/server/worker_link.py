"""The hand-off socket between the front of ``serve --workers`` and one worker, both ways.

The front passes each accepted socket with a ``["c", connection_id]`` message (the socket rides
along as ``SCM_RIGHTS``), tells every worker the pool's state with ``["m", {...}]``, and at its
own shutdown tells each to drain (``["d"]``), then, on a second signal, to cut the drain short
(``["h"]``). The
worker reports what the front needs to end its connections should the worker die
(:mod:`.front_ledger`):

* ``["a", connection, session_id]``: a session is attached to the connection (opened, resumed);
* ``["r", session_id, response_id]`` / ``["d", session_id, response_id]``: a response's
  ``response.created`` / ``response.done`` went to its client;
* ``["e", session_id]``: the session closed;
* ``["x", connection]``: the worker is done with the socket (the front closes its duplicate);
* ``["s"]``: the worker is draining (a SIGTERM to its own pid): it refuses new sessions, so the
  front sends new connections to the other workers;
* ``["q", n]``: the answer to the front's ping ``["p", n]``, sent from the worker's loop, so it
  says the loop still turns (:mod:`.worker_liveness`).

Each message is one ``SOCK_SEQPACKET`` packet of compact JSON: the kernel keeps their
boundaries, and a few per response cost nothing next to the response's own frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections import deque
from typing import Any

import structlog

log = structlog.get_logger("duplex_actors.server.worker_link")

#: At most this many reports wait for a full hand-off socket; past it the oldest are dropped
#: (the front then knows less about this worker's responses, nothing worse).
MAX_PENDING_REPORTS = 65_536
SEND_BUFFER_BYTES = 1 << 20


#: One encoder for every report: json.dumps with separators builds a new one per call.
_encode = json.JSONEncoder(separators=(",", ":")).encode


def pack(*message: Any) -> bytes:
    return _encode(message).encode()


def unpack(packet: bytes) -> list[Any]:
    message = json.loads(packet)
    if not isinstance(message, list) or not message or not isinstance(message[0], str):
        raise ValueError(f"not a hand-off message: {packet[:80]!r}")
    return message


class FrontLink:
    """The worker's end: reports to the front, never blocking the worker's loop."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        # The front reads reports in batches (front_door.REPORT_BATCH_S): room for a batch's worth
        # here keeps the worker off the slow path below (the kernel caps it at wmem_max).
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._pending: deque[bytes] = deque(maxlen=MAX_PENDING_REPORTS)
        self._writing = False
        self.lost = False  # the front went away: nothing is reported any more

    def attached(self, connection: int, session_id: str) -> None:
        self._send(pack("a", connection, session_id))

    def answering(self, connection: int) -> None:
        """The connection's handshake is about to be answered (101): from here its client reads
        websocket frames, not an HTTP response."""
        self._send(pack("h", connection))

    def response_started(self, session_id: str, response_id: str) -> None:
        self._send(pack("r", session_id, response_id))

    def response_ended(self, session_id: str, response_id: str) -> None:
        self._send(pack("d", session_id, response_id))

    def session_ended(self, session_id: str) -> None:
        self._send(pack("e", session_id))

    def released(self, connection: int) -> None:
        self._send(pack("x", connection))

    def draining(self) -> None:
        self._send(pack("s"))

    def answer_ping(self, number: int) -> None:
        self._send(pack("q", number))

    def _send(self, packet: bytes) -> None:
        if self.lost:
            return
        if self._pending:
            self._pending.append(packet)
            return
        try:
            self._sock.send(packet)
        except BlockingIOError:
            self._pending.append(packet)
            self._wait_writable()
        except OSError:
            self.lost = True

    def _wait_writable(self) -> None:
        if self._writing:
            return
        self._writing = True
        asyncio.get_running_loop().add_writer(self._sock.fileno(), self._flush)

    def _flush(self) -> None:
        while self._pending:
            try:
                self._sock.send(self._pending[0])
            except BlockingIOError:
                return
            except OSError:
                self.lost = True
                self._pending.clear()
                break
            self._pending.popleft()
        self._writing = False
        with contextlib.suppress(OSError, ValueError):
            asyncio.get_running_loop().remove_writer(self._sock.fileno())


__all__ = ["FrontLink", "pack", "unpack", "MAX_PENDING_REPORTS"]
