"""Wire sessions per core: N real-time websocket clients through ``serve``, against a bare
websockets server that only parses the same frames, in the same run (issue 32, item 1).

Each client is a microphone: a 20 ms ``input_audio_buffer.append`` every 20 ms, 24 kHz pcm16
in base64 (the GA wire's default format), as one text frame. The audio is a cycle of real
speech (piper) then silence, so the server's VAD (on by default in a GA session) hears a turn
start, ends it after the silence, commits, and the scripted engine answers (first audio 20 ms
after the request). Each client starts at a random point of the cycle, so turns are staggered.

The load generator is cheap on purpose, as the client and the server share this host's cores:
one asyncio process (uvloop when installed) drives every socket; it does the websocket
handshake itself and then writes frames it built once (masked, framed: one
``transport.write`` per frame), and skims what the server sends (the frame header and the
first bytes of each event, to count turns; a ping gets its pong). Sends are spread over the
20 ms in 20 groups 1 ms apart, as real clients' frames would be; each client binds its own
loopback address (127.0.0.2-251), since the server shares its loop by client address.

Figures, per N (each N's sessions stay open for the next, larger N):

* **server CPU per frame**: the server process's CPU time (its CPU clock, every thread, in
  nanoseconds; ``/proc/<pid>/stat``'s 10 ms ticks where there is no such clock) over a
  measurement window, divided by the frames the server decoded in it (counted by a bench-only
  wrapper around ``wire.decode`` in the child; the bare server counts what it parses). A window counts only where the server kept up: it handled within 10 % of the frames
  sent, p99 under :data:`GIVE_UP_P99_MS`, under :data:`SATURATED` cores. A server that falls
  behind reads several buffered frames per wake-up, each cheaper, then catches up: its figure
  would flatter it. Sessions per
  core follow: ``1 / (CPU per frame * 50 frames/s)``. This is the main figure: it does not
  depend on how busy the shared host is, and the load generator's CPU is not in it.
* **frame-to-core latency**: every 5th frame of a client is a probe: its ``event_id`` is
  ``p<perf_counter_ns>`` stamped when the client wrote it to the socket. In the ``serve``
  child, a bench-only wrapper around :meth:`SessionCore.handle` (installed in that process,
  nothing in the server's code) takes ``perf_counter_ns()`` as the session core receives the
  append (after the websocket, the decoder, the 24 -> 16 kHz resampler and the VAD batcher);
  the difference is the probe's latency. ``perf_counter`` is CLOCK_MONOTONIC on Linux, one clock
  for both processes. The bare server stamps the same probe once it has parsed the frame and
  decoded its base64. p50/p99 over the window; "largest N" is the largest N whose p99 is within
  :data:`P99_TARGET_MS` (the sweep stops at the first N past it, or once the server's process
  is busy more than :data:`SATURATED` of a core).

Arms (``--arms``): ``bare`` and ``serve`` always; the levers (``--levers``) are each measured
as an arm of the same run: ``serve+uvloop`` (the server's loop on uvloop), ``serve+asyncio``
and ``serve+asyncio:novad`` (on asyncio's own loop; plain ``serve`` arms run serve's default,
``--loop auto``: uvloop where installed), ``bare+uvloop``,
``bare+orjson+pybase64`` (the parse with the faster libraries), ``bare:binary`` (a binary
websocket message per frame = raw pcm16, no JSON or base64), ``serve:binary`` when the
server speaks the binary-audio extension (docs/protocol.md), a ``16k`` part (``serve:16k-novad``,
``serve:binary-16k``, ``serve:binary-16k-novad``) when the clients declare 16 kHz pcm16 input,
the session's own rate, which the server does not resample, ``serve:int8`` with server VAD's
network in int8 (``--vad-precision int8``), ``serve:nogate`` with server VAD's
quiet gate off (every window through the network) and ``serve:noisy`` with the clients' audio on
a room's noise floor (NOISY_DBFS), which no window of the gate's answers; ``serve:listens`` and
``serve:listens-nogate`` with LISTENING_S of silence after each utterance (a user who listens to
the answer), with the gate and without; ``serve:mmap256`` with the allocator as serve set it
before (glibc's mmap threshold at 256 KiB, its trim threshold left alone: every socket read
mapped and unmapped its own block, server/memory.py) and ``bare+alloc``, the bare server with
serve's allocator settings; ``bare:direct``, the bare server parsing each whole frame as
websockets' parser hands it over (no read queue, no reader task to wake), and ``serve:queued``
(``serve:novad-queued`` with VAD off) with serve's own such path off
(``handle_frames_as_parsed``: every frame through the connection's reader).

``--rounds R`` runs every arm R times, in turn, and takes the median per N; ``--server-nice``
runs each server's loop thread at a nice value. On a shared host the servers' latency is
otherwise the host's scheduling more than the server's work: at load 8-9 on 2 cores (some of
it at nice -8) a serve child needing 0.3 core got 0.2 and fell seconds behind at N=25, while
its CPU per frame stayed what it was.

``--profile N`` samples the ``serve`` child with py-spy for one window at N sessions and prints
where its CPU goes (own time and inclusive time per function).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Coroutine
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from .child_server import served_in_child
from .runtime_bench import figure

if TYPE_CHECKING:
    from websockets.asyncio.server import ServerConnection

    from ..core.commands import Command
    from ..core.session import SessionCore
    from ..server.wire_types import ClientEvent

    #: A server child's end of the control pipe: its pid, then the stamps on each "take".
    _ChildControl = Connection[int | tuple[int, bytes, bytes], str]

_T = TypeVar("_T")

RATE = 24_000
FRAME_S = 0.02
FRAMES_PER_S = round(1 / FRAME_S)
#: The largest N counted is the largest whose frame-to-core p99 is within this.
P99_TARGET_MS = 5.0
#: Goals (issue 32): the server's CPU per frame within this multiple of the bare parse
#: server's, and at least this many real-time sessions per core.
GOAL_CPU_RATIO = 1.5
GOAL_SESSIONS_PER_CORE = 500
#: The sweep stops once the server's process is busier than this (cores).
SATURATED = 0.92
#: ... and stops once it is past this p99, or handles fewer than BEHIND of the frames sent.
GIVE_UP_P99_MS = 50.0
BEHIND = 0.9
PROBE_EVERY = 5
PROBE_EVERY_BINARY = 25
GROUPS = 20  # sends spread over the 20 ms, one group a millisecond
SPEECH = "What is the weather like in Paris today? I would like to go for a walk."
SILENCE_S = 1.4
#: The listening arms' silence after each utterance: a user who hears the answer out (about
#: two fifths of the time speaking), where the bench's own cycle speaks three quarters of it.
LISTENING_S = 6.0
#: The noisy arm's floor: a microphone in a quiet room without noise suppression, over the
#: VAD's quiet gate, so every window of that arm goes through the network.
NOISY_DBFS = -50.0
MASK = b"\x37\xfa\x21\x3d"
DEFAULT_ARMS = ("bare", "serve")
LEVER_ARMS = (
    "serve:novad",
    "serve:plain",
    "serve:nopace",
    "serve:vad0",
    "serve:vadeach",
    "serve:int8",
    "serve:nogate",
    "serve:noisy",
    "serve:listens",
    "serve:listens-nogate",
    "serve+uvloop",
    "serve+asyncio",
    "serve+asyncio:novad",
    "bare+uvloop",
    "bare+orjson+pybase64",
    "bare:binary",
    "serve:binary",
    "serve:16k-novad",
    "serve:binary-16k",
    "serve:binary-16k-novad",
    "serve:mmap256",
    "bare+alloc",
    "bare:direct",
    "serve:queued",
    "serve:novad-queued",
)
FULL_SESSIONS = (25, 50, 100, 150, 200, 300, 400, 500, 700, 1000)
QUICK_SESSIONS = (5, 20)


# --- the server children ------------------------------------------------------------------


class _Stamps:
    """Probe latencies (ns) the server's process took, handed to the bench on request."""

    def __init__(self) -> None:
        self.lat = array("q")
        self.read = array("q")  # serve: the same probes as the reader decoded them
        self.frames = 0  # audio frames handled, probes or not

    def take(self) -> tuple[int, bytes, bytes]:
        lat, self.lat = self.lat, array("q")
        read, self.read = self.read, array("q")
        return self.frames, lat.tobytes(), read.tobytes()


