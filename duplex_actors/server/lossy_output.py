"""A server's stdout and stderr that drop what they cannot write instead of raising or waiting.

``serve`` logs to stderr and prints its operator lines there. Where that output goes can
fail while the server runs: the reader of its pipe exits (``serve 2>&1 | tee``, a log
shipper restarted), or the disk under a redirected log fills up (ENOSPC). Python then raises
``BrokenPipeError`` or ``OSError`` from ``print`` and from structlog, inside whatever was
logging: a SIGTERM's "shutting down" line ended the process without its drain, and
``serve --workers`` could not start at all. A server's clients matter more than its log
lines, so once :func:`make_output_lossy` has run, a write that fails is dropped, and the
next write that gets through is preceded by a line saying how many were lost and why.

The reader can also be there and not read: a pager or a terminal paused, a log shipper or a
container runtime's logging driver that blocks while its own destination is slow. A write to
a full pipe waits, and it was made on the event loop, so every session waited with it: once a
pipe nobody read was full, the next warning line froze ``serve`` (docs/reliability.md).
So the lines are written by a thread of their own; the loop only queues them. Past
``max_waiting_bytes`` (1 MiB) waiting for a reader that does not keep up, the oldest lines
are dropped, and counted as any other lost write. :meth:`LossyStream.drain` waits (bounded) for what is
queued; a process's exit does so for its streams, the exits of ``multiprocessing`` children
(``serve --workers``: they end with ``os._exit``) included.

Each line is written with one ``write(2)`` (``print`` writes a message and its newline
separately; they are joined here), so the lines of a server's processes, which share the
descriptor, do not interleave inside a line. A descriptor someone made non-blocking is
waited on, as a blocking one would be: output that cannot be written *yet* is not lost.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing.util
import os
import select
import sys
import threading
import time
import weakref
from collections import deque

#: Text waiting for its newline is written out once it is this long anyway.
_PENDING_LIMIT = 1 << 16
#: Bytes of lines that may wait for a reader that does not keep up; past them, lines are dropped.
MAX_WAITING_BYTES = 1 << 20
#: How long a process's exit waits for its streams' queued lines.
EXIT_DRAIN_S = 2.0


class _Line:
    """Bytes to write in one ``write(2)``, and how many lines were dropped just before them."""

    __slots__ = ("data", "dropped")

    def __init__(self, data: bytes, dropped: int) -> None:
        self.data = data
        self.dropped = dropped


class LossyStream(io.TextIOBase):
    """A text stream over file descriptor ``fd`` that drops a write the OS refuses, and lines
    past ``max_waiting_bytes`` waiting for a reader that does not keep up (the oldest first). Its lines are
    written by a thread of its own: a write never waits for the reader."""

    def __init__(
        self, fd: int, encoding: str = "utf-8", *, max_waiting_bytes: int = MAX_WAITING_BYTES
    ) -> None:
        super().__init__()
        self._fd = fd
        self._encoding = encoding
        self.max_waiting_bytes = max_waiting_bytes
        self._pending: list[str] = []  # text of the line being written, waiting for its newline
        self._pending_chars = 0
        self._lock = threading.Lock()  # the pending text
        self._init_queue()
        _STREAMS.add(self)

    def _init_queue(self) -> None:
        self._ready = threading.Condition(threading.Lock())  # the queue and the counts below
        self._lines: deque[_Line] = deque()
        self._waiting_bytes = 0
        self._failed = 0  # lines the writer could not write since its last success
        self._writing = False  # the writer holds a line taken from the queue
        self._in_hand_lost = 0  # while it does: the loss that line announces
        self._writer: threading.Thread | None = None
        self._why = ""  # the last loss's reason

    @property
    def lost(self) -> int:
        """Lines dropped since the last one that got through (or waits to)."""
        with self._ready:
            # A line in the writer's hand still owes its notice: its loss counts until written.
            before = self._in_hand_lost if self._writing else self._failed
            return before + sum(line.dropped for line in self._lines)

    @property
    def encoding(self) -> str:  # type: ignore[override]  # TextIOBase declares it read-only
        return self._encoding

    @property
    def errors(self) -> str:  # type: ignore[override]
        return "backslashreplace"

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        try:
            return os.isatty(self._fd)
        except OSError:
            return False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):  # as any text stream (click tells text from bytes so)
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        with self._lock:
            self._pending.append(text)
            self._pending_chars += len(text)
            if "\n" in text or self._pending_chars >= _PENDING_LIMIT:
                self._emit()
        return len(text)

    def flush(self) -> None:
        """Hand the text so far to the writer. It does not wait for the reader (structlog
        flushes after every line): :meth:`drain` does."""
        with self._lock:
            self._emit()

    def drain(self, timeout: float = EXIT_DRAIN_S) -> bool:
        """Wait until every queued line is written (or dropped), at most ``timeout`` seconds;
        whether they were."""
        self.flush()
        deadline = time.monotonic() + timeout
        with self._ready:
            while self._lines or self._writing:
                left = deadline - time.monotonic()
                if left <= 0 or self._writer is None or not self._writer.is_alive():
                    return False
                self._ready.wait(left)
        return True

    def _emit(self) -> None:
        if not self._pending:
            return
        data = "".join(self._pending).encode(self._encoding, "backslashreplace")
        self._pending.clear()
        self._pending_chars = 0
        with self._ready:
            lines = self._lines
            dropped = 0
            # A reader that does not keep up loses the oldest lines, not the newest: what the
            # server says last (why it is shutting down) is what an operator looks for.
            while lines and self._waiting_bytes + len(data) > self.max_waiting_bytes:
                oldest = lines.popleft()
                self._waiting_bytes -= len(oldest.data)
                dropped += oldest.dropped + 1
            if dropped:
                self._why = f"the reader did not keep up (more than {self.max_waiting_bytes} bytes waited)"
            lines.append(_Line(data, dropped))  # a gap is announced before the line after it
            if len(lines) > 1 and dropped:  # the oldest kept line comes after the gap
                lines[-1].dropped = 0
                lines[0].dropped += dropped
            self._waiting_bytes += len(data)
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_lines, name=f"lossy-output-fd{self._fd}", daemon=True
                )
                self._writer.start()
            self._ready.notify_all()

    def _write_lines(self) -> None:
        """The writer thread: the queued lines in order, each in one write, a dropped run
        announced before the next line that gets through."""
        ready = self._ready
        while True:
            with ready:
                while not self._lines:
                    ready.wait()
                line = self._lines.popleft()
                self._writing = True
                lost = self._in_hand_lost = self._failed + line.dropped
                why = self._why
            data = line.data
            if lost:
                notice = f"({lost} writes to this stream were lost: {why})\n"
                data = notice.encode(self._encoding, "backslashreplace") + data
            ok = self._write_all(data)
            with ready:
                self._waiting_bytes -= len(line.data)
                self._failed = 0 if ok else lost + 1
                self._writing = False
                ready.notify_all()

    def _write_all(self, data: bytes) -> bool:
        view = memoryview(data)
        while view:
            try:
                written = os.write(self._fd, view)
            except BlockingIOError:
                # Non-blocking (the descriptor is shared with whoever made it so): full for
                # now, not gone. A blocking descriptor would wait here too.
                with contextlib.suppress(OSError, ValueError):
                    select.select([], [self._fd], [], 1.0)
                continue
            except OSError as exc:  # EPIPE, ENOSPC, EIO, EBADF: this much is lost
                with self._ready:
                    self._why = exc.strerror or type(exc).__name__
                return False
            view = view[written:]
        return True

    def _after_fork(self) -> None:
        # The parent's writer did not come along, and its queued lines are the parent's to
        # write: the child starts empty.
        self._lock = threading.Lock()
        self._pending.clear()
        self._pending_chars = 0
        self._init_queue()


_STREAMS: weakref.WeakSet[LossyStream] = weakref.WeakSet()


def _drain_all(timeout: float = EXIT_DRAIN_S) -> None:
    """At a process's exit: what its streams queued goes out, waiting at most ``timeout``."""
    deadline = time.monotonic() + timeout
    for stream in list(_STREAMS):
        stream.drain(max(0.0, deadline - time.monotonic()))


def _after_fork_in_child() -> None:
    for stream in list(_STREAMS):
        stream._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_drain_all)


def make_output_lossy() -> None:
    """Replace ``sys.stdout`` and ``sys.stderr`` by :class:`LossyStream` over the same
    descriptors (each that has one). For a server's process, at its start: a command that
    runs to its end should rather stop when its output is gone."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, LossyStream):
            continue
        try:
            fd = stream.fileno()
        except (OSError, ValueError, AttributeError):
            continue  # not a descriptor (a test's capture): left as it is
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
        setattr(sys, name, LossyStream(fd, getattr(stream, "encoding", None) or "utf-8"))
    # multiprocessing's children end with os._exit, past atexit: their exit runs its
    # finalizers, this one among them (idempotent where atexit runs it too).
    multiprocessing.util.Finalize(None, _drain_all, exitpriority=0)


__all__ = ["LossyStream", "make_output_lossy"]
