"""The official Node ``openai`` SDK's realtime WebSocket client (``OpenAIRealtimeWS``),
unmodified, against ``duplex-actors serve --tls-cert/--tls-key``: the SDK always connects with
``wss://``, so this is also the TLS test with a real third-party client.

``.ci/interop.sh`` installs the SDK (``npm ci`` in ``.ci/node-openai``, from its committed
lock file) and sets DUPLEX_REQUIRE_NODE_OPENAI=1, so there it runs or fails. Elsewhere it skips
when node or the installed SDK is missing. The certificate is self-signed, made here with the
``openssl`` CLI, and trusted by Node through NODE_EXTRA_CA_CERTS.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import API_KEY

pytestmark = [pytest.mark.interop, pytest.mark.timeout(180)]

HERE = Path(__file__).resolve().parents[2] / ".ci" / "node-openai"
NODE = shutil.which("node")
REQUIRED = os.environ.get("DUPLEX_REQUIRE_NODE_OPENAI") == "1"


def _need(condition: bool, why: str) -> None:
    if condition:
        return
    if REQUIRED:
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> tuple[Path, Path]:
    _need(shutil.which("openssl") is not None, "the openssl CLI is needed to make a certificate")
    folder = tmp_path_factory.mktemp("tls")
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


@pytest.fixture(scope="module")
def tls_server(tls_files):
    cert, key = tls_files
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "duplex_actors", "serve", "--engine", "scripted", "--port", "0",
            "--api-key", API_KEY, "--tls-cert", str(cert), "--tls-key", str(key),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line or proc.poll() is not None:
                break
        match = re.search(r"wss://(\S+)/v1/realtime", line)
        if not match:
            raise RuntimeError(f"serve did not start with TLS: {line!r} {proc.stderr.read()[-2000:]}")
        yield f"https://{match.group(1)}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_node_openai_sdk_text_and_audio_turns_over_tls(tls_server, tls_files, speech_24k, tmp_path):
    _need(NODE is not None, "node is not installed")
    _need(
        (HERE / "node_modules" / "openai").is_dir(), "the Node openai SDK is not installed (.ci/interop.sh)"
    )
    speech = tmp_path / "speech.pcm"
    speech.write_bytes(speech_24k)
    cert, _ = tls_files
    env = {
        **os.environ,
        "OPENAI_BASE_URL": tls_server,
        "OPENAI_API_KEY": API_KEY,
        "SPEECH_PCM": str(speech),
        "NODE_EXTRA_CA_CERTS": str(cert),
    }
    run = subprocess.run(
        [NODE, "realtime_turns.mjs"], cwd=HERE, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.stdout.strip(), run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert run.returncode == 0, (seen, run.stderr[-2000:])
    assert seen["url"].startswith("wss://127.0.0.1:"), seen["url"]
    assert seen["errors"] == [], seen
    text, audio = seen["turns"]
    for turn in (text, audio):
        assert turn["status"] == "completed", turn
        assert turn["audioBytes"] > 0 and turn["words"].strip(), turn
    # The audio turn carried the whole utterance (piper's speech plus the fixture's 1 s quiet).
    assert audio["committedMs"] >= 1000 + 1000, audio
    assert seen["types"]["session.created"] == 1 and seen["types"]["response.done"] == 2, seen["types"]


def test_a_client_that_does_not_trust_the_certificate_is_refused(tls_server):
    _need(NODE is not None, "node is not installed")
    _need(
        (HERE / "node_modules" / "openai").is_dir(), "the Node openai SDK is not installed (.ci/interop.sh)"
    )
    env = {**os.environ, "OPENAI_BASE_URL": tls_server, "OPENAI_API_KEY": API_KEY, "SPEECH_PCM": "/dev/null"}
    env.pop("NODE_EXTRA_CA_CERTS", None)
    run = subprocess.run(
        [NODE, "realtime_turns.mjs"], cwd=HERE, env=env, capture_output=True, text=True, timeout=60
    )
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert run.returncode != 0 and seen["turns"] == [], seen
    assert any("certificate" in e for e in seen["errors"]), seen["errors"]