def _serve_control(control: _ChildControl, stamps: _Stamps) -> None:
    """The child's side of the control pipe: its pid first, then the stamps on each 'take'."""
    control.send(os.getpid())

    def loop() -> None:
        while True:
            try:
                message = control.recv()
            except (EOFError, OSError):
                return
            if message == "take":
                control.send(stamps.take())

    threading.Thread(target=loop, name="bench-control", daemon=True).start()


def _arm_options(arm: str) -> dict[str, Any]:
    kind, _, variant = arm.partition(":")
    server, *levers = kind.split("+")
    return {
        "server": server,
        "uvloop": "uvloop" in levers,
        # serve runs the loop `serve` runs by default (auto: uvloop where installed) unless an
        # arm names one; the bare server runs asyncio's own unless it names uvloop
        "loop": "uvloop"
        if "uvloop" in levers
        else "asyncio"
        if "asyncio" in levers or server == "bare"
        else "auto",
        "orjson": "orjson" in levers,
        "pybase64": "pybase64" in levers,
        # the bare server with serve's allocator settings (server/memory.py)
        "alloc": "alloc" in levers,
        # serve with its allocator as before: mmap threshold 256 KiB, glibc's trim threshold
        "mmap256": "mmap256" in variant.split("-"),
        "binary": "binary" in variant.split("-"),
        # the clients send audio at the session's own rate, declared as the extension allows
        # (`audio/pcm` at 16 kHz): no resampling at the edge
        "rate": 16_000 if "16k" in variant.split("-") else RATE,
        # the bare server parsing each whole frame inside websockets' parser (no reader task)
        "direct": variant == "direct",
        # manual turns: server VAD off, a commit at the end of each utterance's cycle
        "novad": "novad" in variant.split("-"),
        # the accelerators (orjson, pybase64) off in the server's decoder
        "plain": variant == "plain",
        # the audio on a room's noise floor (NOISY_DBFS) instead of near-digital silence
        "noisy": variant == "noisy",
        # LISTENING_S of silence after each utterance instead of SILENCE_S
        "listens": "listens" in variant.split("-"),
        # a variant of several parts ("listens-nogate") takes each part's settings
        "config": {k: v for part in variant.split("-") for k, v in _CONFIG_VARIANTS.get(part, {}).items()},
    }


