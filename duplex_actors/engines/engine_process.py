"""One engine process shared by several runtimes on the same machine, over a Unix socket.

What this module owns, and what it does not:

* :func:`serve_engine` runs in the engine process. It builds one backend with ``factory()``,
  starts it, and serves it on a Unix stream socket. Every connected runtime (one per worker
  process of ``serve --workers N``) sends requests into that *one* backend, so the backend's
  own batching (the embedded engine's scheduler, vLLM's continuous batching) spans the
  sessions of all workers. Compute never runs in the workers.
* :class:`EngineProcessClient` is the :class:`~duplex_actors.engines.base.EngineBackend` a
  worker's runtime holds. ``generate(request)`` sends one frame and yields the outputs the
  host streams back for that request id; cancelling the consuming task (how the engine actor
  aborts) or ``abort(request_id)`` sends an abort, which cancels the host-side stream (its
  ``finally`` frees the request) and forwards to the backend's own ``abort``.
* Routing, fencing and the one-terminal guarantee stay in the engine actor above. This module
  only carries streams, and turns a lost engine process into explicit retryable
  :class:`EngineFailure` outputs (never a hang).

Framing: a 4-byte big-endian length, then a pickle of a tuple. Pickle is safe here because
both ends are our own processes and the socket lives in a 0700 directory that only the
serving user can reach; it is also what carries the frozen attrs messages without a schema.
The host coalesces: every output that became ready during one event-loop pass goes out in one
frame (``("out", [(request_id, output), ...])``), so a burst costs one pickle and one write,
while a paced engine still sends each output as soon as it exists. The runtime side coalesces
the other way: the frames its sessions send during one pass (several sessions asking for a turn
at once) go out in one write, so the engine process wakes once for them, reads them together
and answers them in one frame. Each is still its own frame: the host reads them one by one.

Frames, runtime to host: ``("generate", request)``, ``("abort", request_id)``,
``("stats", token)``. Host to runtime: ``("hello", name, capabilities)`` once,
``("out", batch)``, ``("stats", token, dict)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import pickle
import struct
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

import structlog

from ..core.engine_io import Aborted, EngineFailure, EngineOutput, ModelTurnRequest, is_terminal
from ..errors import EngineFailed
from .base import EngineBackend, EngineCapabilities

log = structlog.get_logger(__name__)

_HEADER = struct.Struct(">I")
#: A frame larger than this is a bug on the other side, not data (audio turns are < 10 MiB).
MAX_FRAME_BYTES = 64 << 20


async def _read_frame(reader: asyncio.StreamReader) -> tuple[Any, ...]:
    header = await reader.readexactly(_HEADER.size)
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise EngineFailed(f"engine channel frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    message: tuple[Any, ...] = pickle.loads(await reader.readexactly(size))
    return message


def _frame(message: tuple[Any, ...]) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


# --------------------------------------------------------------------------- the host side


class _HostConnection:
    """One runtime connected to the engine host: its streams and its output batch."""

    def __init__(self, host: EngineHostServer, writer: asyncio.StreamWriter) -> None:
        self.host = host
        self.writer = writer
        self.pumps: dict[str, asyncio.Task[None]] = {}
        self.batch: list[tuple[str, EngineOutput]] = []
        self.flush_scheduled = False

    def emit(self, request_id: str, output: EngineOutput) -> None:
        self.batch.append((request_id, output))
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        batch, self.batch = self.batch, []
        if batch and not self.writer.is_closing():
            self.writer.write(_frame(("out", batch)))

    async def pump(self, request: ModelTurnRequest) -> None:
        rid = request.request_id
        backend = self.host.backend
        self.host.stream_started()
        ended = False
        try:
            async with contextlib.aclosing(backend.generate(request)) as stream:
                async for output in stream:
                    self.emit(rid, output)
                    if is_terminal(output, request.kind):
                        ended = True
                        return
        except asyncio.CancelledError:
            # abort() already sent Aborted; closing the stream above freed the request.
            ended = True
            raise
        except Exception as exc:  # one request's failure never takes the host down
            log.warning("engine_host.backend_raised", request_id=rid, error=repr(exc))
            self.emit(
                rid,
                EngineFailure(
                    rid, f"engine backend raised {type(exc).__name__}: {exc}", produced_at=time.perf_counter()
                ),
            )
            ended = True
        finally:
            self.host.stream_ended()
            if not ended:  # the backend's stream stopped without a terminal: make one
                self.emit(
                    rid,
                    EngineFailure(
                        rid, "engine stream ended without a terminal output", produced_at=time.perf_counter()
                    ),
                )

    def forget(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self.pumps.get(request_id) is task:
            del self.pumps[request_id]

    async def abort(self, request_id: str) -> None:
        task = self.pumps.pop(request_id, None)
        if task is not None and not task.done():
            # Say Aborted here, not in the pump: a pump cancelled before it ever ran has no
            # chance to, and the runtime's stream must still end with exactly one terminal.
            task.cancel()
            self.emit(request_id, Aborted(request_id, produced_at=time.perf_counter()))
        with contextlib.suppress(Exception):
            await self.host.backend.abort(request_id)


class EngineHostServer:
    """The engine process's server: one backend, any number of runtimes connected."""

    def __init__(self, backend: EngineBackend, path: str) -> None:
        self.backend = backend
        self.path = path
        self.connections: set[_HostConnection] = set()
        self.connections_total = 0
        self.streams_total = 0
        self.in_flight = 0
        self.max_in_flight = 0
        #: The most connected runtimes that had a stream open at the same moment: 2 with two
        #: workers means the backend saw both workers' sessions at once (and could batch them).
        self.max_runtimes_in_flight = 0
        self._server: asyncio.AbstractServer | None = None
        self._serving: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> EngineHostServer:
        await self.backend.start()
        self._server = await asyncio.start_unix_server(self._serve_connection, path=self.path)
        os.chmod(self.path, 0o600)
        log.info("engine_host.listening", path=self.path, backend=self.backend.name, pid=os.getpid())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        for conn in list(self.connections):
            for task in list(conn.pumps.values()):
                task.cancel()
            conn.writer.close()
        if self._serving:  # closed writers end each connection's read loop; let them finish
            await asyncio.wait(self._serving, timeout=2.0)
        with contextlib.suppress(Exception):
            await self.backend.aclose()

    def stream_started(self) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        busy = sum(1 for conn in self.connections if conn.pumps)
        self.max_runtimes_in_flight = max(self.max_runtimes_in_flight, busy)

    def stream_ended(self) -> None:
        self.in_flight -= 1

    def statistics(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "connections": len(self.connections),
            "connections_total": self.connections_total,
            "streams_total": self.streams_total,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "max_runtimes_in_flight": self.max_runtimes_in_flight,
        }

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _HostConnection(self, writer)
        task = asyncio.current_task()
        assert task is not None, "asyncio.start_server runs each connection in a task"
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)
        self.connections.add(conn)
        self.connections_total += 1
        writer.write(_frame(("hello", self.backend.name, self.backend.capabilities)))
        try:
            while True:
                message = await _read_frame(reader)
                kind = message[0]
                if kind == "generate":
                    request: ModelTurnRequest = message[1]
                    self.streams_total += 1
                    # registered before the pump runs, so stream_started() counts this runtime
                    task = conn.pumps[request.request_id] = asyncio.create_task(conn.pump(request))
                    task.add_done_callback(functools.partial(conn.forget, request.request_id))
                elif kind == "abort":
                    await conn.abort(message[1])
                elif kind == "stats":
                    writer.write(_frame(("stats", message[1], self.statistics())))
                else:
                    raise EngineFailed(f"unknown engine channel frame {kind!r}")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the runtime went away; its streams are cancelled below
        except Exception as exc:
            log.error("engine_host.connection_failed", error=repr(exc))
        finally:
            self.connections.discard(conn)
            for task in list(conn.pumps.values()):
                task.cancel()
            writer.close()


