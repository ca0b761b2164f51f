"""A server's output that fails drops lines, not the server (server/lossy_output.py).

The real processes (``serve`` and ``serve --workers 2`` with their stderr on a full disk or a
pipe whose reader is gone, drained by SIGTERM) are in test_drain.py; here, the stream itself
over real descriptors."""

from __future__ import annotations

import fcntl
import os
import re
import sys
import threading

import pytest
import structlog
import typer

from duplex_actors.logconfig import configure
from duplex_actors.server import lossy_output
from duplex_actors.server.lossy_output import LossyStream, make_output_lossy

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")


@pytest.fixture
def pipe():
    read_end, write_end = os.pipe()
    yield read_end, write_end
    for fd in (read_end, write_end):
        try:
            os.close(fd)
        except OSError:
            pass


def test_a_pipe_whose_reader_is_gone_costs_the_lines_and_raises_nothing(pipe):
    read_end, write_end = pipe
    os.close(read_end)
    stream = LossyStream(write_end)
    print("first", file=stream, flush=True)
    print("second", file=stream, flush=True)
    assert stream.drain()
    assert stream.lost == 2


@needs_dev_full
def test_after_a_full_disk_the_next_line_that_gets_through_says_how_many_were_lost(pipe):
    read_end, write_end = pipe
    fd = os.open("/dev/full", os.O_WRONLY)
    stream = LossyStream(fd)
    print("lost one", file=stream, flush=True)
    print("lost two", file=stream, flush=True)
    assert stream.drain()
    assert stream.lost == 2
    os.dup2(write_end, fd)  # space again: the same descriptor now reaches a reader
    print("kept", file=stream, flush=True)
    assert stream.drain()
    os.close(fd)
    written = os.read(read_end, 4096).decode()
    assert written == "(2 writes to this stream were lost: No space left on device)\nkept\n"
    assert stream.lost == 0


def test_a_line_is_one_write_though_print_writes_it_in_two_parts(pipe, monkeypatch):
    # Processes that share the descriptor (serve --workers) must not interleave inside a line.
    read_end, write_end = pipe
    writes = []
    real_write = os.write

    def counted(fd, data):
        writes.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(lossy_output.os, "write", counted)
    stream = LossyStream(write_end)
    print("a whole line", file=stream)  # print: the text, then "\n"
    assert stream.drain()
    stream.write("no newline yet")  # held for its newline: not queued, so not written
    assert writes == [b"a whole line\n"]
    stream.flush()
    assert stream.drain()
    assert writes == [b"a whole line\n", b"no newline yet"]
    assert os.read(read_end, 4096) == b"a whole line\nno newline yet"


def test_a_full_non_blocking_pipe_is_waited_on_not_dropped(pipe):
    # Output that cannot be written yet is not lost: only a write the OS refuses is.
    read_end, write_end = pipe
    fcntl.fcntl(write_end, fcntl.F_SETFL, fcntl.fcntl(write_end, fcntl.F_GETFL) | os.O_NONBLOCK)
    filler = b"x" * 4096
    while True:
        try:
            os.write(write_end, filler)
        except BlockingIOError:
            break
    stream = LossyStream(write_end)
    writer = threading.Thread(target=lambda: print("after the wait", file=stream, flush=True))
    writer.start()
    received = b""
    while not received.endswith(b"after the wait\n"):
        received += os.read(read_end, 1 << 16)
    writer.join(10)
    assert not writer.is_alive()
    assert stream.lost == 0


def test_bytes_are_refused_as_by_any_text_stream_and_click_writes_to_it(pipe, monkeypatch):
    # click tells a text stream from a binary one by writing b"" to it: TypeError means text.
    read_end, write_end = pipe
    stream = LossyStream(write_end)
    with pytest.raises(TypeError):
        stream.write(b"")
    monkeypatch.setattr(sys, "stderr", stream)
    typer.echo("a warning", err=True)
    assert stream.drain()
    assert os.read(read_end, 4096) == b"a warning\n"


