"""A server's stdout and stderr that drop what they cannot write instead of raising.

``serve`` logs to stderr and prints its operator lines there. Where that output goes can
fail while the server runs: the reader of its pipe exits (``serve 2>&1 | tee``, a log
shipper restarted), or the disk under a redirected log fills up (ENOSPC). Python then raises
``BrokenPipeError`` or ``OSError`` from ``print`` and from structlog, inside whatever was
logging: a SIGTERM's "shutting down" line ended the process without its drain, and
``serve --workers`` could not start at all. A server's clients matter more than its log
lines, so once :func:`make_output_lossy` has run, a write that fails is dropped, and the
next write that gets through is preceded by a line saying how many were lost and why.

Each line is written with one ``write(2)`` (``print`` writes a message and its newline
separately; they are joined here), so the lines of a server's processes, which share the
descriptor, do not interleave inside a line. A descriptor someone made non-blocking is
waited on, as a blocking one would be: output that cannot be written *yet* is not lost.
"""

from __future__ import annotations

import contextlib
import io
import os
import select
import sys
import threading

#: Text waiting for its newline is written out once it is this long anyway.
_PENDING_LIMIT = 1 << 16


class LossyStream(io.TextIOBase):
    """A text stream over file descriptor ``fd`` that drops a write the OS refuses."""

    def __init__(self, fd: int, encoding: str = "utf-8") -> None:
        super().__init__()
        self._fd = fd
        self._encoding = encoding
        self._pending: list[str] = []
        self._pending_chars = 0
        self._lock = threading.Lock()
        #: Writes dropped since the last one that got through, and the last reason.
        self.lost = 0
        self._why = ""

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
        with self._lock:
            self._emit()

    def _emit(self) -> None:
        if not self._pending:
            return
        text = "".join(self._pending)
        self._pending.clear()
        self._pending_chars = 0
        if self.lost:
            notice = f"({self.lost} writes to this stream were lost: {self._why})\n"
            if not self._write_all(notice.encode(self._encoding, "backslashreplace")):
                self.lost += 1  # still failing: this write is lost too
                return
            self.lost = 0
        if not self._write_all(text.encode(self._encoding, "backslashreplace")):
            self.lost += 1

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
                self._why = exc.strerror or type(exc).__name__
                return False
            view = view[written:]
        return True


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


__all__ = ["LossyStream", "make_output_lossy"]
