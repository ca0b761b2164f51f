"""Barge-in without talk-over (issue 30, item 4): what a client hears after it starts talking.

Two parts, both against a baseline measured in the same run:

* **wire**: audio frames a Realtime client receives after ``input_audio_buffer.speech_started``
  until the response ends cancelled, over a real socket. Two ``serve`` assemblies run in child
  processes (:func:`~duplex_actors.server.cli_commands.open_server`, as in the wire bench),
  identical but for ``SessionConfig.hold_audio_on_speech``: on (the chart holds the
  response's audio from speech_started until the overlap policy decides) and off (the
  behaviour before: the audio plays on until the overlap reaches ``min_interruption_ms``).
  Rounds alternate between them. Each round: a response of paced 20 ms packets (the scripted
  engine, one packet per 20 ms as a speaking model streams), then, 300 ms into it, a spoken
  sentence (Piper) sent at real time pace through the real Silero server VAD.
* **corpus**: the overlap policy's two error rates on speech over a response, in process.
  Backchannels ("mm-hmm", "yeah", "right", ... spoken by Piper, and numpy coughs / noise
  bursts) must not cancel; interruptions (full sentences) must. Each clip, with quiet around
  it and optionally noise under it, goes through :class:`~duplex_actors.audio.server_vad.ServerVad`
  (Silero) and the session's overlap rule (the ``speech`` flag of each chunk after
  speech_started counts toward the overlap; the policy judges it as the session's guard does,
  core/session.py ``_after_append``). Reported per ``min_interruption_ms``, with the pause a
  backchannel costs (speech_started to its release at speech_stopped). ``--vad-rate 8000``
  runs Silero at 8 kHz on the clips resampled from 16 kHz: whether the cheaper rate makes the
  same decisions (docs/benchmarks.md: it does not); ``--vad-precision int8`` runs Silero's
  int8 network (``serve --vad-precision int8``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import signal
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from .child_server import served_in_child

if TYPE_CHECKING:
    from ..audio.server_vad import ServerVad

RATE = 16000
PACKET_MS = 20
#: Before the user speaks, the response has played this long.
SPEAK_AFTER_S = 0.3

BACKCHANNELS = ("Mm-hmm.", "Yeah.", "Right.", "Okay.", "Uh-huh.", "Sure.", "I see.", "Yes.")
INTERRUPTIONS = (
    "Wait, that is not what I asked for at all.",
    "Sorry, can you tell me about the train times instead?",
    "Hold on, I need to book a table for two tonight.",
    "No, stop, I meant the weather in London tomorrow.",
    "Actually, please cancel my order from yesterday.",
    "Can you repeat the last part more slowly please?",
    # Short interruptions are real too: a threshold long enough for every "mm-hmm" misses them.
    "Stop.",
    "No, wait.",
    "Hold on a second.",
)
#: Each spoken clip at these speeds (Piper's length scale): people say "mm-hmm" fast and slow.
SPEEDS = (0.85, 1.0, 1.2)


# --- wire ----------------------------------------------------------------------------------


def _server_main(ready: Connection[int, Any], hold: bool, packets: int = 500) -> None:
    """Child process: ``serve``'s assembly with a paced scripted engine, on a free port."""

    async def main() -> None:
        from ..engines.scripted import Script, ScriptedEngine
        from ..server.app import ServerConfig
        from ..server.cli_commands import open_server

        # 500 packets: 10 s of paced audio, the user always talks over a response still
        # streaming; a few: a short answer the engine finishes while the user talks over it.
        script = Script(
            tokens=(), audio_packets=packets, packet_ms=PACKET_MS, packet_latency_s=PACKET_MS / 1000
        )
        backend = ScriptedEngine(script, record=False)
        config = ServerConfig(host="127.0.0.1", port=0, session_overrides={"hold_audio_on_speech": hold})
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async with open_server(backend, config) as server:
                ready.send(server.port)
                async for _ in signals:
                    break

    anyio.run(main)


def _server_process(hold: bool, packets: int = 500) -> contextlib.AbstractContextManager[str]:
    return served_in_child(_server_main, hold, packets, name="barge-in-bench")