def test_structlog_writes_to_stderr_as_it_is_at_each_write(pipe, monkeypatch):
    # Logging is configured before serve replaces stderr: its lines must follow the new one.
    read_end, write_end = pipe
    configured = structlog.get_config()
    try:
        configure("warning", json=True)
        monkeypatch.setattr(sys, "stderr", LossyStream(write_end))
        structlog.get_logger("test").warning("after.replacement")
        assert sys.stderr.drain()
        assert b'"event": "after.replacement"' in os.read(read_end, 4096)
    finally:
        structlog.configure(**configured)


def test_make_output_lossy_replaces_stdout_and_stderr_over_their_own_descriptors(pipe, monkeypatch):
    read_end, write_end = pipe
    out = os.fdopen(os.dup(write_end), "w")
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", out)
    print("buffered before", file=out)  # flushed by the replacement, not lost or reordered
    make_output_lossy()
    assert isinstance(sys.stdout, LossyStream) and isinstance(sys.stderr, LossyStream)
    assert sys.stderr.fileno() == out.fileno()
    print("after", file=sys.stderr)
    assert sys.stderr.drain()
    assert os.read(read_end, 4096) == b"buffered before\nafter\n"
    make_output_lossy()  # twice: the same streams
    assert isinstance(sys.stderr, LossyStream) and sys.stderr.fileno() == out.fileno()
    out.close()


def test_a_reader_that_does_not_read_never_holds_the_writer_and_loses_the_oldest_lines(pipe):
    # Before, a write to a full pipe waited for the reader: the server's event loop with it
    # (test_drain.py has the real server). Now the writer thread waits; the caller never does,
    # and past what may wait, the oldest lines go first, counted.
    read_end, write_end = pipe
    filler = b"x" * 4096
    fcntl.fcntl(write_end, fcntl.F_SETFL, fcntl.fcntl(write_end, fcntl.F_GETFL) | os.O_NONBLOCK)
    # Full to the byte: a pipe that refuses 4 KiB may still take a 100-byte line, and a line
    # taken there let the writer thread write a first notice early (the uvloop job met it).
    for chunk in (filler, b"x"):
        while True:
            try:
                os.write(write_end, chunk)
            except BlockingIOError:
                break
    fcntl.fcntl(write_end, fcntl.F_SETFL, fcntl.fcntl(write_end, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    stream = LossyStream(write_end, max_waiting_bytes=1000)
    lines = [f"line {i:04d}".ljust(99) for i in range(40)]  # 100 bytes each with the newline

    def write_all() -> None:
        for line in lines:
            print(line, file=stream)

    writer = threading.Thread(target=write_all)
    writer.start()
    writer.join(10)
    assert not writer.is_alive()  # no write waited for the reader
    assert not stream.drain(0.2)  # the writer thread does wait: the pipe is still full
    lost = stream.lost
    received = b""
    while not received.endswith(lines[-1].encode() + b"\n"):
        received += os.read(read_end, 1 << 16)
    got = received.decode().lstrip("x").splitlines()
    # Read line by line: the lines in order, none twice, and each gap announced once, right
    # where it is, with its size. The writer thread may start late (a loaded host): then the
    # first line it takes already follows a gap, and a second gap comes after it; the counts
    # still add up to what the stream said it lost.
    notice = re.compile(
        r"\((\d+) writes to this stream were lost: the reader did not keep up "
        r"\(more than 1000 bytes waited\)\)"
    )
    expected, announced, since_gap, gaps = 0, 0, 0, 0
    for text in got:
        gap = notice.fullmatch(text)
        if gap is not None:
            assert gaps == 0 or since_gap > 0, got  # two notices in a row: one gap told twice
            expected += int(gap[1])
            announced += int(gap[1])
            since_gap, gaps = 0, gaps + 1
        else:
            assert expected < len(lines) and text == lines[expected], (text, got)
            expected += 1
            since_gap += 1
    assert expected == len(lines), got
    assert announced == lost and 1 <= gaps <= 2, got
    # The newest lines are kept, as many as fit in what may wait (the line in the writer's hand
    # counts there too).
    assert 9 <= since_gap <= 10, got
    assert stream.drain() and stream.lost == 0
