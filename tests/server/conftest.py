"""Fixtures for the websocket server tests: a live server on a loopback port per test."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import anyio
import pytest

pytest.importorskip("websockets")
pytest.importorskip("prometheus_client")

from duplex_actors import Runtime, Script, ScriptedEngine
from duplex_actors.server import RealtimeServer, ServerConfig

# 100 ms of quiet pcm16 at 24 kHz (the GA wire rate): what a microphone sends every 100 ms.
CHUNK_100MS = b"\x01\x00" * 2400
# The same at 16 kHz, for sessions that declared audio/pcm at 16000 Hz (our extension).
CHUNK_100MS_16K = b"\x01\x00" * 1600


@pytest.fixture
def anyio_backend():
    # DUPLEX_SERVER_LOOP=uvloop runs the server's tests on uvloop's event loop (scripts/test.sh
    # does, as a job of its own): an application may embed the server on either loop.
    if os.environ.get("DUPLEX_SERVER_LOOP") == "uvloop":
        return ("asyncio", {"use_uvloop": True})
    return "asyncio"


@contextlib.asynccontextmanager
async def running_server(
    script: Script = Script(token_latency_s=0.002), *, runtime_kw: dict | None = None, **config
) -> AsyncIterator[RealtimeServer]:
    config.setdefault("port", 0)
    config.setdefault("host", "127.0.0.1")
    async with Runtime(ScriptedEngine(script), **(runtime_kw or {})) as rt:
        async with RealtimeServer(rt, ServerConfig(**config)) as server:
            yield server


@pytest.fixture
async def server() -> AsyncIterator[RealtimeServer]:
    async with running_server() as srv:
        yield srv


class OfferCount:
    """The frames the server handled as websockets parsed them (``SessionReader.offer`` took
    them) and those it left to the reader."""

    def __init__(self) -> None:
        self.taken = 0
        self.left = 0


def count_offers(monkeypatch) -> OfferCount:
    """Count every offer of a frame to a session's reader from here on."""
    from duplex_actors.server.session_reader import SessionReader

    counts = OfferCount()
    offer = SessionReader.offer

    def counted(self, frame):
        took = offer(self, frame)
        if took:
            counts.taken += 1
        else:
            counts.left += 1
        return took

    monkeypatch.setattr(SessionReader, "offer", counted)
    return counts


def user_text(text: str, **extra) -> dict:
    """A user message item for ``conversation.item.create``."""
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}], **extra}


def resume_frame(**fields) -> str:
    """A ``session.resume`` frame (session_id, generation, resume_token, last_seq, control_id)."""
    return json.dumps({"type": "session.resume", **fields})


async def recv_json(ws, timeout: float = 5.0) -> dict:
    import anyio

    with anyio.fail_after(timeout):
        return json.loads(await ws.recv())


async def recv_until(ws, event_type: str, timeout: float = 5.0, limit: int = 500) -> list[dict]:
    """Events up to and including the first of ``event_type`` (bounded in count and time)."""
    import anyio

    out: list[dict] = []
    with anyio.fail_after(timeout):
        for _ in range(limit):
            event = json.loads(await ws.recv())
            out.append(event)
            if event["type"] == event_type:
                return out
    raise AssertionError(f"no {event_type} within {limit} events: {[e['type'] for e in out]}")


async def http_get(url: str, headers: dict | None = None) -> tuple[int, dict, str]:
    def fetch():
        request = urllib.request.Request(url, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, dict(response.headers), response.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read().decode()

    return await anyio.to_thread.run_sync(fetch)


def server_frames(data: bytes) -> list[tuple[int, bytes]]:
    """(opcode, payload) of each whole frame in ``data``, as a server sends them (unmasked):
    for bytes the front writes on a connection, which no client library is there to read."""
    frames = []
    while data:
        opcode, size, at = data[0] & 0x0F, data[1] & 0x7F, 2
        if size == 126:
            size, at = struct.unpack("!H", data[2:4])[0], 4
        elif size == 127:
            size, at = struct.unpack("!Q", data[2:10])[0], 10
        frames.append((opcode, data[at : at + size]))
        data = data[at + size :]
    return frames


def metric_sample(text: str, name: str, labels: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} not in metrics")


def serve_app():
    """A typer app with ``serve`` registered, as the ``duplex-actors`` command has it."""
    import typer

    from duplex_actors.server.cli_commands import register

    app = typer.Typer()

    @app.callback()
    def root() -> None:
        pass

    register(app)
    return app


def serve_help() -> str:
    """``serve --help``, wide enough that no option's name is wrapped."""
    from typer.testing import CliRunner

    result = CliRunner().invoke(serve_app(), ["serve", "--help"], env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    return result.output