async def serve_engine(
    factory: Callable[[], EngineBackend],
    path: str,
    ready: Callable[[], None] | None = None,
    stop: asyncio.Event | None = None,
    linger_s: float = 0.0,
) -> None:
    """Run the engine host until ``stop`` is set (or forever), then for as long as a runtime
    is still connected, at most ``linger_s``. ``ready()`` is called once the socket accepts
    connections, so a parent can start workers without polling.

    The lingering is for a stop that reaches every process at once (a Ctrl-C in a terminal, a
    systemd stop of the unit's whole group): the workers drain, letting their responses in
    flight finish, and the engine must still be there to finish them. Stopped at once, it
    failed every one of them."""
    stop = stop or asyncio.Event()
    async with EngineHostServer(factory(), path) as host:
        if ready is not None:
            ready()
        await stop.wait()
        if host.connections and linger_s > 0:
            log.info("engine_host.lingering", connections=len(host.connections), at_most_s=linger_s)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(linger_s):
                    while host.connections:
                        await asyncio.sleep(0.05)


# --------------------------------------------------------------------------- the runtime side


class _Stream:
    __slots__ = ("outputs", "wake")

    def __init__(self) -> None:
        self.outputs: deque[EngineOutput] = deque()
        self.wake = asyncio.Event()