#: serve arms that change one ServerConfig setting (see _arm_options).
_CONFIG_VARIANTS: dict[str, dict[str, Any]] = {
    # the handling pacer and the loop share off: no thread-CPU billing per frame (frame_cost)
    "nopace": {"frame_handling_s_per_s": None, "loop_share_s_per_s": None},
    # VAD batching: what one pass of the loop has (0), or each window as its frame comes (None)
    "vad0": {"vad_batch_window_s": 0.0},
    # a shorter batching window than the default (vad2: 2 ms): its latency and CPU price
    **{f"vad{ms}": {"vad_batch_window_s": ms / 1000} for ms in (2, 3, 5)},
    "vadeach": {"vad_batch_window_s": None},
    # server VAD's network with int8 convolutions (audio/vad.py)
    "int8": {"vad_precision": "int8"},
    # server VAD's quiet gate off: every window through the network (audio/vad.py QUIET_DBFS)
    "nogate": {"vad_quiet_dbfs": None},
    # every frame through the connection's reader, none handled as websockets parses it
    "queued": {"handle_frames_as_parsed": False},
}


def _bare_main(ready: Connection[int, Any], control: _ChildControl, options: dict[str, Any]) -> None:
    """A bare websockets server: it parses each frame (JSON, then the audio's base64) and
    does nothing else; probes are stamped once parsed."""
    from websockets.asyncio.server import serve
    from websockets.exceptions import ConnectionClosed

    loads: Callable[[Any], Any] = json.loads
    b64decode: Callable[..., bytes] = base64.b64decode
    if options["orjson"]:
        import orjson

        loads = orjson.loads
    if options["pybase64"]:
        import pybase64

        b64decode = pybase64.b64decode
    if options["alloc"]:
        from ..server import memory

        memory.configure_allocator()
    stamps = _Stamps()
    _serve_control(control, stamps)
    now = time.perf_counter_ns

    def parse(frame: str | bytes) -> None:
        lat = stamps
        lat.frames += 1
        if isinstance(frame, bytes):  # the binary arm: raw pcm16, a probe marked
            if frame[:5] == b"PROBE":
                lat.lat.append(now() - int.from_bytes(frame[5:13], "little"))
            return
        event = loads(frame)
        if event.get("type") == "input_audio_buffer.append":
            b64decode(event["audio"], validate=True)
        event_id = event.get("event_id")
        if event_id and event_id[0] == "p":
            lat.lat.append(now() - int(event_id[1:]))

    async def handler(ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            if options["direct"]:
                await ws.send('{"type":"session.created"}')
                await ws.wait_closed()
                return
            await receive(ws)

    async def receive(ws: ServerConnection) -> None:
        await ws.send('{"type":"session.created"}')
        async for frame in ws:
            parse(frame)

    from websockets.asyncio.server import ServerConnection
    from websockets.frames import Opcode

    class DirectConnection(ServerConnection):
        """The ``direct`` arm: a whole data frame is parsed as websockets' parser hands it
        over, with no message queue and no reader task to wake."""

        # event: websockets' Event, a Frame once the handshake's request is in (Any: narrowing
        # it would cost this bare arm a check per frame)
        def process_event(self, event: Any) -> None:
            if self.request is None:  # the handshake's request
                super().process_event(event)
            elif event.fin and event.opcode is Opcode.TEXT:
                parse(event.data.decode())
            elif event.fin and event.opcode is Opcode.BINARY:
                parse(bytes(event.data))
            else:
                super().process_event(event)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
        connection = DirectConnection if options["direct"] else ServerConnection
        async with serve(
            handler, "127.0.0.1", 0, max_size=None, compression=None, create_connection=connection
        ) as server:
            ready.send(server.sockets[0].getsockname()[1])
            await stop

    if options["uvloop"]:
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def _serve_main(ready: Connection[int, Any], control: _ChildControl, options: dict[str, Any]) -> None:
    """``serve``'s assembly (open_server: runtime, GC policy, server VAD, pacers), the scripted
    engine, one process; probes stamped as the session core receives them."""
    import anyio

    from ..core.session import SessionCore
    from ..server.app import ServerConfig
    from ..server.cli_commands import open_server
    from .wire_bench import _engine

    stamps = _Stamps()
    handle = SessionCore.handle
    now = time.perf_counter_ns

    def stamped(self: SessionCore, command: Command, *args: Any, **kwargs: Any) -> None:
        event_id = command.event_id
        if event_id is not None and event_id[:1] == "p":
            stamps.lat.append(now() - int(event_id[1:]))
        return handle(self, command, *args, **kwargs)

    SessionCore.handle = stamped  # type: ignore[method-assign]
    # Frames are counted as the server decodes them: not at the core, where the 24 -> 16 kHz
    # resampler's output (soxr hands its samples on in blocks) makes fewer appends than frames.
    from ..server import wire

    decode = wire.decode

    def counted(*args: Any, **kwargs: Any) -> ClientEvent:
        stamps.frames += 1
        event = decode(*args, **kwargs)
        event_id = getattr(event, "event_id", None)
        if event_id is not None and event_id[:1] == "p":
            stamps.read.append(now() - int(event_id[1:]))
        return event

    wire.decode = counted
    if options["plain"]:  # the decoder without its optional accelerator (pybase64)
        wire._b64decode = base64.b64decode
    if options["mmap256"]:  # set first, the server's own setting is then a no-op
        from ..server import memory

        memory.configure_allocator(256 << 10, trim_threshold=None)
    _serve_control(control, stamps)

    async def main() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            config = ServerConfig(host="127.0.0.1", port=0, **options["config"])
            async with open_server(_engine(), config) as server:
                ready.send(server.port)
                async for _ in signals:
                    break

    from ..server.event_loop import run_anyio

    run_anyio(main, choice=options["loop"])


# --- the load generator --------------------------------------------------------------------

try:
    from websockets.speedups import apply_mask as _apply_mask
except ImportError:  # pragma: no cover - websockets without its C extension
    from websockets.utils import apply_mask as _apply_mask


def _ws_frame(opcode: int, payload: bytes) -> bytes:
    """One masked client frame (FIN set)."""
    n = len(payload)
    if n < 126:
        head = bytes((0x80 | opcode, 0x80 | n))
    elif n < 1 << 16:
        head = bytes((0x80 | opcode, 0x80 | 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 0x80 | 127)) + n.to_bytes(8, "big")
    return head + MASK + _apply_mask(payload, MASK)


def _audio_cycle(
    noise_dbfs: float | None = None, silence_s: float = SILENCE_S, rate: int = RATE
) -> tuple[list[bytes], bool]:
    """One turn's audio in 20 ms frames: speech then ``silence_s`` of silence (with a little
    noise), at ``rate`` (24 kHz: GA's); ``noise_dbfs``: white noise at this level under all of
    it instead.
    Without piper (extra 'embedded') a tone stands in: the VAD hears no turn then."""
    rng = random.Random(7)
    try:
        from ..audio.utterances import synthesize_utterance

        speech = synthesize_utterance(SPEECH, sample_rate=rate, varied=False)
        real = True
    except Exception:
        import math

        speech = b"".join(
            int(3000 * math.sin(2 * math.pi * 220 * i / rate)).to_bytes(2, "little", signed=True)
            for i in range(rate * 2)
        )
        real = False
    silence = b"".join(
        rng.randint(-3, 3).to_bytes(2, "little", signed=True) for _ in range(int(rate * silence_s))
    )
    pcm = speech + silence
    if noise_dbfs is not None:
        import numpy as np

        samples = np.frombuffer(pcm, "<i2").astype(np.float64)
        samples += np.random.default_rng(7).normal(0.0, 32768 * 10 ** (noise_dbfs / 20), len(samples))
        pcm = np.clip(np.round(samples), -32768, 32767).astype("<i2").tobytes()
    frame_bytes = int(rate * FRAME_S) * 2
    pcm += b"\x00" * (-len(pcm) % frame_bytes)
    return [pcm[i : i + frame_bytes] for i in range(0, len(pcm), frame_bytes)], real


class _Frames:
    """Every frame a client sends, built once: the plain ones whole, the probes' tails."""

    PREFIX = b'{"type":"input_audio_buffer.append","event_id":"p'

    def __init__(
        self,
        binary: bool,
        manual: bool = False,
        text_probes: bool = False,
        noise_dbfs: float | None = None,
        silence_s: float = SILENCE_S,
        rate: int = RATE,
    ) -> None:
        chunks, self.real_speech = _audio_cycle(noise_dbfs, silence_s, rate)
        self.binary = binary
        self.manual = manual
        #: binary frames carry no event_id: serve's probes are then text appends of the same
        #: audio, one frame in PROBE_EVERY_BINARY (the bare server reads a marker instead)
        self.text_probes = binary and text_probes
        #: sent once a session is created: manual turns (VAD off) in the novad arm, the
        #: binary-audio extension on in serve's binary arm
        session: dict[str, Any] = {}
        if manual:
            session["audio"] = {"input": {"turn_detection": None}}
        if rate != RATE:  # GA's default needs no declaration
            session.setdefault("audio", {}).setdefault("input", {})["format"] = {
                "type": "audio/pcm",
                "rate": rate,
            }
        if self.text_probes:
            session["duplex"] = {"binary_audio": True}
        update = json.dumps({"type": "session.update", "session": session}, separators=(",", ":"))
        self.setup = [_ws_frame(0x1, update.encode())] if session else []
        self.commit = _ws_frame(0x1, b'{"type":"input_audio_buffer.commit"}')
        self.chunks = chunks
        b64 = [base64.b64encode(c) for c in chunks]
        self.tails = [b'","audio":"' + a + b'"}' for a in b64]
        if binary:
            self.plain = [_ws_frame(0x2, c) for c in chunks]
        else:
            self.plain = [
                _ws_frame(0x1, b'{"type":"input_audio_buffer.append","audio":"' + a + b'"}') for a in b64
            ]
        self.text_bytes = len(self.plain[0])
        self.probe_every = PROBE_EVERY_BINARY if self.text_probes else PROBE_EVERY

    def probe(self, index: int) -> bytes:
        stamp = time.perf_counter_ns()
        if self.binary and not self.text_probes:
            return _ws_frame(0x2, b"PROBE" + stamp.to_bytes(8, "little") + self.chunks[index][13:])
        return _ws_frame(0x1, self.PREFIX + str(stamp).encode() + self.tails[index])


class _Client(asyncio.Protocol):
    """One websocket client: its own handshake, then precomputed frames; what the server sends
    is skimmed (types counted) and pings answered."""

    def __init__(self, load: _Load, host: str) -> None:
        self.load = load
        self.host = host
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.upgraded = False
        self.ready = asyncio.get_running_loop().create_future()
        self.index = 0
        self.sent = 0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # a socket's
        self.transport = transport
        key = base64.b64encode(os.urandom(16)).decode()
        path = self.load.path
        transport.write(
            f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            f"Sec-WebSocket-Version: 13\r\n\r\n".encode()
        )

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if not self.upgraded:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            if not buf.startswith(b"HTTP/1.1 101"):
                self._fail(RuntimeError(bytes(buf[: buf.find(b"\r\n")]).decode(errors="replace")))
                return
            self.upgraded = True
            del buf[: end + 4]
        counts = self.load.received
        while len(buf) >= 2:
            opcode, size, at = buf[0] & 0x0F, buf[1] & 0x7F, 2
            if size == 126:
                if len(buf) < 4:
                    return
                size, at = int.from_bytes(buf[2:4], "big"), 4
            elif size == 127:
                if len(buf) < 10:
                    return
                size, at = int.from_bytes(buf[2:10], "big"), 10
            if len(buf) < at + size:
                return
            if opcode == 0x1:
                head = bytes(buf[at : at + 64])
                start = head.find(b'"type":"') + 8
                kind = head[start : head.find(b'"', start)].decode()
                counts[kind] += 1
                if kind == "session.created" and not self.ready.done():
                    self.ready.set_result(None)
            elif opcode == 0x9 and self.transport is not None:  # ping: pong with its payload
                self.transport.write(_ws_frame(0xA, bytes(buf[at : at + size])))
            elif opcode == 0x8:
                self.closed = True
            del buf[: at + size]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(exc or ConnectionError("closed by the server"))

    def _fail(self, exc: BaseException) -> None:
        if not self.ready.done():
            self.ready.set_exception(exc)

    def send_next(self) -> None:
        if self.closed or self.transport is None:
            return
        frames = self.load.frames
        index = self.index
        self.index = (index + 1) % len(frames.plain)
        if index == 0 and frames.manual:
            self.transport.write(frames.commit)
        self.sent += 1
        if self.sent % frames.probe_every == 0:
            self.transport.write(frames.probe(index))
        else:
            self.transport.write(frames.plain[index])
        self.load.sent += 1


class _Load:
    """Every client of one arm, and the pump that sends their frames in real time."""

    def __init__(self, url: str, frames: _Frames) -> None:
        host_port = url.split("//", 1)[1].split("/", 1)[0]
        self.host, port = host_port.rsplit(":", 1)
        self.port = int(port)
        self.path = "/" + url.split("//", 1)[1].split("/", 1)[1]
        self.frames = frames
        self.clients: list[_Client] = []
        self.groups: list[list[_Client]] = [[] for _ in range(GROUPS)]
        self.sent = 0
        self.received: Counter[str] = Counter()
        self.late_ticks = 0
        self.running = True
        self.rng = random.Random(11)

    async def grow(self, n: int, batch: int = 50) -> None:
        loop = asyncio.get_running_loop()
        while len(self.clients) < n:
            todo = min(batch, n - len(self.clients))
            opened = []
            for i in range(len(self.clients), len(self.clients) + todo):
                local = f"127.0.0.{2 + i % 250}"
                opened.append(
                    loop.create_connection(
                        lambda: _Client(self, f"{self.host}:{self.port}"),
                        self.host,
                        self.port,
                        local_addr=(local, 0),
                    )
                )
            for _, client in await asyncio.gather(*opened):
                await asyncio.wait_for(client.ready, 30)
                client.index = self.rng.randrange(len(self.frames.plain))
                for frame in self.frames.setup:
                    assert client.transport is not None
                    client.transport.write(frame)
                self.groups[len(self.clients) % GROUPS].append(client)
                self.clients.append(client)

    async def pump(self) -> None:
        loop = asyncio.get_running_loop()
        tick = FRAME_S / GROUPS
        began, k = loop.time(), 0
        while self.running:
            delay = began + k * tick - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -tick:
                self.late_ticks += 1
            for client in self.groups[k % GROUPS]:
                client.send_next()
            k += 1

    def close(self) -> None:
        self.running = False
        for client in self.clients:
            if client.transport is not None:
                client.transport.abort()


def _proc_cpu_s(pid: int) -> float:
    """CPU time of a process, every thread, exited ones included (seconds), in nanoseconds:
    Linux's CPU clock of another process (``clock_getcpuclockid``'s id, which Python does not
    expose: ``~pid << 3 | CPUCLOCK_SCHED``). /proc's utime + stime count 10 ms ticks, so a
    short window of a cheap server (a smoke run: 150 frames of 20 us) read 0 or one tick."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:  # not Linux's clock ids: the ticks
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(samples_ns: array[int], q: float) -> float | None:
    if not samples_ns:
        return None
    s = sorted(samples_ns)
    return s[min(len(s) - 1, int(q * len(s)))] / 1e6


async def _window(load: _Load, control: Connection[str, Any], pid: int, seconds: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()

    def take() -> tuple[int, array[int], array[int]]:
        control.send("take")
        handled, raw, raw_read = control.recv()
        out, read = array("q"), array("q")
        out.frombytes(raw)
        read.frombytes(raw_read)
        return handled, out, read

    handled0, _, _ = await loop.run_in_executor(None, take)  # what came before the window
    cpu0, sent0, t0, mine0 = _proc_cpu_s(pid), load.sent, time.perf_counter(), time.process_time()
    late0 = load.late_ticks
    await asyncio.sleep(seconds)
    cpu1, sent1, t1, mine1 = _proc_cpu_s(pid), load.sent, time.perf_counter(), time.process_time()
    handled1, lat, read = await loop.run_in_executor(None, take)
    # Per frame the server handled (the session core received, or the bare server parsed) in
    # the window; what the clients sent is shown too (a server that falls behind handles fewer).
    frames = handled1 - handled0
    elapsed = t1 - t0
    cpu = cpu1 - cpu0
    n = len(load.clients)
    return {
        "sessions": n,
        "seconds": round(elapsed, 3),
        "frames": frames,
        "frames_sent": sent1 - sent0,
        "frames_per_session_s": round(frames / elapsed / max(1, n), 2),
        "server_cpu_s": round(cpu, 3),
        "server_busy_cores": round(cpu / elapsed, 3),
        "cpu_per_frame_us": round(cpu / frames * 1e6, 2) if frames else None,
        "client_cpu_per_frame_us": round((mine1 - mine0) / (sent1 - sent0) * 1e6, 2)
        if sent1 > sent0
        else None,
        "late_ticks": load.late_ticks - late0,
        "probes": len(lat),
        "p50_ms": _pct(lat, 0.50),
        "p99_ms": _pct(lat, 0.99),
        # serve only: frame -> the reader has decoded it (the rest, to the core, is the
        # resampler, the VAD batch and the runtime's mailbox)
        "read_p50_ms": _pct(read, 0.50),
        "read_p99_ms": _pct(read, 0.99),
        "max_ms": _pct(lat, 1.0),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


async def _sweep(
    url: str,
    control: Connection[str, Any],
    pid: int,
    frames: _Frames,
    sessions: tuple[int, ...],
    warm_s: float,
    window_s: float,
    echo: Callable[[str], None],
    arm: str,
    on_window: Callable[[int], Any] | None = None,
) -> dict[str, Any]:
    load = _Load(url, frames)
    pump = asyncio.create_task(load.pump())
    steps: list[dict[str, Any]] = []
    stopped = None
    try:
        for n in sessions:
            try:
                await load.grow(n)
            except (TimeoutError, OSError, RuntimeError) as exc:
                stopped = f"could not open {n} sessions: {exc!r}"
                break
            await asyncio.sleep(warm_s)
            profile = on_window(n) if on_window is not None else None
            step = await _window(load, control, pid, window_s)
            if profile is not None:
                step["profile"] = await profile
            dropped = sum(c.closed for c in load.clients)
            step["closed_by_server"] = dropped
            steps.append(step)
            echo(
                f"  {arm:>22} N={n:>5}: server {step['cpu_per_frame_us']} us/frame "
                f"(busy {step['server_busy_cores']:.2f} core), frame-to-core p50 "
                f"{_fmt(step['p50_ms'])} p99 {_fmt(step['p99_ms'])} ms"
                + (
                    f" (to the reader: p50 {_fmt(step['read_p50_ms'])} p99 {_fmt(step['read_p99_ms'])})"
                    if step["read_p50_ms"] is not None
                    else ""
                )
                + f", {step['frames_per_session_s']} frames/s/session, client "
                f"{step['client_cpu_per_frame_us']} us/frame, load {step['loadavg'][0]}"
            )
            if dropped:
                stopped = f"{dropped} sessions closed by the server"
                break
            # Past the latency target the sweep goes on while the server keeps up (CPU per
            # frame is still measured): it stops once it is saturated or falls behind.
            if step["server_busy_cores"] > SATURATED:
                stopped = f"server busy {step['server_busy_cores']:.2f} cores at N={n}"
                break
            if step["frames"] < BEHIND * step["frames_sent"]:
                stopped = f"server behind at N={n}: handled {step['frames']} of {step['frames_sent']} frames"
                break
            if step["p99_ms"] is None or step["p99_ms"] > GIVE_UP_P99_MS:
                stopped = f"p99 over {GIVE_UP_P99_MS:g} ms at N={n}"
                break
    finally:
        load.close()
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump
    ok = [s["sessions"] for s in steps if s["p99_ms"] is not None and s["p99_ms"] <= P99_TARGET_MS]
    return {
        "steps": steps,
        "largest_n_p99_ok": max(ok) if ok else None,
        "stopped": stopped or "end of the sweep",
        "received": dict(load.received),
    }


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _run_loop(coro: Coroutine[Any, Any, _T]) -> _T:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def _available(arm: str) -> str | None:
    """Why an arm cannot run here, or None."""
    import importlib.util

    options = _arm_options(arm)
    for lever in ("uvloop", "orjson", "pybase64"):
        if options[lever] and importlib.util.find_spec(lever) is None:
            return f"'{lever}' is not installed"
    if options["server"] == "serve" and options["binary"]:
        import inspect

        from ..server import wire

        if "binary_audio" not in inspect.signature(wire.decode).parameters:
            return "the server does not speak the binary-audio extension"
    return None


def _py_spy_window(pid: int, seconds: float) -> asyncio.Future[dict[str, Any]] | None:
    """Sample ``pid`` with py-spy for ``seconds`` (collapsed stacks); None without py-spy."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        return None
    out = Path(tempfile.mkdtemp()) / "stacks.txt"
    argv = [exe, "record", "--nonblocking", "-r", "250", "-d", str(max(1, round(seconds))), "-p", str(pid)]
    argv += ["-f", "raw", "-o", str(out)]

    def run() -> dict[str, Any]:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60)
        if proc.returncode != 0 or not out.exists():
            return {"error": proc.stderr[-500:]}
        return _summarise_stacks(out.read_text())

    return asyncio.get_running_loop().run_in_executor(None, run)