async def _round(url: str, speech: bytes, speak_after_s: float = SPEAK_AFTER_S) -> dict[str, Any]:
    """One response talked over; what the client received after speech_started."""
    import websockets

    async with websockets.connect(url, max_size=None) as ws:

        async def recv() -> dict[str, Any]:
            with anyio.fail_after(20):
                event: dict[str, Any] = json.loads(await ws.recv())
                return event

        while (await recv())["type"] != "session.created":
            pass
        await ws.send(
            json.dumps(
                {
                    "type": "session.update",
                    "session": {
                        "audio": {
                            "input": {
                                "format": {"type": "audio/pcm", "rate": RATE},
                                "turn_detection": {"type": "server_vad", "create_response": False},
                            }
                        }
                    },
                }
            )
        )
        while (await recv())["type"] != "session.updated":
            pass
        await ws.send(json.dumps({"type": "response.create"}))
        while (await recv())["type"] != "response.output_audio.delta":
            pass
        result: dict[str, Any] = {"frames_after": 0, "audio_ms_after": 0.0}

        async def talk() -> None:
            await anyio.sleep(speak_after_s)
            step = RATE * 2 // 10  # 100 ms, at real time pace as a microphone sends it
            began = time.perf_counter()
            for n, i in enumerate(range(0, len(speech), step)):
                frame = base64.b64encode(speech[i : i + step]).decode()
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": frame}))
                await anyio.sleep(max(began + (n + 1) * 0.1 - time.perf_counter(), 0))

        started_at = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(talk)
            while True:
                event = await recv()
                kind = event["type"]
                if kind == "input_audio_buffer.speech_started":
                    started_at = time.perf_counter()
                elif kind == "response.output_audio.delta" and started_at is not None:
                    result["frames_after"] += 1
                    result["audio_ms_after"] += len(base64.b64decode(event["delta"])) / 48  # 24 kHz pcm16
                elif kind == "response.done":
                    result["status"] = event["response"]["status"]
                    result["reason"] = (event["response"].get("status_details") or {}).get("reason")
                    result["cancel_after_started_ms"] = (
                        None if started_at is None else (time.perf_counter() - started_at) * 1000
                    )
                    tg.cancel_scope.cancel()
                    break
        return result