class EngineProcessClient:
    """An :class:`EngineBackend` whose model runs in the engine process at ``path``.

    ``capabilities`` and ``name`` are the hosted backend's, learned from the host's hello at
    ``start()``. If the engine process goes away, every open stream ends with a retryable
    :class:`EngineFailure`, and the next ``generate()`` reconnects (it fails the same way if
    the process is still gone).
    """

    def __init__(self, path: str, *, connect_timeout_s: float = 10.0) -> None:
        self.path = path
        self.connect_timeout_s = connect_timeout_s
        self.name = "engine-process"
        self.capabilities = EngineCapabilities()
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._streams: dict[str, _Stream] = {}
        self._stats_waiters: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._stats_token = 0
        self._connect_lock: asyncio.Lock | None = None
        self.disconnects = 0
        #: Frames sent during this loop pass, with the connection each is for; written at the
        #: pass's end (:meth:`_flush`), one write a connection.
        self._outbox: list[tuple[asyncio.StreamWriter, bytes]] = []

    @property
    def active(self) -> set[str]:
        return set(self._streams)

    async def start(self) -> None:
        await self._ensure_connected()

    async def aclose(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(BaseException):
                await self._reader_task
            self._reader_task = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._fail_open_streams("engine process client closed")

    async def _ensure_connected(self) -> asyncio.StreamWriter:
        if self._writer is not None and not self._writer.is_closing():
            return self._writer
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            if self._writer is not None and not self._writer.is_closing():
                return self._writer
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    reader, writer = await asyncio.open_unix_connection(self.path)
                    hello = await _read_frame(reader)
            except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                raise EngineFailed(f"cannot reach the engine process at {self.path}: {exc!r}") from exc
            if hello[0] != "hello":
                writer.close()
                raise EngineFailed(f"engine process sent {hello[0]!r} instead of hello")
            _, self.name, self.capabilities = hello
            self._writer = writer
            self._reader_task = asyncio.create_task(self._read_loop(reader))
            return writer

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        reason = "engine process connection lost"
        try:
            while True:
                message = await _read_frame(reader)
                if message[0] == "out":
                    for rid, output in message[1]:
                        stream = self._streams.get(rid)
                        if stream is not None:  # late output of an abandoned stream is dropped
                            stream.outputs.append(output)
                            stream.wake.set()
                elif message[0] == "stats":
                    waiter = self._stats_waiters.pop(message[1], None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(message[2])
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            reason = f"engine process connection lost: {exc!r}"
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = f"engine channel failed: {exc!r}"
            log.error("engine_process.read_failed", error=repr(exc))
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            self.disconnects += 1
            self._fail_open_streams(reason)
            for waiter in self._stats_waiters.values():
                if not waiter.done():
                    waiter.set_exception(EngineFailed(reason))
            self._stats_waiters.clear()

    def _fail_open_streams(self, reason: str) -> None:
        for rid, stream in list(self._streams.items()):
            stream.outputs.append(EngineFailure(rid, reason, retryable=True, produced_at=time.perf_counter()))
            stream.wake.set()

    def _send(self, writer: asyncio.StreamWriter, message: tuple[Any, ...]) -> None:
        """Queue a frame for ``writer``; the pass's frames go out together at its end."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append((writer, _frame(message)))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        # In practice one connection: a reconnect within the pass would make a second.
        for writer in dict.fromkeys(writer for writer, _ in outbox):
            # A closed connection's frames are dropped: its streams were failed when it closed.
            if not writer.is_closing():
                writer.write(b"".join(frame for to, frame in outbox if to is writer))

    async def generate(self, request: ModelTurnRequest) -> AsyncGenerator[EngineOutput, None]:
        rid = request.request_id
        try:
            writer = await self._ensure_connected()
        except EngineFailed as exc:
            yield EngineFailure(rid, str(exc), retryable=True, produced_at=time.perf_counter())
            return
        stream = self._streams[rid] = _Stream()
        finished = False
        try:
            self._send(writer, ("generate", request))
            while True:
                while stream.outputs:
                    output = stream.outputs.popleft()
                    yield output
                    if is_terminal(output, request.kind) or isinstance(output, EngineFailure):
                        finished = True
                        return
                stream.wake.clear()
                await stream.wake.wait()
        finally:
            self._streams.pop(rid, None)
            if not finished:  # the consumer stopped early (abort by cancellation): free it there
                self._send_abort(rid)

    def _send_abort(self, request_id: str) -> None:
        writer = self._writer
        if writer is not None and not writer.is_closing():
            self._send(writer, ("abort", request_id))

    async def abort(self, request_id: str) -> None:
        # The host answers with Aborted on the request's stream, which ends it normally.
        self._send_abort(request_id)

    async def remote_statistics(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The engine host's counters (connections, streams, the most requests in flight at
        once across every connected runtime)."""
        writer = await self._ensure_connected()
        self._stats_token += 1
        token = self._stats_token
        waiter: asyncio.Future[dict[str, Any]]
        waiter = self._stats_waiters[token] = asyncio.get_running_loop().create_future()
        self._send(writer, ("stats", token))
        async with asyncio.timeout(timeout_s):
            return await waiter


__all__ = ["EngineHostServer", "EngineProcessClient", "serve_engine", "MAX_FRAME_BYTES"]
