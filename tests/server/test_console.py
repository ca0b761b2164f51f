"""The web console's server side: its files at /, the operator JSON behind the key, the opt-in
``duplex.state`` events that drive its live chart, and TLS (wss/https)."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import urllib.request
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from duplex_actors.server.console import console_files

from .conftest import CHUNK_100MS, http_get, recv_json, recv_until, running_server, user_text

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]


async def test_the_console_is_served_from_the_package_and_nothing_else_is():
    async with running_server(api_key="k1") as server:
        status, headers, body = await http_get(server.http_url + "/")
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert "default-src 'self'" in headers["Content-Security-Policy"]
        # Every script and style the page names is one of the package's own files.
        for name in ("app.js", "console.css"):
            assert f"/console/{name}" in body
            status, headers, text = await http_get(server.http_url + f"/console/{name}")
            assert status == 200 and text.encode() == console_files()[name]
        assert "http://" not in body and "https://" not in body  # no CDN, no other origin
        status, headers, svg = await http_get(server.http_url + "/console/session.svg")
        assert status == 200 and headers["Content-Type"] == "image/svg+xml" and "<svg" in svg
        for bad in ("/console/../app.py", "/console/nope.js", "/console/", "/console/%2e%2e/cli.py"):
            status, _, _ = await http_get(server.http_url + bad)
            assert status == 404, bad


def test_the_packaged_chart_is_the_exported_one_with_every_state():
    """duplex_actors/console/session.svg links to statecharts/session.svg (a wheel gets the
    file's contents), so the console always draws the chart `statechart --check` keeps in step
    with the code; the page highlights its nodes by their titles."""
    packaged = console_files()["session.svg"].decode()
    assert packaged == (ROOT / "statecharts" / "session.svg").read_text(encoding="utf-8")
    for state in ("idle", "listening", "responding", "barge_in", "closed"):
        assert f'class="node">\n<title>{state}</title>' in packaged, state


async def test_operator_view_needs_the_key_and_counts_sessions_by_state():
    async with running_server(api_key="k1") as server:
        status, headers, _ = await http_get(server.http_url + "/v1/operator")
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        status, _, _ = await http_get(server.http_url + "/v1/operator", {"Authorization": "Bearer nope"})
        assert status == 401
        async with connect(server.url, subprotocols=["realtime", "openai-insecure-api-key.k1"]) as ws:
            await recv_json(ws)
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": _b64(CHUNK_100MS)}))
            await ws.send(json.dumps({"type": "heartbeat"}))
            await recv_until(ws, "heartbeat.ack")
            status, headers, body = await http_get(
                server.http_url + "/v1/operator", {"Authorization": "Bearer k1"}
            )
            assert status == 200 and headers["Content-Type"] == "application/json"
            view = json.loads(body)
            assert view["sessions"]["open"] == 1
            assert view["sessions"]["by_state"] == {"listening": 1}
            assert [s["state"] for s in view["sessions"]["listed"]] == ["listening"]
            assert view["engine"] == "scripted"
            assert view["engine_requests"]["in_flight"] == 0
            assert view["queues"]["mailbox_total"] == 0 and view["connections"] == 1
            # Polled again at once, the same snapshot (made at most once per metrics_max_age_s);
            # the lag probe started with the first request and has samples by a later one.
            renders = server.console.renders
            _, _, again = await http_get(server.http_url + "/v1/operator", {"Authorization": "Bearer k1"})
            assert again == body and server.console.renders == renders
            import anyio

            await anyio.sleep(1.05)
            _, _, body = await http_get(server.http_url + "/v1/operator", {"Authorization": "Bearer k1"})
            lag = json.loads(body)["loop_lag_ms"]
            assert lag is not None and 0 <= lag["last"] <= lag["max"]


async def test_state_events_are_opt_in_and_follow_the_chart(server):
    async with connect(server.url) as ws:
        await recv_json(ws)  # session.created
        # Off by default: a GA client sees no duplex.state.
        await ws.send(json.dumps({"type": "conversation.item.create", "item": user_text("hi")}))
        await ws.send(json.dumps({"type": "response.create"}))
        events = await recv_until(ws, "response.done")
        assert not [e for e in events if e["type"] == "duplex.state"]
        await ws.send(json.dumps({"type": "session.update", "session": {"duplex": {"state_events": True}}}))
        events = await recv_until(ws, "duplex.state")
        updated = next(e for e in events if e["type"] == "session.updated")
        assert updated["session"]["duplex"]["state_events"] is True
        # Turned on: where the chart is now.
        assert {k: events[-1][k] for k in ("from", "to", "trigger")} == {
            "from": "idle",
            "to": "idle",
            "trigger": "update",
        }
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": _b64(CHUNK_100MS)}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))
        events = await recv_until(ws, "response.done")
        # One per change of state, each from where the last left off, ending idle.
        states = [(e["from"], e["to"], e["trigger"]) for e in events if e["type"] == "duplex.state"]
        assert states == [
            ("idle", "listening", "append"),
            ("listening", "idle", "commit"),
            ("idle", "responding", "create_response"),
        ], states
        tail = await recv_until(ws, "duplex.state")
        assert (tail[-1]["from"], tail[-1]["to"], tail[-1]["trigger"]) == ("responding", "idle", "turn_done")
        # Off again: none.
        await ws.send(json.dumps({"type": "session.update", "session": {"duplex": {"state_events": False}}}))
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": _b64(CHUNK_100MS)}))
        await ws.send(json.dumps({"type": "heartbeat"}))
        events = await recv_until(ws, "heartbeat.ack")
        assert not [e for e in events if e["type"] == "duplex.state"]


async def test_tls_serves_wss_and_https_with_the_console(tmp_path):
    cert, key = _self_signed(tmp_path)
    async with running_server(api_key="k1", tls_cert=str(cert), tls_key=str(key)) as server:
        assert server.url.startswith("wss://") and server.http_url.startswith("https://")
        trust = ssl.create_default_context(cafile=str(cert))
        page = await _https_get(server.http_url + "/", trust)
        assert "duplex-actors console" in page
        async with connect(server.url, ssl=trust, additional_headers={"Authorization": "Bearer k1"}) as ws:
            assert (await recv_json(ws))["type"] == "session.created"
            await ws.send(json.dumps({"type": "conversation.item.create", "item": user_text("hi")}))
            await ws.send(json.dumps({"type": "response.create"}))
            done = (await recv_until(ws, "response.done"))[-1]
            assert done["response"]["status"] == "completed"
        # A client that does not trust the certificate is refused by TLS, not served in clear.
        with pytest.raises(ssl.SSLCertVerificationError):
            async with connect(server.url, ssl=ssl.create_default_context()):
                pass


def test_tls_needs_both_files(tmp_path):
    from duplex_actors.server.tls import server_ssl_context

    cert, _ = _self_signed(tmp_path)
    assert server_ssl_context(None, None) is None
    with pytest.raises(ValueError, match="both"):
        server_ssl_context(str(cert), None)


async def _https_get(url: str, context: ssl.SSLContext) -> str:
    import anyio

    def fetch():
        with urllib.request.urlopen(url, context=context, timeout=10) as r:
            return r.read().decode()

    return await anyio.to_thread.run_sync(fetch)


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, made here with the openssl CLI."""
    return self_signed(folder)


def self_signed(folder: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make a test certificate")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def test_serve_refuses_half_a_tls_pair(tmp_path):
    from typer.testing import CliRunner

    from duplex_actors.cli import app

    cert, _ = self_signed(tmp_path)
    half = CliRunner().invoke(app, ["serve", "--tls-cert", str(cert)])
    assert half.exit_code == 2 and "go together" in half.output