def bench_wire(rounds: int = 4, packets: int = 500, speak_after_s: float = SPEAK_AFTER_S) -> dict[str, Any]:
    """``packets`` of 20 ms per response; the user starts ``speak_after_s`` after its first."""
    from ..audio.utterances import synthesize_utterance

    speech = synthesize_utterance(INTERRUPTIONS[0], varied=False) + b"\x00\x00" * (RATE // 2)
    arms: dict[str, list[dict[str, Any]]] = {"hold": [], "baseline": []}
    with _server_process(True, packets) as held_url, _server_process(False, packets) as base_url:
        for i in range(rounds + 1):
            for name, url in (("hold", held_url), ("baseline", base_url))[:: 1 if i % 2 else -1]:
                got = anyio.run(_round, url, speech, speak_after_s)
                if i:  # the first round of each arm warms it up
                    arms[name].append(got)
    summary: dict[str, Any] = {}
    for name, results in arms.items():
        frames = [r["frames_after"] for r in results]
        summary[name] = {
            "rounds": len(results),
            "frames_after_speech_started": {"max": max(frames), "mean": sum(frames) / len(frames)},
            "audio_ms_after_speech_started_mean": sum(r["audio_ms_after"] for r in results) / len(results),
            "statuses": sorted({f"{r.get('status')}/{r.get('reason')}" for r in results}),
            "status_counts": {
                k: sum(1 for r in results if f"{r.get('status')}/{r.get('reason')}" == k)
                for k in sorted({f"{r.get('status')}/{r.get('reason')}" for r in results})
            },
            "cancel_after_speech_started_ms_mean": sum(r["cancel_after_started_ms"] or 0 for r in results)
            / len(results),
        }
    base = summary["baseline"]["frames_after_speech_started"]["mean"]
    held = summary["hold"]["frames_after_speech_started"]["mean"]
    summary["frames_ratio_hold_to_baseline"] = held / base if base else None
    return summary


# --- corpus --------------------------------------------------------------------------------


def cough(rng: np.random.Generator, ms: int = 250) -> np.ndarray:
    """A cough-like burst: band-passed noise with a sharp attack and a fast decay."""
    n = RATE * ms // 1000
    noise = rng.standard_normal(n)
    # a crude band-pass (300 Hz - 3 kHz) by differencing and smoothing
    smoothed = np.convolve(np.diff(noise, prepend=0.0), np.ones(4) / 4, mode="same")
    envelope = np.exp(-np.linspace(0, 6, n)) * np.minimum(1.0, np.linspace(0, 20, n))
    burst: np.ndarray = (smoothed * envelope * 0.5).astype(np.float32)
    return burst


def noise_burst(rng: np.random.Generator, ms: int = 200) -> np.ndarray:
    n = RATE * ms // 1000
    return (rng.standard_normal(n) * 0.15 * np.hanning(n)).astype(np.float32)


def _pcm(samples: np.ndarray) -> bytes:
    pcm: bytes = (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
    return pcm


def _float(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0


def build_corpus(seed: int = 7, snr_db: float | None = None) -> list[tuple[str, str, np.ndarray]]:
    """(kind, label, float32 16 kHz samples) with 0.5 s of quiet before and 1 s after each clip;
    ``snr_db``: white noise under the whole clip at that speech-to-noise ratio."""
    from ..audio.tts import default_tts

    rng = np.random.default_rng(seed)
    clips: list[tuple[str, str, np.ndarray]] = []
    tts = default_tts()
    for text in BACKCHANNELS:
        for speed in SPEEDS:
            pcm = tts.synthesize_pcm16(text, RATE, speed, varied=False)
            clips.append(("backchannel", f"{text}@{speed:g}", _float(pcm)))
    for i in range(3):
        clips.append(("backchannel", f"cough#{i}", cough(rng, 200 + 80 * i)))
        clips.append(("backchannel", f"noise#{i}", noise_burst(rng, 150 + 50 * i)))
    for text in INTERRUPTIONS:
        for speed in SPEEDS:
            pcm = tts.synthesize_pcm16(text, RATE, speed, varied=False)
            clips.append(("interruption", f"{text}@{speed:g}", _float(pcm)))
    out = []
    for kind, label, samples in clips:
        padded = np.concatenate([np.zeros(RATE // 2, np.float32), samples, np.zeros(RATE, np.float32)])
        if snr_db is not None:
            power = float(np.mean(samples**2)) or 1e-6
            noise = rng.standard_normal(len(padded)).astype(np.float32) * np.sqrt(power / 10 ** (snr_db / 10))
            padded = padded + noise
        out.append((kind, label, padded))
    return out


def judge_clip(
    samples: np.ndarray, min_interruption_ms: float, vad: ServerVad, vad_rate: int = RATE
) -> dict[str, Any]:
    """Run one clip (spoken over a response) through server VAD and the overlap rule.

    ``vad_rate``: the rate ``vad`` hears (its Silero model's); the clip's 20 ms chunks are
    resampled to it as vad_rate_bench's are (:func:`~.vad_rate_bench.chunks_at`)."""
    from ..core.commands import SpeechStartedSignal, SpeechStoppedSignal
    from ..core.overlap import OverlapPolicy, OverlapVerdict
    from .vad_rate_bench import chunks_at

    policy = OverlapPolicy(min_interruption_ms)
    overlap: float | None = None
    t_ms = 0.0
    started_ms = 0.0
    for heard in chunks_at(samples, vad_rate):
        for command in vad.hear(_pcm(heard)):
            if isinstance(command, SpeechStartedSignal) and overlap is None:
                overlap, started_ms = 0.0, t_ms
            elif isinstance(command, SpeechStoppedSignal) and overlap is not None:
                return {"verdict": "backchannel", "pause_ms": t_ms - started_ms}
            elif (
                overlap is not None
                and getattr(command, "speech", None) is not False
                and hasattr(command, "pcm")
            ):
                overlap += len(command.pcm) / 2 / vad_rate * 1000
                if policy.judge(overlap, still_speaking=True) is OverlapVerdict.BARGE_IN:
                    return {"verdict": "interruption", "after_ms": t_ms - started_ms}
        t_ms += 20
    return {"verdict": "none" if overlap is None else "undecided"}


def bench_corpus(
    thresholds: Sequence[int] = (300, 400, 500, 700),
    snrs: Sequence[float | None] = (None, 10.0),
    vad_rate: int = RATE,
    precision: str = "float32",
) -> dict[str, Any]:
    """The corpus part, with Silero at ``vad_rate`` (16 kHz, the session's rate, or 8 kHz) and
    ``precision`` (float32, or int8: ``serve --vad-precision int8``)."""
    from ..audio.server_vad import ServerVad
    from ..audio.turn_detection import TurnDetectionConfig
    from ..audio.vad import SileroVad

    results: dict[str, Any] = {}
    for snr in snrs:
        corpus = build_corpus(snr_db=snr)
        key = "clean" if snr is None else f"snr{snr:g}dB"
        per: dict[str, Any] = {}
        for threshold in thresholds:
            false_cancel = missed = 0
            pauses: list[float] = []
            decided_after: list[float] = []
            wrong: list[str] = []
            n_back = sum(1 for k, _, _ in corpus if k == "backchannel")
            n_int = len(corpus) - n_back
            for kind, label, samples in corpus:
                vad = ServerVad(config=TurnDetectionConfig(), vad=SileroVad(vad_rate, precision=precision))
                got = judge_clip(samples, threshold, vad, vad_rate)
                if kind == "backchannel":
                    if got["verdict"] == "interruption":
                        false_cancel += 1
                        wrong.append(label)
                    elif "pause_ms" in got:
                        pauses.append(got["pause_ms"])
                else:
                    if got["verdict"] != "interruption":
                        missed += 1
                        wrong.append(label)
                    else:
                        decided_after.append(got["after_ms"])
            per[str(threshold)] = {
                "false_cancel_rate": false_cancel / n_back,
                "missed_interruption_rate": missed / n_int,
                "backchannels": n_back,
                "interruptions": n_int,
                "backchannel_pause_ms_mean": sum(pauses) / len(pauses) if pauses else None,
                "interruption_decided_ms_mean": sum(decided_after) / len(decided_after)
                if decided_after
                else None,
                "wrong": wrong,
            }
        results[key] = per
    return results


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--skip-wire", action="store_true")
    parser.add_argument("--skip-corpus", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--tiny", action="store_true", help="one threshold, clean audio only (smoke)")
    parser.add_argument(
        "--vad-rate",
        type=int,
        choices=(8000, 16000),
        default=RATE,
        help="the corpus part: the rate Silero hears (8000: resampled from the session's 16 kHz)",
    )
    from ..audio.vad import PRECISIONS

    parser.add_argument(
        "--vad-precision",
        choices=PRECISIONS,
        default="float32",
        help="the corpus part: Silero's network (int8: serve --vad-precision int8; 16 kHz only)",
    )
    args = parser.parse_args(argv)
    out: dict[str, Any] = {}
    if not args.skip_corpus:
        thresholds, snrs = ((500,), (None,)) if args.tiny else ((300, 400, 500, 700), (None, 10.0))
        out["corpus"] = bench_corpus(thresholds, snrs, vad_rate=args.vad_rate, precision=args.vad_precision)
        out["corpus_vad_rate"] = args.vad_rate
        out["corpus_vad_precision"] = args.vad_precision
    if not args.skip_wire:
        out["wire"] = bench_wire(args.rounds)
        # A short answer (0.4 s) the engine finishes while the user talks over it: before the
        # hold it ended completed, the interruption notwithstanding.
        out["wire_short_answer"] = bench_wire(args.rounds, packets=20, speak_after_s=0.1)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
