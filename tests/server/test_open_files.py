"""``serve`` raises its soft limit on open descriptors to what ``--max-connections`` needs
(open_files.py): the rule without processes, then a real ``serve`` started under a shell's low
limit, holding more idle connections than that limit, still answering its health probe."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
import tempfile
import urllib.request

import pytest

from duplex_actors.server.open_files import RESERVE, descriptors_needed, raise_open_files_limit

NOFILE = resource.RLIMIT_NOFILE
INF = resource.RLIM_INFINITY


def test_what_one_process_of_serve_may_need():
    assert descriptors_needed(10_000) == 10_000 + RESERVE
    # --workers: the front holds a duplicate of each connection of each worker
    assert descriptors_needed(10_000, workers=4) == 40_000 + RESERVE
    # under TLS a relaying worker holds two per connection, which only matters past the front's
    assert descriptors_needed(100, workers=2, tls=True) == 200 + RESERVE


class _Limits:
    """getrlimit/setrlimit on a table, refusing what the kernel would (or ``refuse``)."""

    def __init__(self, soft: int, hard: int, refuse: bool = False) -> None:
        self.soft, self.hard, self.refuse = soft, hard, refuse

    def get(self, which: int) -> tuple[int, int]:
        assert which == NOFILE
        return self.soft, self.hard

    def set(self, which: int, limits: tuple[int, int]) -> None:
        soft, hard = limits
        if self.refuse or hard != self.hard or (self.hard != INF and soft > self.hard):
            raise ValueError("not allowed")
        self.soft = soft


@pytest.mark.parametrize(
    ("soft", "hard", "needed", "now", "short"),
    [
        (1024, 524_288, 10_256, 10_256, False),  # raised to what is needed, not to the ceiling
        (1024, 4096, 10_256, 4096, True),  # as far as the hard limit goes, and said to be short
        (65_536, 524_288, 10_256, 65_536, False),  # never lowered
        (1024, INF, 10_256, 10_256, False),  # no ceiling
    ],
)
def test_the_soft_limit_is_raised_toward_what_is_needed(soft, hard, needed, now, short):
    limits = _Limits(soft, hard)
    got = raise_open_files_limit(needed, getrlimit=limits.get, setrlimit=limits.set)
    assert got is not None
    assert (got.before, got.now, got.needed, got.short) == (soft, now, needed, short)
    assert limits.soft == now
    assert got.hard == (None if hard == INF else hard)


def test_a_kernel_that_refuses_leaves_the_limit_and_says_it_is_short():
    limits = _Limits(1024, 524_288, refuse=True)
    got = raise_open_files_limit(10_256, getrlimit=limits.get, setrlimit=limits.set)
    assert got is not None and got.now == 1024 and got.short and limits.soft == 1024
    assert "--max-connections 10000" in got.advice(10_000) and "ulimit -Hn" in got.advice(10_000)


# --------------------------------------------------------------------------- a real serve


@contextlib.contextmanager
def _serve_under(soft: int, hard: int | None = None, *extra: str):
    """``serve`` started as a shell with ``ulimit -n soft`` (``-Hn hard``) would start it: its
    http base URL, and a reader of its stderr."""

    def lower() -> None:
        _, current_hard = resource.getrlimit(NOFILE)
        resource.setrlimit(NOFILE, (soft, current_hard if hard is None else hard))

    command = [sys.executable, "-m", "duplex_actors", "serve", "--engine", "scripted", "--port", "0", *extra]
    with tempfile.TemporaryFile("w+") as errors:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=errors, text=True, preexec_fn=lower, env=dict(os.environ)
        )
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            assert "serving" in line, errors.seek(0) or errors.read()[-2000:]
            url = line.split()[2]

            def stderr() -> str:
                errors.seek(0)
                return errors.read()

            yield url.replace("ws://", "http://").rsplit("/v1/realtime", 1)[0], stderr
        finally:
            process.terminate()
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


def _health_while_held(http: str, n: int) -> int:
    """The health probe's status while ``n`` clients hold a connection each, having sent half a
    request head (each holds a descriptor until the handshake times out)."""
    host, port = http.removeprefix("http://").split(":")
    held = []
    try:
        for _ in range(n):
            sock = socket.create_connection((host, int(port)))
            sock.sendall(b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\n")
            held.append(sock)
        return _health(http)
    finally:
        for sock in held:
            sock.close()


def _health(http: str) -> int:
    with urllib.request.urlopen(f"{http}/health", timeout=10) as reply:
        return reply.status


_needs_1024 = pytest.mark.skipif(
    resource.getrlimit(NOFILE)[1] != INF and resource.getrlimit(NOFILE)[1] < 1024,
    reason="this machine's hard limit on open files is below 1,024",
)


@_needs_1024
def test_serve_started_with_a_low_ulimit_holds_more_idle_connections_than_it_and_stays_healthy():
    # With the soft limit serve was started with (256), the 300 held connections ran it out of
    # descriptors and the probe was reset (measured before open_files.py existed).
    with _serve_under(256) as (http, _):
        assert _health_while_held(http, 300) == 200


@_needs_1024
def test_serve_says_when_even_the_hard_limit_is_short_of_max_connections_and_serves_anyway():
    with _serve_under(512, 512) as (http, stderr):
        assert _health(http) == 200
        said = stderr()
    assert f"--max-connections 10000 needs up to {10_000 + RESERVE} open files" in said
    assert "may open 512" in said


@_needs_1024
def test_serve_workers_started_with_a_low_ulimit_holds_more_idle_connections_than_it():
    # The front holds a duplicate of each connection it handed over: before, it logged
    # "Too many open files" ten times a second and the probe timed out.
    with _serve_under(256, None, "--workers", "2") as (http, stderr):
        assert _health_while_held(http, 300) == 200
        assert "accept_failed" not in stderr()
