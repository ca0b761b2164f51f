"""The server's websocket connection: websockets' own, with what its parser does for a client
paced and sliced.

Why a subclass
--------------
Every other defence of the server (the frame budget, audio pacing, the write deadline) works on
whole messages, in the server's reader. Some costs come before that, in websockets' parser,
where the reader never sees them:

* **Pings.** websockets answers each ping with a pong from inside ``data_received``. A client
  sending small pings flat out and never reading had the server answer every one; the pongs
  piled up in the write buffer until the keepalive gave up on the client
  (``flood_bench --pings``).
* **Frames, not bytes.** Parsing costs per frame. A message cut into 1-byte fragments is
  hundreds of frames for one short append: within the byte and audio budgets, such a client
  took a core of parsing and made a neighbour's turn many times slower.
* **One read, parsed at once.** A read returns up to 256 KiB; websockets parses all of it
  before the loop runs anything else, so a read of tiny frames holds the loop far longer than
  an audio chunk.
* **Fragments of one message** are kept as frame objects until the last arrives, each far
  larger than its byte: websockets 17 caps them at 4,096, 15 and 16 (which openai-agents pins)
  do not, so one message of 1-byte fragments would hold many times its size in memory.

So the connection:

1. feeds what a read returned to websockets in 4 KiB pieces (smaller for a client whose
   messages inflate many times: ``PIECE_INFLATION_BYTES``) and gives the event loop up after
   ``FEED_SLICE_S`` of them, keeping the rest (reading from the socket waits meanwhile);
2. counts every frame the client sends in a token bucket (``frames_per_s``), and pings and
   pongs in a second, much smaller one (``control_frames_per_s``); past either it reads the
   client's next bytes later (TCP pushes back), refusing nothing. Both are checked between
   pieces, so what a client gets past a budget is bounded by a piece, not a read;
3. fails a message of more than ``MAX_FRAGMENTS`` fragments with 1009, as websockets 17 does;
4. bounds what it holds of messages its reader has not read in bytes, not only in frames
   (``READ_QUEUE_BYTES``), and lets go of each message's payload once it is read (:meth:`read_done`);
5. counts what it holds parsed and unhandled (its read queue, and the message its reader has
   taken until :meth:`handled`) in its client's account (read_ahead.py), and feeds its parser
   nothing more while that client, over all its connections, holds its limit;
6. bills what parsing costs to its client's share of the loop (:attr:`bill_parsing`, set by the
   session's reader) and reads the client's next bytes later while the share says so. The
   frame budget of point 2 is per connection: 256 connections of 8 addresses, each within it,
   sent messages cut into 1-byte fragments, and the loop was theirs (a neighbour's heartbeat
   answered 9 s late, then not at all), while the share, which saw only whole messages, held
   nobody.

The last point is about memory, not time. A message's payload is what it inflated to, up to the
transport cap, from a few hundred bytes on the wire. websockets' read queue holds up to
``max_queue`` frames of it while a paced reader waits, and its parser keeps the last frame it
parsed until it has parsed a whole next one (ws_internals.py): one large message and then
silence stayed in the server for the connection's life. A few hundred connections doing either
held gigabytes (docs/reliability.md).

A client held back past the keepalive's ping timeout cannot answer the server's ping either,
and is dropped as any unresponsive peer is.

Reading resumes only when nothing holds it: websockets' own read queue (``max_queue``) pauses
the same transport, through the same gate.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import PayloadTooBig
from websockets.frames import CloseCode, Frame, Opcode
from websockets.protocol import Event, State

from . import frame_cost, memory, raw_http
from .client_address import client_ip, forwarded_client, forwarded_for_in_head, peername_ip
from .guard import IntakePacer, PendingHandshakes, RequestHeadLimit, client_subject, count_refusal
from .inflate import BudgetedDeflate
from .lingering import LINGERING
from .opening_slots import OpeningSlots
from .read_ahead import ReadAheadLedger
from .ws_internals import (
    drop_parser_traceback,
    forget_payload,
    next_to_read,
    queued_bytes,
    release_closed_connection,
    route_read_queue_flow,
    whole_message_queued,
)

log = structlog.get_logger("duplex_actors.server")

#: Frames of any kind a client may send a second, and at once. Real-time audio in 20 ms
#: appends is 50 a second, 200 at the audio pacer's 4x; library clients do not fragment.
FRAMES_PER_S = 1000.0
FRAMES_BURST = 4000
#: Pings and pongs a client may send a second, and at once. Library clients ping every 5-30 s
#: and browsers never do.
CONTROL_FRAMES_PER_S = 5.0
CONTROL_FRAMES_BURST = 50
#: Fragments of one message (websockets 17's own limit; earlier versions have none).
MAX_FRAGMENTS = 4096
#: Payload bytes the read queue may hold for a reader before reading the socket waits (the
#: queue's own bound is in frames: ``max_queue`` of up to the transport cap each). A whole
#: message always gets in, whatever its size, so the reader is never left waiting for the rest
#: of a message that the bound keeps out. Real-time audio frames are 1-3 KB.
READ_QUEUE_BYTES = 256 << 10
#: The request head a client may send (bytes, header lines): browsers send 0.5-4 KB and a
#: dozen or two headers, a large cookie or token included.
MAX_REQUEST_HEAD_BYTES = 32 << 10
MAX_REQUEST_HEADERS = 64
#: Connections that have not finished their handshake, per client address and in all.
MAX_HANDSHAKES_PER_ADDRESS = 64
MAX_HANDSHAKES = 4096
#: What a read returned is fed to the parser this much at a time ...
FEED_BYTES = 4096
#: ... or less, for a client whose messages inflate many times (permessage-deflate): about this
#: much inflated a piece, so that a hold set by one message (the read queue's bytes) stops the
#: parser within about this much of it. A piece of 4 KiB of messages that each inflate a
#: thousandfold put 4 MiB in the queue past the hold. Real-time audio inflates a few times
#: (its pieces stay whole); digital silence about 485 times (pieces of ~540 bytes, each still
#: several frames of it).
PIECE_INFLATION_BYTES = 256 << 10
#: The smallest piece, and a new connection's first ones, until its messages say how much they
#: inflate.
MIN_FEED_BYTES = 256
FIRST_FEED_BYTES = 1024
#: ... and the event loop is given up after this long of it.
FEED_SLICE_S = 0.002

_CONTROL = (Opcode.PING, Opcode.PONG)
_DATA = (Opcode.TEXT, Opcode.BINARY, Opcode.CONT)


class PacedConnection(ServerConnection):
    """A :class:`ServerConnection` that feeds its parser in slices and pauses reading while its
    client owes frames. Configured per server by :func:`paced_connection` (class attributes,
    because websockets builds connections itself from a class)."""

    frames_per_s: float | None = FRAMES_PER_S
    frames_burst: float = FRAMES_BURST
    control_frames_per_s: float | None = CONTROL_FRAMES_PER_S
    control_frames_burst: float = CONTROL_FRAMES_BURST
    #: Told (what, seconds) of each wait the pacing imposes; the server counts it in a metric.
    on_paced: Callable[[str, float], None] | None = None
    #: Limits on the request head (None: websockets' own only).
    max_head_bytes: int | None = MAX_REQUEST_HEAD_BYTES
    max_headers: int = MAX_REQUEST_HEADERS
    #: The server's count of connections still in their handshake (None: not counted).
    handshakes: PendingHandshakes | None = None
    opening_slots: OpeningSlots | None = None
    #: Whether an address is a trusted reverse proxy (ServerConfig.trusted_proxies): a trusted
    #: proxy's connections take their opening slot's turn as the client they forward.
    trusted_proxies: Callable[[str], bool] | None = None
    #: The client of a connection another worker relays here (tls_relay.py): its socket's peer
    #: is that worker's relay, so the address is passed along and counted instead.
    relayed_peer: tuple[str, int] | None = None
    #: Offered each whole message (one unfragmented frame) as the parser hands it over, while
    #: the read queue is empty; it returns whether it took the message, which otherwise goes
    #: to the queue for ``recv()``. Set by the session's reader (session_reader.py, "Frames
    #: handled as they are parsed").
    offer: Callable[[str | bytes], bool] | None = None
    #: Each client's messages held parsed and unhandled, over all its connections (None: not
    #: counted), and the addresses it does not count (``ServerConfig.exempt_networks``).
    read_ahead: ReadAheadLedger | None = None
    read_ahead_exempt: Callable[[str], bool] | None = None
    #: Bills the parser's work on a read (seconds of the loop thread's CPU, collections
    #: excepted, less the messages :attr:`offer` handled, which bill themselves) to this
    #: connection's client, and says how long to hold its reading (0: not). Set by the
    #: session's reader, once the client is known (None: nothing billed).
    bill_parsing: Callable[[float], float] | None = None
    #: What the messages handled as parsed cost during the current read (the reader adds to it).
    offered_s = 0.0

    @property
    def remote_address(self) -> Any:
        if self.relayed_peer is not None:
            return self.relayed_peer
        return super().remote_address

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._head = (
            RequestHeadLimit(self.max_head_bytes, self.max_headers)
            if self.max_head_bytes is not None
            else None
        )
        self._opening: str | None = None  # the address counted in ``handshakes`` until the request
        if self.handshakes is not None:
            address = peername_ip(self.remote_address)
            refusal = self.handshakes.admit(address)
            if refusal is not None:
                self._refuse_http(503, "Service Unavailable", refusal, retry_after=1)
            else:
                self._opening = address
        self._holds: set[str] = set()
        self._opening_slot = False  # see _await_opening_slot
        # A trusted proxy's request head, kept until its end, for the client it forwards.
        self._proxied_head: bytearray | None = None
        if (
            self.trusted_proxies is not None
            and self.opening_slots is not None
            and self._head is not None
            and self._opening is not None
            and self.trusted_proxies(self._opening)
        ):
            self._proxied_head = bytearray()
        now = self.loop.time()
        self._budgets: dict[str, IntakePacer] = {}
        if self.frames_per_s is not None:
            self._budgets["frame_count"] = IntakePacer(self.frames_per_s, self.frames_burst, now)
        if self.control_frames_per_s is not None:
            self._budgets["control"] = IntakePacer(self.control_frames_per_s, self.control_frames_burst, now)
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._rest = b""  # what a read returned that the parser has not been fed yet
        self._feeding: asyncio.Handle | None = None
        self._fragments = 0
        self._released = False
        #: The last data frame handed to the read queue: the parser holds it until it has parsed
        #: another (ws_internals.forget_payload), so its payload is dropped once it is read.
        self._unread: Frame | None = None
        self._queued = 0  # payload bytes in the read queue (exact after each read_done)
        self._piece = FIRST_FEED_BYTES  # what the parser is fed at a time (_next_piece)
        self._fed = 0  # bytes fed since a piece last completed a data frame ...
        self._inflated = 0  # ... and the payload bytes of the data frames it completed
        #: This connection's client in the read-ahead ledger ("": not counted), known once the
        #: websocket is open (a trusted proxy's client is read during the handshake); what it
        #: has counted there; and the payload of the message its reader took and has not
        #: handled yet.
        self._ahead_client: str | None = None
        self._ahead = 0
        self._in_hand = 0
        self._ahead_held_at = 0.0
        # The read queue's own flow control goes through the same gate.
        route_read_queue_flow(self, lambda: self._hold("queue"), lambda: self._release("queue"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._opened()
        self.handshake_done()
        if self.opening_slots is not None and not self._opening_slot:
            self.opening_slots.withdraw(self._slot_handed_over)  # if it was still queued
        self._head = None
        # A flooder's debt can be minutes long: do not keep the connection alive for it.
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        if self._feeding is not None:
            self._feeding.cancel()
            self._feeding = None
        self._rest = b""
        # Counted no more from here: recv() may still hand out what was queued before the end.
        client, self._ahead_client = self._ahead_client, ""
        if client:
            assert self.read_ahead is not None
            self.read_ahead.change(client, -self._ahead)
            self._ahead = 0
            self.read_ahead.forget(client, self)
        super().connection_lost(exc)
        self._release_refused()
        for extension in getattr(self.protocol, "extensions", ()):
            if isinstance(extension, BudgetedDeflate):
                extension.release()  # ~40 KiB of zlib state, now rather than at a collection
        # Two reference cycles through this connection end here, so that reference counting
        # frees it at once: left, they made every closed connection cyclic garbage that the GC
        # policy had frozen, which only a full collection, a stall of the whole loop, would free
        # (ws_internals.py; tests/server/test_connection_garbage.py).
        release_closed_connection(self)
        LINGERING.closed(self, self.transport)

    # -- feeding the parser ---------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._head is not None:
            end = self._head.feed(data)
            if end == RequestHeadLimit.REFUSED:
                head = self._head
                count_refusal("request_head", self._opening or "?", f"{head.seen} bytes, {head.lines} lines")
                self._refuse_http(431, "Request Header Fields Too Large", "request head too large")
                return
            if self._proxied_head is not None:
                self._proxied_head += data if end is None else data[:end]
            if end is not None:
                self._head = None
                if self.opening_slots is not None and not self._await_opening_slot():
                    self._rest += data  # parsed once the slot is ours
                    return
        if self._rest:
            # Reading is paused while a rest waits, but a transport may still hand over what it
            # had already read (TLS): it goes after the rest, in order.
            self._rest += data
            return
        self._feed(data)

    def eof_received(self) -> None:
        if self._rest:
            # The client has finished sending: what it sent is parsed before the end is.
            rest, self._rest = self._rest, b""
            super().data_received(rest)
        try:
            super().eof_received()
        finally:
            self._release_refused()

    def _feed(self, data: bytes) -> None:
        bill = self.bill_parsing
        if bill is None:
            self._feed_pieces(data)
            return
        mark = frame_cost.mark()
        self.offered_s = 0.0
        self._feed_pieces(data)
        wait = bill(max(0.0, frame_cost.billed_since(mark) - self.offered_s))
        if wait > 0.0 and "client_share" not in self._timers:
            self._hold("client_share")
            if self.on_paced is not None:
                self.on_paced("client_share", wait)
            self._timers["client_share"] = self.loop.call_later(wait, self._share_waited)

    def _share_waited(self) -> None:
        self._timers.pop("client_share", None)
        self._release("client_share")

    def _feed_pieces(self, data: bytes) -> None:
        began = time.perf_counter()
        end = len(data)
        offset = 0
        while offset < end:
            ahead = self.read_ahead
            # All clients together under the limit (nearly always): none of them is over it.
            if ahead is not None and ahead.total >= ahead.limit and self._client_holds_its_limit():
                # Nothing more of this client is parsed until its readers have handled some of
                # what it holds (read_ahead.py): the rest waits here, then in the kernel.
                self._rest = data[offset:]
                self._wait_for_client()
                return
            piece = self._piece
            super().data_received(data[offset : offset + piece])
            self._next_piece(min(piece, end - offset))
            offset += piece
            if self.protocol.parser_exc is not None:
                self._release_refused()
            if offset < end and (self._holds or time.perf_counter() - began >= FEED_SLICE_S):
                self._rest = data[offset:]
                self.transport.pause_reading()
                if not self._holds:
                    self._feeding = self.loop.call_soon(self._feed_rest)
                return

    # -- what the client holds over all its connections (read_ahead.py) ------------------------

    def _client_holds_its_limit(self) -> bool:
        client = self._counted_as()
        assert self.read_ahead is not None
        return bool(client) and self.read_ahead.over(client)

    def _counted_as(self) -> str:
        """This connection's client in the read-ahead ledger ("": not counted, or not yet)."""
        client = self._ahead_client
        if client is None:
            if self.read_ahead is None or self.protocol.state is not State.OPEN:
                return ""  # still opening: its client may not be known yet (http_gate)
            address = client_ip(self)
            exempt = self.read_ahead_exempt
            client = "" if exempt is not None and exempt(address) else client_subject(address)
            self._ahead_client = client
        return client

    def _wait_for_client(self) -> None:
        assert self.read_ahead is not None and self._ahead_client
        if "read_ahead" not in self._holds:
            self._ahead_held_at = self.loop.time()
        self._hold("read_ahead")
        self.read_ahead.wait(self._ahead_client, self, self._client_under_its_limit)

    def _client_under_its_limit(self) -> None:
        if self.on_paced is not None:
            self.on_paced("read_ahead", self.loop.time() - self._ahead_held_at)
        self._release("read_ahead")  # the rest is fed again, and the limit asked again first

    def _count_ahead(self) -> None:
        """Bring the client's account up to what this connection holds now."""
        held = self._queued + self._in_hand
        delta = held - self._ahead
        if delta:
            client = self._counted_as()
            if client:
                assert self.read_ahead is not None
                self._ahead = held
                self.read_ahead.change(client, delta)

    def handled(self) -> None:
        """The reader has handled the message it last took (:meth:`read_done`) and let go of it."""
        if self._in_hand:
            self._in_hand = 0
            self._count_ahead()

    def _next_piece(self, fed: int) -> None:
        """Size the next piece from how much the data frames completed so far inflated, against
        the bytes fed for them: ``PIECE_INFLATION_BYTES`` a piece, within ``MIN_FEED_BYTES``
        and ``FEED_BYTES``."""
        self._fed += fed
        if self._inflated:
            ratio = self._inflated / self._fed
            self._fed = self._inflated = 0
            self._piece = max(MIN_FEED_BYTES, min(FEED_BYTES, int(PIECE_INFLATION_BYTES / ratio)))

    def _feed_rest(self) -> None:
        self._feeding = None
        if self._holds or not self._rest:
            return  # fed when the last hold is released
        rest, self._rest = self._rest, b""
        self._feed(rest)
        if not self._rest and not self._holds:
            self.transport.resume_reading()

    def _await_opening_slot(self) -> bool:
        """The request head is in: the handshake's work starts now if a slot is free, else
        it waits unread for one (opening_slots.py). Counted from the complete head, not from
        accept: a client that connects and sends nothing costs no CPU and must not hold a slot
        (16 of them would hold every handshake for the handshake timeout)."""
        assert self.opening_slots is not None
        client = None if self._opening is None else client_subject(self._opening)
        if self._proxied_head is not None and self._opening is not None:
            assert self.trusted_proxies is not None
            forwarded = forwarded_for_in_head(bytes(self._proxied_head))
            # The HTTP gate and everything after it count this same client (http_gate.py): it
            # is read once, here, so the slot and the quotas cannot disagree on whom it is.
            self.client_ip = forwarded_client(self._opening, forwarded, self.trusted_proxies)
            client = client_subject(self.client_ip)
            self._proxied_head = None
        self._opening_slot = self.opening_slots.enter(self._slot_handed_over, client)
        if not self._opening_slot:
            self._hold("opening")
        return self._opening_slot

    def handshake_done(self) -> None:
        """The connection's handshake is done (or it closed, or its client's loop share
        holds it: http_gate): its opening slot goes to the next connection waiting for one."""
        if self._opening_slot:
            self._opening_slot = False
            assert self.opening_slots is not None
            self.opening_slots.leave()

    def _slot_handed_over(self) -> bool:
        if self.transport.is_closing():
            return False
        self._opening_slot = True
        self._release("opening")
        return True

    def _opened(self) -> None:
        if self._opening is not None and self.handshakes is not None:
            self.handshakes.leave(self._opening)
        self._opening = None

    def _refuse_http(self, status: int, reason: str, text: str, retry_after: int | None = None) -> None:
        # Answered here, before websockets has parsed (and held) any of the request.
        self.transport.write(raw_http.refusal(status, reason, text, retry_after))
        self._head = None
        self._opened()
        self.transport.close()

    def _release_refused(self) -> None:
        # What the parser refused (an inflated message past max_size, the frame it was parsing
        # when the client vanished) goes now, not when the connection's cycle is collected.
        if not self._released and drop_parser_traceback(self.protocol):
            self._released = True
            if isinstance(self.protocol.parser_exc, PayloadTooBig):
                # Megabytes were inflated and dropped: worth a trim (which walks the whole heap
                # even with nothing to give back), unlike a client that merely vanished.
                memory.trim_soon(self.loop)

    # -- pacing ------------------------------------------------------------------------------------

    def process_event(self, event: Event) -> None:
        if not isinstance(event, Frame):
            self._opened()  # the request is in: the server's own limits take over
            super().process_event(event)  # the handshake request
            return
        if self._too_many_fragments(event):
            return
        if event.opcode in _DATA:
            self._inflated += len(event.data)
        if self.offer is not None and self._offered(event):
            forget_payload(event)  # handled as parsed: its message was made from a copy
        else:
            super().process_event(event)
            if event.opcode in _DATA:
                self._unread = event
                self._queued += len(event.data)
                if self.read_ahead is not None:
                    self._count_ahead()
                if event.fin and self._queued > READ_QUEUE_BYTES:
                    self._hold("queued_bytes")  # a whole message is in: the reader can go on
        now = self.loop.time()
        self._charge("frame_count", now)
        if event.opcode in _CONTROL:
            self._charge("control", now)

    def _offered(self, frame: Frame) -> bool:
        """Whether :attr:`offer` took ``frame``: only a whole message, and only with nothing
        queued before it (the reader would then see the messages out of order)."""
        assert self.offer is not None
        if not frame.fin or not next_to_read(self):
            return False
        if frame.opcode is Opcode.TEXT:
            try:
                message: str | bytes = str(frame.data, "utf-8")
            except UnicodeDecodeError:
                return False  # recv() fails the connection for it, as websockets does
        elif frame.opcode is Opcode.BINARY:
            message = bytes(frame.data)
        else:
            return False
        return self.offer(message)

    def read_done(self) -> None:
        """The reader took a message from the read queue (``recv()`` returned): the payload the
        parser still holds is dropped once nothing of it is left to read, and reading the socket
        goes on once the queue holds no more than ``READ_QUEUE_BYTES``, or holds no whole
        message (the reader then waits for the rest of one)."""
        frame = self._unread
        if frame is not None and next_to_read(self):
            forget_payload(frame)
            self._unread = None
        queued = queued_bytes(self)
        # What left the queue is in the reader's hands until it says it handled it.
        self._in_hand += max(self._queued - queued, 0)
        self._queued = queued
        if self.read_ahead is not None:
            self._count_ahead()
        if "queued_bytes" in self._holds and (
            self._queued <= READ_QUEUE_BYTES or not whole_message_queued(self)
        ):
            self._release("queued_bytes")

    def _too_many_fragments(self, frame: Frame) -> bool:
        if frame.opcode is Opcode.CONT:
            self._fragments += 1
        elif frame.opcode in (Opcode.TEXT, Opcode.BINARY):
            self._fragments = 1
        else:
            return False
        if frame.fin:
            self._fragments = 0
        elif self._fragments > MAX_FRAGMENTS:
            log.warning("server.too_many_fragments", limit=MAX_FRAGMENTS, remote=str(self.remote_address))
            self.protocol.fail(CloseCode.MESSAGE_TOO_BIG, "too many fragments")
            self.send_data()
            # websockets enforces its close timeout only around its own sends: without this,
            # a client that never closes its side would keep the connection (and the reader
            # waiting for the message's last fragment) forever.
            self._timers["close"] = self.loop.call_later(self.close_timeout or 0.0, self.transport.abort)
            return True
        return False

    def _charge(self, what: str, now: float) -> None:
        budget = self._budgets.get(what)
        if budget is None:
            return
        if what in self._timers:
            budget.spend(1.0, now)  # already held: the timer pays the debt
            return
        wait = budget.charge(1.0, now)  # every frame: spend and due in one refill
        if wait > 0.0 or what in self._holds:
            self._owe(what, wait)

    def _pay_debt(self, what: str) -> None:
        self._timers.pop(what, None)
        self._owe(what, self._budgets[what].due(self.loop.time()))

    def _owe(self, what: str, wait: float) -> None:
        """Hold reading for ``wait`` seconds of debt on one budget (released at none)."""
        if wait <= 0.0:
            self._release(what)
            return
        budget = self._budgets[what]
        self._hold(what)
        if budget.waited_s == wait:  # the first time: once per connection and budget
            log.info(
                "server.client_paced",
                what=what,
                rate=budget.rate,
                burst=budget.burst,
                remote=str(self.remote_address),
            )
        if self.on_paced is not None:
            self.on_paced(what, wait)
        self._timers[what] = self.loop.call_later(wait, self._pay_debt, what)

    def paced_s(self, what: str) -> float:
        """How long, in all, this connection's reads were held back by one budget."""
        budget = self._budgets.get(what)
        return 0.0 if budget is None else budget.waited_s

    # -- the read gate ---------------------------------------------------------------------------

    def _hold(self, reason: str) -> None:
        self.transport.pause_reading()  # idempotent
        self._holds.add(reason)

    def _release(self, reason: str) -> None:
        if reason not in self._holds:
            return
        self._holds.discard(reason)
        if self._holds:
            return
        if self._rest:
            if self._feeding is None:
                self._feeding = self.loop.call_soon(self._feed_rest)
        else:
            self.transport.resume_reading()


