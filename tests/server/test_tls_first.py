"""A TLS connection is counted among those opening before its TLS handshake starts
(server/tls_first.py): a client that opens TCP connections and sends nothing holds no more of
them, and no more TLS state, than the per-address limit allows.

Before, an event loop made the websocket connection, and so counted it, only once its TLS
handshake was done: 2,000 silent connections from two addresses were all held for the
handshake timeout, adding 105 MiB to a `serve` process on uvloop and 602 MiB on asyncio's loop
(measured; with the count, 6.9 and 51 MiB)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import ssl
import subprocess
import sys
import time
import urllib.request

import anyio
import pytest
from websockets.asyncio.client import connect

from .conftest import recv_json, running_server
from .test_cli import LAUNCH
from .test_console import self_signed

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def tls(tmp_path):
    cert, key = self_signed(tmp_path)
    return {"tls_cert": str(cert), "tls_key": str(key)}, ssl.create_default_context(cafile=str(cert))


async def _still_open(reader: asyncio.StreamReader, wait_s: float = 0.5) -> bool:
    """Whether the server still holds this silent connection (it has neither written nor closed)."""
    try:
        with anyio.fail_after(wait_s):
            await reader.read(1)
    except TimeoutError:
        return True
    except OSError:
        pass
    return False


@pytest.mark.anyio
async def test_silent_tls_connections_are_counted_before_their_handshake_and_timed_out(tls):
    config, client_tls = tls
    async with running_server(
        max_handshakes_per_address=2, exempt_networks=(), handshake_timeout_s=1.0, **config
    ) as server:
        idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
        # A third connection from the address, silent or a real TLS client, is closed at once:
        # there is no plaintext to say why in, so no HTTP 503.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        assert not await _still_open(reader, 2.0)
        writer.close()
        with pytest.raises(OSError):
            async with connect(server.url, ssl=client_tls, open_timeout=5):
                pass
        # The two silent ones are closed after the handshake timeout, and their places freed.
        began = time.monotonic()
        for r, _w in idle:
            assert not await _still_open(r, 5.0)
        assert time.monotonic() - began < 3
        for _r, w in idle:
            w.close()
        async with connect(server.url, ssl=client_tls) as ws:
            assert (await recv_json(ws))["type"] == "session.created"
            # A session's own request was read: its count is over, and the address has its
            # places for new connections while the session lasts.
            held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
            # (Checked together: each is closed by the handshake timeout, 1 s, soon after.)
            assert await asyncio.gather(*(_still_open(r, 0.3) for r, _w in held)) == [True, True]
            for _r, w in held:
                w.close()


def _serve(extra: list[str], config: dict) -> subprocess.Popen:
    command = [sys.executable, "-c", LAUNCH, "serve", "--engine", "scripted", "--port", "0"]
    command += ["--tls-cert", config["tls_cert"], "--tls-key", config["tls_key"]]
    command += ["--max-handshakes-per-address", "8", "--exempt-networks", "10.0.0.0/8", *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


@pytest.mark.parametrize(
    "extra", [[], ["--loop", "asyncio"], ["--workers", "2"]], ids=["uvloop", "asyncio", "workers"]
)
def test_a_serve_process_holds_no_more_silent_tls_connections_than_the_address_may_open(tls, extra):
    if extra == [] and importlib.util.find_spec("uvloop") is None:
        pytest.skip("serve's default loop is asyncio's without uvloop: the asyncio case covers it")
    config, client_tls = tls
    process = _serve(extra, config)
    held: list[socket.socket] = []
    try:
        url = process.stdout.readline().split()[2]
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        for _ in range(40):  # one address, silent
            sock = socket.socket()
            sock.bind(("127.0.0.2", 0))
            sock.connect(("127.0.0.1", port))
            held.append(sock)
        time.sleep(1.0)
        still_open = 0
        for sock in held:
            sock.setblocking(False)
            try:
                sock.recv(1)  # b"": closed by the server
            except BlockingIOError:
                still_open += 1  # nothing to read, and not closed: held
            except OSError:
                pass  # reset by the server
        # Eight per address (with --workers, per worker: the front alternates between two).
        assert still_open == (16 if "--workers" in extra else 8), still_open
        # Another client is served meanwhile, over TLS.
        health = f"https://127.0.0.1:{port}/health"
        with urllib.request.urlopen(health, context=client_tls, timeout=10) as response:
            assert json.loads(response.read())["status"] == "ok"
    finally:
        for sock in held:
            sock.close()
        process.terminate()
        process.wait(30)