def _summarise_stacks(text: str, top: int = 25) -> dict[str, Any]:
    """Own and inclusive samples per function from py-spy's collapsed stacks."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [
            f.split(" (", 1)[0] + " (" + f.rsplit("/", 1)[-1] if " (" in f else f for f in stack.split(";")
        ]
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    return {
        "samples": total,
        "own": [(f, round(n / total, 4)) for f, n in own.most_common(top)] if total else [],
        "inclusive": [(f, round(n / total, 4)) for f, n in inclusive.most_common(top)] if total else [],
    }


def run_arm(
    arm: str,
    sessions: tuple[int, ...],
    *,
    warm_s: float,
    window_s: float,
    echo: Callable[[str], None] = print,
    profile_at: int | None = None,
    server_nice: int | None = None,
) -> dict[str, Any]:
    """One arm's sweep: its server in a child process, the load here. ``server_nice``: the
    server's loop thread at this nice value (a shared host: see the module docstring)."""
    options = _arm_options(arm)
    target = _serve_main if options["server"] == "serve" else _bare_main
    frames = _Frames(
        binary=options["binary"],
        manual=options["novad"],
        text_probes=options["server"] == "serve",
        noise_dbfs=NOISY_DBFS if options["noisy"] else None,
        silence_s=LISTENING_S if options["listens"] else SILENCE_S,
        rate=options["rate"],
    )
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    with served_in_child(target, theirs, options, name=f"wire-capacity-{arm}") as url:
        pid = mine.recv()
        if server_nice is not None:
            os.setpriority(os.PRIO_PROCESS, pid, server_nice)  # the loop's thread (pid = its tid)

        def on_window(n: int) -> asyncio.Future[dict[str, Any]] | None:
            return _py_spy_window(pid, window_s) if profile_at == n else None

        result = _run_loop(_sweep(url, mine, pid, frames, sessions, warm_s, window_s, echo, arm, on_window))
    result.update(
        arm=arm,
        options=options,
        frame_bytes=frames.text_bytes,
        real_speech=frames.real_speech,
    )
    return result


