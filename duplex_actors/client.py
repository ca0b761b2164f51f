"""DuplexClient: an asyncio client of ``duplex-actors serve`` that survives dropped connections.

::

    async with await DuplexClient.connect("ws://127.0.0.1:8765/v1/realtime", api_key=key) as c:
        await c.send_audio(pcm)             # pcm16 at 24 kHz unless the session declared another
        await c.commit()                    # adds the audio to the conversation (GA) ...
        await c.create_response()           # ... and this asks for the reply
        async for event in c.events():      # dicts, exactly as sent by the server
            ...

Events arrive as the server's JSON dicts, in ``server_event_seq`` order, each exactly once.
A background task reads the socket; when the connection drops without a clean close it
reconnects with ``?session_id=`` and sends ``session.resume`` with the resume token and the
last ``server_event_seq`` it received; the server replays what was missed, then sends
``session.resumed``. Events with a seq the client already has are dropped, so a replay that
overlaps what arrived is harmless.

Audio goes out as binary frames (raw audio, no JSON or base64: with 16 kHz input too, about
40 % less of the server's CPU a frame without server VAD, 20 % with it) once the session has
the binary-audio extension on: send ``session.update`` with
``{"duplex": {"binary_audio": true}}`` (docs/protocol.md). The client switches only on the
server's confirmation, and back to text frames before its own update that turns the extension
off reaches the socket, so no frame is sent in a form the server would refuse.

Delivery of *commands* is at most once across a drop: a frame the old socket accepted but the
server never read is lost (the server's events tell what happened, e.g. the committed audio
length). A send attempted while the link is down waits for the resume and then goes out.

A resume refused by the server (unknown or expired session, token conflict, journal overflow)
is final: the refusal's ``error`` event is delivered, then ``events()`` raises
:class:`SessionLost`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import secrets
import ssl as ssl_module
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import anyio
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from .errors import DuplexError

_END = object()


class ClientConnectionError(DuplexError):
    """The server could not be reached or refused the websocket handshake."""

    code = "connection_failed"

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class AuthenticationFailed(ClientConnectionError):
    code = "unauthorized"


class SessionLost(DuplexError):
    """The session cannot be continued: resume refused, or reconnecting gave up."""

    code = "session_lost"

    def __init__(self, message: str, *, close_code: int | None = None) -> None:
        super().__init__(message)
        self.close_code = close_code


class DuplexClient:
    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        auto_reconnect: bool = True,
        max_reconnect_attempts: int = 8,
        reconnect_backoff_s: float = 0.05,
        reconnect_backoff_max_s: float = 2.0,
        open_timeout_s: float = 5.0,
        send_timeout_s: float = 30.0,
        queue_size: int = 4096,
        ssl: ssl_module.SSLContext | None = None,
    ) -> None:
        self.url = url
        self.api_key = api_key
        #: For a wss:// server whose certificate the system does not trust (a private CA, a
        #: self-signed one): the context that does. None: the system's defaults.
        self.ssl = ssl
        self.auto_reconnect = auto_reconnect
        self.max_reconnect_attempts = max_reconnect_attempts
        self.reconnect_backoff_s = reconnect_backoff_s
        self.reconnect_backoff_max_s = reconnect_backoff_max_s
        self.open_timeout_s = open_timeout_s
        self.send_timeout_s = send_timeout_s
        # Session identity, learned from session.created / session.resumed.
        self.session_id: str | None = None
        self.resume_token: str | None = None
        self.generation = 0
        self.last_seq = 0
        self.session_closed = False
        #: The server's latest session.updated had the binary-audio extension on. Audio goes
        #: out in binary frames only while this holds and no session.update of ours is
        #: unanswered: the server applies updates in order, so before the answer to the last
        #: one, this client cannot know what a binary frame would meet.
        self.binary_audio = False
        self._updates_unanswered: deque[str] = deque()  # their event_ids, oldest first
        # What the link has been through (for applications and tests).
        self.reconnects = 0
        self.duplicates_dropped = 0
        self.gaps = 0
        self._ws: ClientConnection | None = None
        self._connected = asyncio.Event()
        # Unbounded so the end marker always fits; the pump stops reading at queue_size
        # (backpressure reaches the server through TCP) until the consumer catches up.
        # Server events (dict[str, Any]), then the _END marker.
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._queue_size = queue_size
        self._drained = asyncio.Event()
        self._pump_task: asyncio.Task[None] | None = None
        self._closing = False
        self._failure: BaseException | None = None
        self._resume_control: tuple[int, str, str] | None = None  # generation, token, control_id
        self._ids = itertools.count(1)
        self._id_prefix = secrets.token_hex(3)

    # -- connecting -------------------------------------------------------------------------

    @classmethod
    async def connect(cls, url: str, api_key: str | None = None, **options: Any) -> DuplexClient:
        client = cls(url, api_key=api_key, **options)
        await client.start()
        return client

    async def start(self) -> None:
        self._ws = await self._open()
        self._connected.set()
        self._pump_task = asyncio.create_task(self._pump(), name="duplex-client-pump")

    async def __aenter__(self) -> DuplexClient:
        if self._pump_task is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _open(self, resume_session: str | None = None) -> ClientConnection:
        url = self.url
        if resume_session is not None:
            parts = urlsplit(url)
            query = [(k, v) for k, v in parse_qsl(parts.query) if k != "session_id"]
            query.append(("session_id", resume_session))
            url = urlunsplit(parts._replace(query=urlencode(query)))
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            tls: dict[str, Any] = {"ssl": self.ssl} if self.ssl is not None else {}
            return await ws_connect(
                url, additional_headers=headers, open_timeout=self.open_timeout_s, max_size=None, **tls
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            body = exc.response.body.decode("utf-8", "replace").strip() if exc.response.body else ""
            error = AuthenticationFailed if status == 401 else ClientConnectionError
            raise error(f"server refused the connection: HTTP {status} {body}", status=status) from None
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            raise ClientConnectionError(f"cannot connect to {url}: {exc!r}") from None

    # -- receiving --------------------------------------------------------------------------

    async def _pump(self) -> None:
        try:
            while True:
                ws = self._ws
                assert ws is not None, "start() opens the connection before the pump"
                try:
                    async for raw in ws:
                        await self._on_message(raw)
                except ConnectionClosed:
                    pass
                self._connected.clear()
                if self._closing or self.session_closed:
                    return
                rcvd = ws.protocol.close_rcvd
                code = rcvd.code if rcvd is not None else None
                if rcvd is not None and (rcvd.code == 1000 or 4000 <= rcvd.code < 5000):
                    # A deliberate close by the server: the session ended or the resume was
                    # refused (its error event has been delivered). Not a network failure.
                    self._failure = SessionLost(
                        f"server closed the connection: {code} {rcvd.reason}", close_code=code
                    )
                    return
                if not self.auto_reconnect or self.session_id is None:
                    self._failure = SessionLost("connection lost", close_code=code)
                    return
                if not await self._reconnect():
                    return
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surface anything unexpected to the consumer
            self._failure = exc
        finally:
            self._connected.set()  # wake blocked senders; they will see the failure
            self._queue.put_nowait(_END)

    async def _on_message(self, raw: str | bytes) -> None:
        try:
            event = json.loads(raw)
        except ValueError:
            return  # the server only sends JSON; ignore anything else
        if not isinstance(event, dict):
            return
        seq = event.get("server_event_seq")
        if isinstance(seq, int):
            if seq <= self.last_seq:
                self.duplicates_dropped += 1
                return
            if seq != self.last_seq + 1:
                self.gaps += 1
            self.last_seq = seq
        kind = event.get("type")
        if kind == "session.created":
            session = event.get("session") or {}
            self.session_id = session.get("id", self.session_id)
            self.resume_token = event.get("resume_token", self.resume_token)
            self.generation = 0
        elif kind == "session.updated":
            # Each update is answered once, in order: this answers the oldest one unanswered.
            if self._updates_unanswered:
                self._updates_unanswered.popleft()
            duplex = (event.get("session") or {}).get("duplex") or {}
            self.binary_audio = duplex.get("binary_audio") is True
        elif kind == "error":
            # A refused update changed nothing: the state stays what the last answer said.
            refused = (event.get("error") or {}).get("event_id")
            if isinstance(refused, str) and refused in self._updates_unanswered:
                self._updates_unanswered.remove(refused)
        elif kind == "session.resumed":
            self.generation = event.get("generation", self.generation)
            self.resume_token = event.get("resume_token", self.resume_token)
            self._resume_control = None
            if self._updates_unanswered:
                # Updates the old connection carried and the replay did not answer were lost,
                # or their answers are still to come: text frames until one arrives.
                self._updates_unanswered.clear()
                self.binary_audio = False
            self._connected.set()
        elif kind == "session.closed":
            self.session_closed = True
        self._queue.put_nowait(event)
        while self._queue.qsize() >= self._queue_size:
            self._drained.clear()
            await self._drained.wait()

    def _take(self, item: object) -> object:
        if self._queue.qsize() <= self._queue_size // 2:
            self._drained.set()
        return item

    async def _reconnect(self) -> bool:
        delay = self.reconnect_backoff_s
        last_error: BaseException | None = None
        for _ in range(self.max_reconnect_attempts):
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.reconnect_backoff_max_s)
            try:
                ws = await self._open(resume_session=self.session_id)
            except AuthenticationFailed as exc:
                self._failure = SessionLost(f"reconnect refused: {exc.message}")
                return False
            except ClientConnectionError as exc:
                last_error = exc
                continue
            # Retrying the same resume (its answer may have been lost with the link) reuses
            # the control id, so the server treats it as the same request, not a conflict.
            key = (self.generation, self.resume_token or "")
            if self._resume_control is None or self._resume_control[:2] != key:
                self._resume_control = (*key, f"resume_{secrets.token_hex(6)}")
            frame = {
                "type": "session.resume",
                "event_id": self._next_id(),
                "session_id": self.session_id,
                "generation": self.generation,
                "resume_token": self.resume_token,
                "last_seq": self.last_seq,
                "control_id": self._resume_control[2],
            }
            try:
                await ws.send(json.dumps(frame))
            except ConnectionClosed as exc:
                last_error = exc
                continue
            self._ws = ws
            self.reconnects += 1
            # Senders wait for session.resumed (_on_message): the server answers an exact
            # retry of this resume only until the client sends on the resumed connection.
            return True
        self._failure = SessionLost(
            f"could not reconnect after {self.max_reconnect_attempts} attempts: {last_error!r}"
        )
        return False

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Every server event, in order, once; ends after ``session.closed`` or a lost session."""
        while True:
            item = self._take(await self._queue.get())
            if item is _END:
                self._queue.put_nowait(_END)  # later readers end too
                if self._failure is not None and not self.session_closed:
                    raise self._failure
                return
            yield cast("dict[str, Any]", item)

    async def recv(self, timeout: float = 5.0) -> dict[str, Any]:
        """The next event (raises TimeoutError, or SessionLost when the stream ended)."""
        with anyio.fail_after(timeout):
            item = self._take(await self._queue.get())
        if item is _END:
            self._queue.put_nowait(_END)
            raise self._failure or SessionLost("the session ended")
        return cast("dict[str, Any]", item)

    async def wait_for(
        self, event_type: str, timeout: float = 5.0
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Receive until an event of ``event_type``; returns it and everything before it."""
        seen: list[dict[str, Any]] = []
        with anyio.fail_after(timeout):
            while True:
                event = await self.recv(timeout)
                if event.get("type") == event_type:
                    return event, seen
                seen.append(event)

    # -- sending ----------------------------------------------------------------------------

    def _next_id(self) -> str:
        return f"c_{self._id_prefix}_{next(self._ids)}"

    async def send(self, event: dict[str, Any]) -> str:
        """Send one client event (an ``event_id`` is added if missing); returns the event_id."""
        event = dict(event)
        event_id: str = event.setdefault("event_id", self._next_id())
        frame = json.dumps(event, separators=(",", ":"))
        if event.get("type") != "session.update":
            await self._send_frame(frame)
            return event_id
        duplex = (event.get("session") or {}).get("duplex")
        if isinstance(duplex, dict) and duplex.get("binary_audio") is False:
            self.binary_audio = False  # text from now on: the server may apply this any moment
        self._updates_unanswered.append(event_id)
        try:
            await self._send_frame(frame)
        except BaseException:
            # Not sent, so never answered; whatever it asked, the state stays the last answer's
            # (less a switch off, already taken: text frames are always accepted).
            with contextlib.suppress(ValueError):
                self._updates_unanswered.remove(event_id)
            raise
        return event_id

    async def _send_frame(self, frame: str | bytes) -> None:
        with anyio.fail_after(self.send_timeout_s):
            while True:
                await self._connected.wait()
                if self._failure is not None or self._closing:
                    raise self._failure or SessionLost("the client is closed")
                ws = self._ws
                assert ws is not None, "_connected is set only with a connection"
                try:
                    await ws.send(frame)
                    return
                except ConnectionClosed:
                    # Not written: wait for the resume (the pump notices the drop) and retry.
                    if self._ws is ws:
                        self._connected.clear()
                    await asyncio.sleep(0)

    async def send_audio(self, pcm: bytes, *, sample_rate: int | None = None) -> str | None:
        """Append ``pcm`` (in the session's declared input format) to the input buffer: a
        binary frame while :attr:`binary_audio` holds (returns None: a binary frame has no
        event_id), else ``input_audio_buffer.append`` (returns its event_id). ``sample_rate``
        names the chunk's rate (the server refuses a mismatch); it needs a text frame."""
        if self.binary_audio and sample_rate is None and not self._updates_unanswered:
            await self._send_frame(bytes(pcm))
            return None
        event: dict[str, Any] = {
            "type": "input_audio_buffer.append",
            "audio": base64.b64encode(pcm).decode("ascii"),
        }
        if sample_rate is not None:
            event["sample_rate"] = sample_rate
        return await self.send(event)

    async def commit(self) -> str:
        """Commit the buffered audio. As in OpenAI's GA contract this creates no response by
        itself (server VAD's ``create_response`` or :meth:`create_response` does)."""
        return await self.send({"type": "input_audio_buffer.commit"})

    async def clear(self) -> str:
        return await self.send({"type": "input_audio_buffer.clear"})

    async def create_response(self, instructions: str | None = None) -> str:
        event: dict[str, Any] = {"type": "response.create"}
        if instructions is not None:
            event["response"] = {"instructions": instructions}
        return await self.send(event)

    async def cancel(self, response_id: str | None = None) -> str:
        """Cancel the active response (or only ``response_id``, if it is the active one)."""
        event: dict[str, Any] = {"type": "response.cancel"}
        if response_id is not None:
            event["response_id"] = response_id
        return await self.send(event)

    async def barge_in(self) -> str:
        return await self.send({"type": "duplex.barge_in"})

    async def heartbeat(self) -> str:
        return await self.send({"type": "heartbeat"})

    async def ack_playback(self, response_id: str, played_ms: int) -> str:
        return await self.send(
            {"type": "duplex.playback_ack", "response_id": response_id, "played_ms": played_ms}
        )

    async def update_session(self, session: dict[str, Any]) -> str:
        return await self.send({"type": "session.update", "session": session})

    # -- ending -----------------------------------------------------------------------------

    def abort_transport(self) -> None:
        """Drop the TCP connection without a close handshake (network failure, for tests)."""
        ws = self._ws
        if ws is not None and ws.transport is not None:
            ws.transport.abort()

    async def close(self) -> None:
        """Close cleanly (code 1000): the server closes the session too."""
        self._closing = True
        ws = self._ws
        if ws is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(1000, "client closed"), 5)
        if self._pump_task is not None:
            self._pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pump_task
            self._pump_task = None
        self._connected.set()