def paced_connection(
    *,
    frames_per_s: float | None = FRAMES_PER_S,
    frames_burst: float = FRAMES_BURST,
    control_frames_per_s: float | None = CONTROL_FRAMES_PER_S,
    control_frames_burst: float = CONTROL_FRAMES_BURST,
    on_paced: Callable[[str, float], None] | None = None,
) -> type[ServerConnection]:
    """The connection class a server hands websockets' ``serve(create_connection=...)``."""
    memory.configure_allocator()
    return type(
        "PacedConnection",
        (PacedConnection,),
        {
            "frames_per_s": frames_per_s,
            "frames_burst": frames_burst,
            "control_frames_per_s": control_frames_per_s,
            "control_frames_burst": control_frames_burst,
            "on_paced": staticmethod(on_paced) if on_paced is not None else None,
        },
    )


def with_edge_limits(
    connection_class: type[ServerConnection],
    *,
    max_head_bytes: int | None,
    max_headers: int,
    handshakes: PendingHandshakes | None,
    opening_slots: OpeningSlots | None = None,
    trusted_proxies: Callable[[str], bool] | None = None,
    read_ahead: ReadAheadLedger | None = None,
    read_ahead_exempt: Callable[[str], bool] | None = None,
) -> type[ServerConnection]:
    """``connection_class`` (a :func:`paced_connection`) with the request head limits, the
    count of connections still in their handshake and the slots for opening ones (whose turns
    go by the client a trusted proxy forwards), and each client's read-ahead over its
    connections (not counting the addresses ``read_ahead_exempt`` says)."""
    assert issubclass(connection_class, PacedConnection)
    return type(
        connection_class.__name__,
        (connection_class,),
        {
            "max_head_bytes": max_head_bytes,
            "max_headers": max_headers,
            "handshakes": handshakes,
            "opening_slots": opening_slots,
            # A function as a class attribute would be bound as a method: kept plain.
            "trusted_proxies": staticmethod(trusted_proxies) if trusted_proxies is not None else None,
            "read_ahead": read_ahead,
            "read_ahead_exempt": staticmethod(read_ahead_exempt) if read_ahead_exempt is not None else None,
        },
    )
