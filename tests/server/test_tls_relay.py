"""The TLS relay of ``serve --workers`` (server/tls_relay.py), in one process: two real servers
with TLS, one adopting sockets as a worker does and relaying a resume of the other's session to
it over a real Unix socket; and the preamble that carries the client's address."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from duplex_actors.server.tls_relay import preamble, read_preamble, session_id_in

from .conftest import recv_json, resume_frame, running_server
from .test_console import self_signed

pytestmark = [pytest.mark.timeout(60), pytest.mark.anyio]


@given(
    host=st.ip_addresses().map(str) | st.sampled_from(["?", "localhost"]),
    port=st.integers(0, 65535),
    rest=st.binary(max_size=40),
)
@pytest.mark.filterwarnings("ignore")
def test_a_preamble_reads_back_once_complete_and_takes_only_its_own_bytes(host, port, rest):
    sent = preamble((host, port))
    for cut in range(len(sent)):
        assert read_preamble(bytearray(sent[:cut])) is None  # not all of it yet
    assert read_preamble(bytearray(sent + rest)) == ((host, port), len(sent))


def test_a_preamble_without_a_peer_is_refused():
    with pytest.raises(ValueError):
        read_preamble(bytearray(b"\x00\x04abcd"))


def test_the_session_id_of_a_request_line():
    assert session_id_in(b"GET /v1/realtime?session_id=sess_w1g0_ab&x=1 HTTP/1.1") == "sess_w1g0_ab"
    assert session_id_in(b"GET /v1/realtime HTTP/1.1") is None
    assert session_id_in(b"GET /health?session_id= HTTP/1.1") is None
    assert session_id_in(b"garbage") is None


@contextlib.asynccontextmanager
async def _adopting(server):
    """A TCP listener whose connections ``server`` adopts, as a worker adopts the front's."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    loop = asyncio.get_running_loop()

    async def accept() -> None:
        while True:
            conn, _ = await loop.sock_accept(listener)
            conn.setblocking(False)
            loop.create_task(server.adopt(conn))

    task = loop.create_task(accept())
    try:
        yield f"wss://127.0.0.1:{listener.getsockname()[1]}{server.config.path}"
    finally:
        task.cancel()
        listener.close()


@pytest.fixture
def tls(tmp_path):
    cert, key = self_signed(tmp_path)
    return {"tls_cert": str(cert), "tls_key": str(key)}, ssl.create_default_context(cafile=str(cert))


async def test_a_resume_relayed_to_the_owner_continues_its_session_as_the_client_it_came_from(tls, tmp_path):
    options, trust = tls
    relay = str(tmp_path / "relay1.sock")
    async with running_server(**options) as owner, running_server(**options) as relaying:
        await owner.serve_relays(relay)
        minted = set()
        relaying.relay_path = lambda sid: relay if sid in minted else None
        first = await connect(owner.url, ssl=trust)
        created = await recv_json(first)
        first.transport.abort()  # the connection is lost, not closed: the session waits for a resume
        sid, token = created["session"]["id"], created["resume_token"]
        minted.add(sid)
        async with _adopting(relaying) as url:
            # A new session through the relaying server is its own: served there.
            async with connect(url, ssl=trust) as fresh:
                assert (await recv_json(fresh))["type"] == "session.created"
                assert relaying.metrics.relays.labels("out")._value.get() == 0
            async with connect(f"{url}?session_id={sid}", ssl=trust) as ws:
                await ws.send(resume_frame(session_id=sid, generation=0, resume_token=token, last_seq=1))
                resumed = await recv_json(ws)
                assert resumed["type"] == "session.resumed", resumed
                await ws.send(json.dumps({"type": "heartbeat"}))
                assert (await recv_json(ws))["type"] == "heartbeat.ack"
                attached = owner._records[sid].attached
                assert attached is not None
                # The owner counts the client the preamble named, not the relay socket.
                assert attached.ws.remote_address[:2] == ws.local_address[:2]
        assert relaying.metrics.relays.labels("out")._value.get() == 1
        assert owner.metrics.relays.labels("in")._value.get() == 1
        with anyio.fail_after(5):
            while relaying._sniffers:  # the relay ended with the client's connection
                await anyio.sleep(0.01)


async def test_a_resume_whose_owner_is_not_listening_is_served_here(tls, tmp_path):
    options, trust = tls
    lost = {"sess_gone"}
    async with running_server(**options) as server:
        server.relay_path = lambda sid: str(tmp_path / "nobody.sock") if sid in lost else None
        server.lost_session = lambda sid: sid in lost
        async with _adopting(server) as url:
            async with connect(f"{url}?session_id=sess_gone", ssl=trust) as ws:
                await ws.send(
                    resume_frame(session_id="sess_gone", generation=0, resume_token="t", last_seq=1)
                )
                refusal = await recv_json(ws)
                with pytest.raises(ConnectionClosed):
                    await recv_json(ws)
        assert refusal["error"]["code"] == "session_lost" and ws.close_code == 4404, refusal
        assert server.metrics.relays.labels("out")._value.get() == 0


async def test_a_request_line_that_never_ends_is_cut_off(tls):
    options, trust = tls
    async with running_server(**options) as server:
        server.relay_path = lambda sid: None
        async with _adopting(server) as url:
            port = int(url.split(":")[2].split("/")[0])
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=trust, server_hostname="localhost"
            )
            writer.write(b"GET /" + b"a" * 9000)
            with anyio.fail_after(5):
                assert await reader.read() == b""  # closed, nothing answered
            writer.close()
        with anyio.fail_after(5):
            while server._sniffers:
                await anyio.sleep(0.01)


async def test_connections_reading_their_request_line_count_against_the_handshake_cap(tls):
    """A worker under TLS reads each request line itself: those connections count as opening,
    per address, as a websocket connection's do, from before their TLS handshake; past the cap,
    closed at once, before any TLS (tls_first.py: there is no plaintext to answer 503 in, and
    a refusal that first ran the handshake would cost what the cap is there to save)."""
    options, trust = tls
    async with running_server(**options, max_handshakes_per_address=2, exempt_networks=()) as server:
        server.relay_path = lambda sid: None
        async with _adopting(server) as url:
            port = int(url.split(":")[2].split("/")[0])
            held = [
                await asyncio.open_connection("127.0.0.1", port, ssl=trust, server_hostname="localhost")
                for _ in range(2)
            ]  # TLS done, no request line: both still opening
            with anyio.fail_after(5):
                while len(server._sniffers) < 2:
                    await anyio.sleep(0.01)
            with anyio.fail_after(5), pytest.raises(OSError):  # the TLS handshake fails
                await asyncio.open_connection("127.0.0.1", port, ssl=trust, server_hostname="localhost")
            for _, held_writer in held:
                held_writer.close()
            with anyio.fail_after(5):
                while server._sniffers:
                    await anyio.sleep(0.01)
            # Both left the count: a new connection opens and is served.
            async with connect(url, ssl=trust) as ws:
                assert (await recv_json(ws))["type"] == "session.created"
