"""``duplex-actors serve`` as a real process: starts, serves, stops on SIGINT."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import anyio
import pytest
import websockets
from typer.testing import CliRunner

from duplex_actors.audio.transcription import IDLE_UNLOAD_S
from duplex_actors.client import DuplexClient

from .conftest import CHUNK_100MS, recv_json, recv_until, serve_app

pytestmark = [pytest.mark.timeout(60)]

LAUNCH = """
import typer
from duplex_actors.server.cli_commands import register
app = typer.Typer()
@app.callback()
def root() -> None: pass
register(app)
app()
"""


def test_serve_is_registered_with_its_options():
    app = serve_app()
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})  # no wrapped names
    assert result.exit_code == 0
    for option in (
        "--host",
        "--port",
        "--engine",
        "--api-key",
        "--max-frame-bytes",
        "--max-chunk-bytes",
        "--max-sessions",
        "--audio-intake-rate",
        "--audio-intake-burst-s",
        "--frame-intake-bytes-per-s",
        "--transcription-backlog-s",
        "--transcription-workers",
        "--transcription-idle-s",
        "--journal-budget-mb",
        "--connect-rate-per-address",
        "--connect-rate-per-key",
        "--loop",
    ):
        assert option in result.output
    bad = CliRunner().invoke(app, ["serve", "--engine", "vllm"])
    assert bad.exit_code != 0 and "--model" in bad.output


def _served_config(monkeypatch, *given: str):
    """The ServerConfig ``serve --engine scripted *given`` would run with (nothing started)."""
    from duplex_actors.server import event_loop

    configs = []
    monkeypatch.setattr(
        event_loop, "run_anyio", lambda main, engine, config, *rest, choice: configs.append(config)
    )
    result = CliRunner().invoke(serve_app(), ["serve", "--engine", "scripted", *given])
    assert result.exit_code == 0, result.output
    (config,) = configs
    return config


@pytest.mark.parametrize(("given", "window_s"), [((), 0.01), (("--vad-batch-window-ms", "0"), 0.0)])
def test_the_vad_batch_window_reaches_the_servers_config(monkeypatch, given, window_s):
    # The trade-off between VAD latency and CPU a frame is the operator's (docs/benchmarks.md).
    assert _served_config(monkeypatch, *given).vad_batch_window_s == window_s
    negative = CliRunner().invoke(serve_app(), ["serve", "--vad-batch-window-ms", "-1"])
    assert negative.exit_code != 0


@pytest.mark.parametrize(("given", "precision"), [((), "float32"), (("--vad-precision", "int8"), "int8")])
def test_the_vad_precision_reaches_the_servers_config(monkeypatch, given, precision):
    # int8 saves VAD CPU for slightly different decisions: the operator's choice.
    assert _served_config(monkeypatch, *given).vad_precision == precision
    other = CliRunner().invoke(serve_app(), ["serve", "--vad-precision", "int4"])
    assert other.exit_code == 2, other.output


@pytest.mark.parametrize(
    ("given", "limit"),
    [
        ((), 8 << 20),
        (("--read-ahead-mb-per-client", "32"), 32 << 20),
        (("--read-ahead-mb-per-client", "0"), None),
    ],
)
def test_the_read_ahead_per_client_reaches_the_servers_config(monkeypatch, given, limit):
    # What one client may hold parsed and unhandled over its connections (server/read_ahead.py).
    assert _served_config(monkeypatch, *given).read_ahead_bytes_per_client == limit
    negative = CliRunner().invoke(serve_app(), ["serve", "--read-ahead-mb-per-client", "-1"])
    assert negative.exit_code != 0


@pytest.mark.parametrize(("given", "pace"), [((), 1.0), (("--scripted-pace", "2.5"), 2.5)])
def test_the_scripted_pace_stretches_the_scripted_engines_latencies(monkeypatch, given, pace):
    # A client's barge-in tests need a model that is still answering when the user cuts in.
    from duplex_actors.server import event_loop
    from duplex_actors.server.workers import WorkerSettings

    engines = []
    monkeypatch.setattr(event_loop, "run_anyio", lambda main, engine, *rest, choice: engines.append(engine))
    result = CliRunner().invoke(serve_app(), ["serve", "--engine", "scripted", *given])
    assert result.exit_code == 0, result.output
    for engine in (*engines, WorkerSettings(engine="scripted", scripted_pace=pace).build_engine()):
        script = engine.script_for(None)  # a fixed Script: the same for every request
        assert (script.first_latency_s, script.token_latency_s, script.packet_latency_s) == pytest.approx(
            (0.05 * pace, 0.02 * pace, 0.02 * pace)
        )
    assert len(engines) == 1
    zero = CliRunner().invoke(serve_app(), ["serve", "--engine", "scripted", "--scripted-pace", "0"])
    assert zero.exit_code == 2, zero.output


def _uvloop_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("uvloop") is not None


@pytest.mark.anyio
@pytest.mark.parametrize("loop", [None, "asyncio", "uvloop"])
async def test_serve_process_answers_health_and_a_session_then_stops_on_sigint(loop):
    if loop == "uvloop" and not _uvloop_installed():
        pytest.skip("uvloop is not installed here")
    # The default (auto) is uvloop wherever it is installed; asyncio's own loop on request.
    runs_on = loop or ("uvloop" if _uvloop_installed() else "asyncio")
    env = dict(os.environ, DUPLEX_API_KEY="cli-key")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LAUNCH,
            "serve",
            *(("--loop", loop) if loop else ()),
            "--engine",
            "scripted",
            "--port",
            "0",
            "--audio-intake-rate",
            "8",
            "--transcription-backlog-s",
            "12",
            "--journal-budget-mb",
            "64",
            "--connect-rate-per-key",
            "0.1",  # a token every 10 s: none comes back while this test connects
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        with anyio.fail_after(30):
            line = await anyio.to_thread.run_sync(proc.stdout.readline)
        assert "serving ws://127.0.0.1:" in line and "auth=on" in line, line
        assert f"loop={runs_on})" in line, line
        url = line.split()[2]
        http = url.replace("ws://", "http://").rsplit("/v1/realtime", 1)[0]
        body = await anyio.to_thread.run_sync(
            lambda: urllib.request.urlopen(http + "/health", timeout=5).read()
        )
        assert json.loads(body)["status"] == "ok"
        async with await DuplexClient.connect(url, api_key="cli-key") as client:
            await client.recv()
            await client.send_audio(CHUNK_100MS)
            await client.commit()
            await client.create_response()
            done, _ = await client.wait_for("response.done", timeout=15)
            assert done["response"]["status"] == "completed"
        # --connect-rate-per-key: past the burst of 20 the key's handshakes get 429.
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidStatus

        statuses = []
        for _ in range(21):
            try:
                async with connect(url, additional_headers={"Authorization": "Bearer cli-key"}):
                    statuses.append(101)
            except InvalidStatus as refused:
                statuses.append(refused.response.status_code)
        assert statuses[:19] == [101] * 19 and statuses[-1] == 429, statuses
        proc.send_signal(signal.SIGINT)
        code = await anyio.to_thread.run_sync(lambda: proc.wait(timeout=15))
        assert code == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_default_engine_is_embedded_when_its_extra_is_installed(monkeypatch):
    import importlib.util

    from duplex_actors.server.cli_commands import EngineChoice, default_engine

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    assert default_engine() is EngineChoice.scripted  # no torch: the scripted engine
    monkeypatch.setattr(importlib.util, "find_spec", real)
    installed = all(real(n) is not None for n in ("torch", "piper"))
    assert default_engine() is (EngineChoice.embedded if installed else EngineChoice.scripted)


@pytest.mark.slow
@pytest.mark.anyio
async def test_serve_without_engine_says_which_it_chose_and_answers_with_it():
    pytest.importorskip("torch")
    pytest.importorskip("piper")
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        with anyio.fail_after(45):
            line = await anyio.to_thread.run_sync(proc.stdout.readline)
        assert "(engine=embedded [default]," in line, line
        async with await DuplexClient.connect(line.split()[2]) as client:
            created = await client.recv()
            # The embedded engine's real cap, not "inf" (it stops there).
            assert created["session"]["max_output_tokens"] == 256
            await client.update_session(
                {"output_modalities": ["text"], "audio": {"input": {"turn_detection": None}}}
            )
            await client.send(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "hello"}],
                    },
                }
            )
            await client.create_response()
            done, _ = await client.wait_for("response.done", timeout=30)
            response = done["response"]
            text = response["output"][0]["content"][0]["text"]
            assert text and not text.startswith("word0"), text  # not the scripted engine's
            assert response["usage"]["input_tokens"] >= 2 and response["usage"]["output_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)


@pytest.mark.parametrize("asked", ["auto", "asyncio", "uvloop"])
def test_the_loop_asked_for_is_the_loop_serve_runs_and_a_missing_uvloop_is_a_usage_error(monkeypatch, asked):
    from duplex_actors.server import event_loop

    chosen = []
    monkeypatch.setattr(event_loop, "run_anyio", lambda main, *args, choice: chosen.append(choice))
    monkeypatch.setattr(event_loop, "_uvloop_factory", lambda: None)  # as where uvloop has no build
    result = CliRunner().invoke(serve_app(), ["serve", "--engine", "scripted", "--loop", asked])
    if asked == "uvloop":
        assert result.exit_code == 2, result.output
        assert "uvloop is not installed" in result.output and chosen == []
    else:  # auto falls back to asyncio's own loop
        assert result.exit_code == 0, result.output
        assert chosen == [event_loop.EventLoopChoice.asyncio]


def _serve_once(*flags: str) -> subprocess.CompletedProcess:
    """``serve`` with the scripted engine and ``flags``, run to its end (a start that fails)."""
    command = [sys.executable, "-c", LAUNCH, "serve", "--engine", "scripted", *flags]
    env = {**os.environ, "COLUMNS": "200"}  # typer's usage errors are boxed to the terminal's width
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_is_one_line_and_status_1_not_a_traceback(workers):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    try:
        done = _serve_once("--port", port, "--workers", workers)
    finally:
        taken.close()
    said = [line for line in done.stderr.splitlines() if not line.startswith("warning:")]
    assert done.returncode == 1, done.stderr[-2000:]
    assert said == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use"], done.stderr[-2000:]


def test_a_tls_file_that_cannot_be_loaded_is_a_usage_error_in_either_mode(tmp_path):
    missing = ["--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(tmp_path / "missing.key")]
    for workers in ("1", "2"):
        done = _serve_once("--port", "0", "--workers", workers, *missing)
        assert done.returncode == 2, done.stderr[-2000:]
        assert "--tls-cert/--tls-key cannot be loaded" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "given",
    [
        ("--disconnect-grace-s", "-1"),
        ("--idle-ttl-s", "-0.5"),
        ("--journal-max-age-s", "-1"),
        ("--stall-timeout-s", "-1"),
        ("--max-sessions", "0"),
        ("--max-connections", "0"),
        ("--max-frame-bytes", "0"),
        ("--max-chunk-bytes", "0"),
        ("--sample-rate", "0"),
        ("--port", "70000"),
        ("--write-timeout-s", "0"),
        ("--max-sessions-per-key", "0"),
        ("--max-sessions-per-address", "0"),
        ("--max-detached-sessions", "0"),
    ],
)
def test_a_value_no_server_could_run_with_is_a_usage_error_not_a_start(given):
    # Before, each started (a negative grace or stall timeout went unnoticed until it broke
    # something; --max-detached-sessions 0 refused every session as quota_exceeded).
    result = CliRunner().invoke(serve_app(), ["serve", "--engine", "scripted", *given])
    assert result.exit_code == 2, result.output
    assert "Invalid value" in result.output


@pytest.mark.anyio
@pytest.mark.parametrize("decodes", [0, 1])
async def test_transcription_workers_zero_serves_without_a_recogniser(decodes):
    # Any client asking for input transcription loads the recogniser into the serving process
    # for its life (Moonshine: about 650 MiB). An operator who wants none says 0: such a
    # session then gets a transcription failed event for each turn, its turns still answered.
    from duplex_actors import ScriptedEngine
    from duplex_actors.server import ServerConfig
    from duplex_actors.server.cli_commands import open_server

    config = ServerConfig(host="127.0.0.1", port=0)
    async with open_server(ScriptedEngine(), config, transcription_workers=decodes) as server:
        if decodes:
            assert server.runtime.transcriber is not None
            assert server.runtime.transcriber.idle_unload_s == IDLE_UNLOAD_S
            return
        assert server.runtime.transcriber is None
        async with websockets.connect(server.url) as ws:
            await recv_json(ws)
            update = {"audio": {"input": {"transcription": {"model": "whisper-1"}, "turn_detection": None}}}
            await ws.send(json.dumps({"type": "session.update", "session": update}))
            await recv_until(ws, "session.updated")
            pcm = base64.b64encode(b"\x01\x00" * 2400).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            with anyio.fail_after(5):
                failed = (await recv_until(ws, "conversation.item.input_audio_transcription.failed"))[-1]
            assert "not available" in failed["error"]["message"]
    bad = CliRunner().invoke(serve_app(), ["serve", "--transcription-workers", "-1"])
    assert bad.exit_code != 0


@pytest.mark.anyio
@pytest.mark.parametrize(("flag", "kept_for"), [(42.0, 42.0), (0.0, None)])
async def test_transcription_idle_s_is_how_long_the_recogniser_is_kept_unused(flag, kept_for):
    from duplex_actors import ScriptedEngine
    from duplex_actors.server import ServerConfig
    from duplex_actors.server.cli_commands import open_server

    config = ServerConfig(host="127.0.0.1", port=0)
    async with open_server(ScriptedEngine(), config, transcription_idle_s=flag) as server:
        assert server.runtime.transcriber is not None
        assert server.runtime.transcriber.idle_unload_s == kept_for
    bad = CliRunner().invoke(serve_app(), ["serve", "--transcription-idle-s", "-1"])
    assert bad.exit_code != 0


def test_serve_hands_transcription_idle_s_to_its_server_and_to_each_worker(monkeypatch):
    import duplex_actors.server.event_loop as event_loop
    import duplex_actors.server.workers as workers

    handed: dict[str, object] = {}
    monkeypatch.setattr(
        event_loop,
        "run_anyio",
        lambda _serve, _backend, _config, _overrides, options, *a, **k: handed.update(one=options),
    )
    monkeypatch.setattr(
        workers, "serve_workers", lambda _n, _host, _port, settings, **k: handed.update(many=settings)
    )
    flags = ["serve", "--engine", "scripted", "--port", "0", "--transcription-idle-s", "42"]
    assert CliRunner().invoke(serve_app(), flags).exit_code == 0
    assert CliRunner().invoke(serve_app(), [*flags, "--workers", "2"]).exit_code == 0
    assert handed["one"]["transcription_idle_s"] == 42.0
    assert handed["many"].transcription_idle_s == 42.0
