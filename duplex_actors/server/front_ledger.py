"""What the front of ``serve --workers`` knows about the connections it handed to its workers.

Theory of operation
-------------------
The front accepts a connection, passes the socket to a worker and keeps its own duplicate of
it. The worker reports, over the hand-off socket (:mod:`.worker_link`), which session each
connection carries and when each response of a session starts and ends. Nothing else of the
session reaches the front: frames go straight from the worker to the client.

When a worker process dies, by a crash or ``kill -9``, its sockets stay open because the front
still holds them, and the front can still speak on them: for every connection the dead worker
had, :meth:`FrontLedger.farewell` gives the websocket frames that end it properly, one
``response.done`` (status ``failed``, code ``worker_lost``) per response that had started and
not ended, then ``session.closed`` (reason ``worker_lost``), then a close frame with
:data:`CLOSE_WORKER_LOST`. These are server frames, unmasked and uncompressed (RFC 7692 lets
either end send any message uncompressed), so no compression state is needed.

This module is sans-IO: it holds tables and builds bytes, and never touches a socket.
"""

from __future__ import annotations

import json
import secrets
import struct
from collections.abc import Callable
from typing import Any

import attrs

from .. import errors
from . import raw_http
from .config import CLOSE_UNKNOWN_SESSION
from .wire import transport_error

#: The close code a client gets when the worker process holding its session died: RFC 6455's
#: "internal error" (the server hit a condition it could not recover from). The session cannot
#: be resumed; a resume of it is refused with ``session_lost`` (4404).
CLOSE_WORKER_LOST = 1011
WORKER_LOST = "worker_lost"


@attrs.define(slots=True)
class _Handed:
    worker: int
    session_id: str | None = None
    #: The session a resume asks for (its request line's ``session_id``), until one is attached.
    resuming: str | None = None
    #: Whether the worker answered the websocket handshake (it reports it just before): until
    #: then the client reads an HTTP response, not websocket frames.
    answered: bool = False
    #: Whom it counts for among the new sessions (its client's address subject, its API key's
    #: subject): none for a resume or a request that is not for a session.
    clients: tuple[str, ...] = ()


@attrs.define(slots=True)
class FrontLedger:
    """Connections handed to each worker, the session on each, and each session's responses
    that started and have not ended, as the workers reported them; and how many connections
    for a new session each client has with the workers, all of them together."""

    _connections: dict[int, _Handed] = attrs.field(factory=dict)
    _responses: dict[str, list[str]] = attrs.field(factory=dict)
    _next_id: int = 0
    _by_client: dict[str, int] = attrs.field(factory=dict)
    #: The worker a session id names (front_door.owner_of): a dead worker's sessions are
    #: forgotten with it, those without a connection included.
    owner: Callable[[str], int | None] = attrs.field(default=lambda _session_id: None, kw_only=True)

    def handed(self, worker: int, resuming: str | None = None, *clients: str) -> int:
        """A connection goes to ``worker`` (``resuming``: the session its request line asks to
        resume; ``clients``: whom it counts for, a new session's): its id, which the worker's
        reports name."""
        self._next_id += 1
        self._connections[self._next_id] = _Handed(worker, resuming=resuming, clients=clients)
        by_client = self._by_client
        for client in clients:
            by_client[client] = by_client.get(client, 0) + 1
        return self._next_id

    def clients_of(self, connection: int) -> tuple[str, ...]:
        """Whom a held connection counts for (none once released)."""
        handed = self._connections.get(connection)
        return () if handed is None else handed.clients

    def sessions_of(self, client: str) -> int:
        """Connections for a new session ``client`` has with the workers now (handed, not
        yet released by their worker)."""
        return self._by_client.get(client, 0)

    def _forget(self, handed: _Handed) -> None:
        by_client = self._by_client
        for client in handed.clients:
            left = by_client[client] - 1
            if left:
                by_client[client] = left
            else:
                del by_client[client]

    def answering(self, connection: int) -> None:
        handed = self._connections.get(connection)
        if handed is not None:
            handed.answered = True

    def attached(self, connection: int, session_id: str) -> None:
        handed = self._connections.get(connection)
        if handed is not None:
            handed.answered = True  # a session is attached only after the handshake
            handed.session_id = session_id

    def response_started(self, session_id: str, response_id: str) -> None:
        open_ = self._responses.setdefault(session_id, [])
        if response_id not in open_:
            open_.append(response_id)

    def response_ended(self, session_id: str, response_id: str) -> None:
        open_ = self._responses.get(session_id)
        if open_ is not None and response_id in open_:
            open_.remove(response_id)
            if not open_:
                del self._responses[session_id]

    def session_ended(self, session_id: str) -> None:
        self._responses.pop(session_id, None)

    def released(self, connection: int) -> bool:
        """The worker is done with the connection; whether the front still held it."""
        handed = self._connections.pop(connection, None)
        if handed is None:
            return False
        self._forget(handed)
        return True

    def held(self) -> int:
        return len(self._connections)

    def unattached(self, worker: int) -> list[int]:
        """``worker``'s connections that carry no session (yet): what it has not reported on."""
        return [
            cid
            for cid, handed in self._connections.items()
            if handed.worker == worker and handed.session_id is None
        ]

    def of_worker(self, worker: int) -> list[int]:
        return [cid for cid, handed in self._connections.items() if handed.worker == worker]

    def worker_lost(self, worker: int) -> dict[int, bytes]:
        """Every connection the dead ``worker`` held, with the frames that end it; the worker's
        connections and sessions are forgotten."""
        handed_over = {connection: self._connections.pop(connection) for connection in self.of_worker(worker)}
        for handed in handed_over.values():
            self._forget(handed)
        # Each session's open responses, taken once for all its connections: a session may be
        # on more than one (a dropped connection the worker has not yet released, beside the
        # client's resumed one). Taken by the first, the responses' ends went to a connection
        # whose client had left, and the client on the new one got session.closed alone.
        sessions = {h.session_id or h.resuming for h in handed_over.values()}
        responses = {sid: self._responses.pop(sid, []) for sid in sessions if sid is not None}
        # Its sessions without a connection (detached, waiting for a resume) died with it too:
        # nobody is left to tell, and nothing would ever end them here.
        for sid in [sid for sid in self._responses if self.owner(sid) == worker]:
            del self._responses[sid]
        farewells = {}
        for connection, handed in handed_over.items():
            session_id = handed.session_id
            if not handed.answered:
                # Its client still waits for the handshake's HTTP answer: websocket frames would
                # read as a broken HTTP response. A 503 says to try again, which reaches a living
                # worker (a resume of the lost session is then refused as lost, as below).
                farewells[connection] = raw_http.refusal(
                    503, "Service Unavailable", "the worker serving this connection was lost; try again", 1
                )
                continue
            if session_id is None and handed.resuming is not None:
                # A resume the worker had not answered: its session died with the worker, and
                # the client gets what a resume sent a moment later gets from a living worker.
                farewells[connection] = resume_refused_as_lost()
                continue
            farewells[connection] = farewell(session_id, responses.get(session_id, []) if session_id else [])
        return farewells