def _kept_up(step: dict[str, Any]) -> bool:
    """The server handled the frames as they came: within 10 % of what was sent (a server
    behind reads several frames a wake-up, cheaper each, then catches up), p99 under
    GIVE_UP_P99_MS, and not saturated."""
    sent = step["frames_sent"]
    return bool(
        sent
        and abs(step["frames"] / sent - 1) <= 1 - BEHIND
        and step["p99_ms"] is not None
        and step["p99_ms"] <= GIVE_UP_P99_MS
        and step["server_busy_cores"] <= SATURATED
    )


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """An arm's rounds by N: the median CPU per frame of the windows where the server kept up."""
    by_n: dict[int, list[dict[str, Any]]] = {}
    for sweep in rounds:
        for step in sweep["steps"]:
            by_n.setdefault(step["sessions"], []).append(step)
    out = {}
    for n, steps in sorted(by_n.items()):
        kept = [s for s in steps if _kept_up(s)]
        out[n] = {
            "windows": len(steps),
            "kept_up": len(kept),
            "cpu_per_frame_us": _median([s["cpu_per_frame_us"] for s in kept]),
            "cpu_per_frame_us_all": [s["cpu_per_frame_us"] for s in steps],
            "p50_ms": [s["p50_ms"] for s in steps],
            "p99_ms": [s["p99_ms"] for s in steps],
            "busy_cores": [s["server_busy_cores"] for s in steps],
        }
    largest = [sweep["largest_n_p99_ok"] for sweep in rounds]
    return {"by_n": out, "largest_n_p99_ok": largest}