def farewell(session_id: str | None, responses: list[str]) -> bytes:
    """The frames that end a connection whose worker died: a failed ``response.done`` for each
    response in flight, ``session.closed``, and the close frame."""
    frames = [_text_frame(_response_failed(session_id, rid)) for rid in responses]
    if session_id is not None:
        frames.append(_text_frame(_event("session.closed", reason=WORKER_LOST)))
    frames.append(_close_frame(CLOSE_WORKER_LOST, "worker lost: the session is gone"))
    return b"".join(frames)


def resume_refused_as_lost() -> bytes:
    """The frames that refuse a resume of a session lost with its worker: the ``error``
    (``session_lost``) and close code a living worker answers such a resume with."""
    refusal = transport_error(errors.WorkerLost(errors.WORKER_LOST))
    return _text_frame(refusal) + _close_frame(CLOSE_UNKNOWN_SESSION, refusal["error"]["code"])


def _event(kind: str, **body: Any) -> dict[str, Any]:
    # Not part of the session's numbered stream (the worker that numbered it is gone): no seq,
    # as for every event sent outside a session's stream.
    return {
        "type": kind,
        "event_id": f"evt_front_{secrets.token_hex(4)}",
        "server_event_seq": None,
        "epoch": None,
        **body,
    }


def _response_failed(session_id: str | None, response_id: str) -> dict[str, Any]:
    return _event(
        "response.done",
        response={
            "id": response_id,
            "object": "realtime.response",
            "status": "failed",
            "status_details": {
                "type": "failed",
                "duplex_reason": WORKER_LOST,
                "error": {"type": "server_error", "code": WORKER_LOST},
            },
            "output": [],
            "conversation_id": None if session_id is None else f"conv_{session_id[-24:]}",
            "usage": None,
        },
    )


def _text_frame(event: dict[str, Any]) -> bytes:
    return _frame(0x1, json.dumps(event, separators=(",", ":")).encode())


def _close_frame(code: int, reason: str) -> bytes:
    return _frame(0x8, struct.pack("!H", code) + reason.encode()[:120])


def _frame(opcode: int, payload: bytes) -> bytes:
    """One final, unmasked websocket frame (RFC 6455 section 5.2): what a server sends."""
    size = len(payload)
    if size < 126:
        header = struct.pack("!BB", 0x80 | opcode, size)
    elif size < 1 << 16:
        header = struct.pack("!BBH", 0x80 | opcode, 126, size)
    else:
        header = struct.pack("!BBQ", 0x80 | opcode, 127, size)
    return header + payload


__all__ = ["CLOSE_WORKER_LOST", "WORKER_LOST", "FrontLedger", "farewell", "resume_refused_as_lost"]