def _reference(arms: dict[str, dict[str, Any]], base: str, other: str) -> dict[str, Any] | None:
    """The two arms' CPU per frame at the largest N where both kept up (medians over rounds);
    failing that, at the smallest N both measured, every window counted (flagged)."""
    a, b = arms[base]["by_n"], arms[other]["by_n"]
    common = sorted(set(a) & set(b))
    kept = [n for n in common if a[n]["cpu_per_frame_us"] and b[n]["cpu_per_frame_us"]]
    if kept:
        n = kept[-1]
        return {
            "sessions": n,
            "base_us": a[n]["cpu_per_frame_us"],
            "arm_us": b[n]["cpu_per_frame_us"],
            "kept_up": True,
        }
    if not common:
        return None
    n = common[0]
    return {
        "sessions": n,
        "base_us": _median(a[n]["cpu_per_frame_us_all"]),
        "arm_us": _median(b[n]["cpu_per_frame_us_all"]),
        "kept_up": False,
    }


def bench_wire_capacity(
    quick: bool = True,
    *,
    arms: tuple[str, ...] | None = None,
    sessions: tuple[int, ...] | None = None,
    window_s: float | None = None,
    warm_s: float | None = None,
    levers: bool = False,
    rounds: int = 1,
    profile_at: int | None = None,
    server_nice: int | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every arm's sweep, ``rounds`` times, the arms in turn (bare, serve, ..., bare, serve,
    ...), so that each arm meets the host's load of the same minutes."""
    sessions = sessions or (QUICK_SESSIONS if quick else FULL_SESSIONS)
    window_s = window_s or (1.5 if quick else 4.0)
    warm_s = warm_s if warm_s is not None else (0.5 if quick else 1.5)
    wanted = list(arms or DEFAULT_ARMS)
    if levers:
        wanted += [a for a in LEVER_ARMS if a not in wanted]
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    sweeps: dict[str, list[dict[str, Any]]] = {}
    skipped: dict[str, str] = {}
    for arm in list(wanted):
        why = _available(arm)
        if why:
            skipped[arm] = why
            wanted.remove(arm)
            echo(f"  {arm}: skipped ({why})")
    for round_no in range(rounds):
        for arm in wanted:
            sweep = run_arm(
                arm,
                sessions,
                warm_s=warm_s,
                window_s=window_s,
                echo=echo,
                profile_at=profile_at if arm.startswith("serve") and round_no == 0 else None,
                server_nice=server_nice,
            )
            sweeps.setdefault(arm, []).append(sweep)
            refused = sweep["received"].get("error")
            if refused:
                # A refused declaration or frame is still CPU spent, but not the arm's path:
                # its figures would measure the refusals, so say so where they are printed.
                echo(f"  WARNING {arm}: the server answered {refused} errors; its figures include them")
    load_after = os.getloadavg()
    results = {arm: {**_summary(rs), "rounds": rs} for arm, rs in sweeps.items()}
    figs = []
    for arm, summary in results.items():
        if arm == "bare" or "bare" not in results:
            continue
        ref = _reference(results, "bare", arm)
        if ref is None or not ref["arm_us"] or not ref["base_us"]:
            continue
        goal = arm == "serve"
        at = f"N={ref['sessions']}" + ("" if ref["kept_up"] else ", server behind")
        figs.append(
            figure(
                f"{arm}: server CPU per 20 ms frame at {at}",
                ref["arm_us"],
                "us",
                ref["base_us"],
                "bare websockets server: JSON + base64 parse only, same frames, same N",
                target=f"<= {GOAL_CPU_RATIO:g}x bare" if goal else None,
                met=(ref["arm_us"] / ref["base_us"] <= GOAL_CPU_RATIO) if goal else None,
            )
        )
        per_core = 1e6 / (ref["arm_us"] * FRAMES_PER_S)
        figs.append(
            figure(
                f"{arm}: real-time sessions per server core (1 / (CPU per frame x 50/s)) at {at}",
                per_core,
                "sessions",
                1e6 / (ref["base_us"] * FRAMES_PER_S),
                "bare parse server, same N",
                target=f">= {GOAL_SESSIONS_PER_CORE}" if goal else None,
                met=per_core >= GOAL_SESSIONS_PER_CORE if goal else None,
                higher_is_better=True,
            )
        )
        mine = [n or 0 for n in summary["largest_n_p99_ok"]]
        bare = [n or 0 for n in results["bare"]["largest_n_p99_ok"]]
        figs.append(
            figure(
                f"{arm}: largest N with frame-to-core p99 <= {P99_TARGET_MS:g} ms (every round: {mine})",
                min(mine),
                "sessions",
                min(bare) or None,
                f"bare parse server, frame -> parsed (every round: {bare})",
                higher_is_better=True,
            )
        )
    return {
        "name": "wire_capacity",
        "params": {
            "quick": quick,
            "sessions": list(sessions),
            "rounds": rounds,
            "server_nice": server_nice,
            "window_s": window_s,
            "warm_s": warm_s,
            "started": started,
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in load_after],
            "cpus": os.cpu_count(),
            "frame": "24 kHz pcm16, 20 ms, base64 in input_audio_buffer.append (text)",
        },
        "figures": figs,
        "arms": results,
        "skipped_arms": skipped,
    }


def run(quick: bool = True) -> dict[str, Any]:
    return bench_wire_capacity(quick)


def _print_profile(profile: dict[str, Any]) -> None:
    if "error" in profile:
        print(f"  py-spy failed: {profile['error']}")
        return
    print(f"  py-spy: {profile['samples']} samples of the serve child")
    for title in ("own", "inclusive"):
        print(f"  top by {title} time:")
        for name, share in profile[title]:
            print(f"    {share * 100:5.1f}%  {name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m duplex_actors.bench.wire_capacity_bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="smoke size: N=5 and 20, 1.5 s windows")
    parser.add_argument("--sessions", help="comma-separated N to sweep (ascending)")
    parser.add_argument("--arms", help=f"comma-separated arms (default {','.join(DEFAULT_ARMS)})")
    parser.add_argument("--levers", action="store_true", help=f"add the lever arms: {', '.join(LEVER_ARMS)}")
    parser.add_argument("--rounds", type=int, default=1, help="run every arm this many times, in turn")
    parser.add_argument("--window", type=float, help="seconds measured at each N")
    parser.add_argument("--warm", type=float, help="seconds after reaching N before measuring")
    parser.add_argument("--profile", type=int, help="py-spy the serve child during the window at this N")
    parser.add_argument(
        "--server-nice",
        type=int,
        help="run each server's loop at this nice value (negative needs root): on a shared host "
        "the latency figures are otherwise the host's share, not the server's",
    )
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    result = bench_wire_capacity(
        args.quick,
        arms=tuple(args.arms.split(",")) if args.arms else None,
        sessions=tuple(int(n) for n in args.sessions.split(",")) if args.sessions else None,
        window_s=args.window,
        warm_s=args.warm,
        levers=args.levers,
        rounds=args.rounds,
        server_nice=args.server_nice,
        profile_at=args.profile,
    )
    p = result["params"]
    print(f"wire capacity, {p['started']}, load {p['loadavg_before']} -> {p['loadavg_after']}")
    for arm, r in result["arms"].items():
        stops = "; ".join(sweep["stopped"] for sweep in r["rounds"])
        print(
            f"  {arm}: largest N with p99 <= {P99_TARGET_MS:g} ms, each round: {r['largest_n_p99_ok']} ({stops})"
        )
        for n, at in r["by_n"].items():
            print(
                f"    N={n}: CPU per frame {at['cpu_per_frame_us_all']} us (median where it kept up: "
                f"{at['cpu_per_frame_us']}), p99 {[_fmt(x) for x in at['p99_ms']]} ms"
            )
        for sweep in r["rounds"]:
            for step in sweep["steps"]:
                if "profile" in step:
                    _print_profile(step["profile"])
    for f in result["figures"]:
        ratio = f"{f['ratio']:.2f}x" if f["ratio"] is not None else "-"
        met = "" if f["met"] is None else (" MET" if f["met"] else " NOT MET")
        target = f" (target {f['target']}{met})" if f["target"] else ""
        value = "-" if f["value"] is None else f"{f['value']:.1f}"
        base = "-" if f["baseline"] is None else f"{f['baseline']:.1f}"
        print(f"  {f['metric']}: {value} {f['unit']} vs {base}: ratio {ratio}{target}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
