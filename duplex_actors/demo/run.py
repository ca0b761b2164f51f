"""Run N simulated callers against an engine and report what happened."""

from __future__ import annotations

import base64
import json
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from ..actors.runtime import Runtime
from ..core.timing import Summary
from .caller import Behaviour, Caller

if TYPE_CHECKING:
    from rich.console import Console

    from ..engines.base import EngineBackend
    from ..engines.pacing import PacedEngine

METRICS = ("ttft_ms", "ttfp_ms", "tpot_ms", "rtf", "stop_latency_ms")


@attrs.frozen
class DemoOptions:
    sessions: int = 4
    seconds: float = 45.0
    seed: int = 7
    engine: str = "embedded"
    model: str | None = None
    json_path: Path | None = None
    plot_path: Path | None = None
    live: bool = True
    lead_ms: float = 300.0
    min_interruption_ms: int = 700


def build_engine(options: DemoOptions) -> PacedEngine:
    from ..engines.pacing import PacedEngine

    backend: EngineBackend

    if options.engine == "embedded":
        from ..engines.embedded import make_embedded_engine

        backend = make_embedded_engine()
    elif options.engine == "scripted":
        from ..engines.scripted import Script, ScriptedEngine

        words = tuple(f" word{i}" for i in range(40))
        backend = ScriptedEngine(
            Script(tokens=words, audio_packets=40, packet_ms=160, first_latency_s=0.05, token_latency_s=0.01)
        )
    elif options.engine == "vllm":
        from ..engines.vllm_engine import make_vllm_engine

        if not options.model:
            raise SystemExit("--engine vllm needs --model PATH")
        # A random tiny model seldom ends a reply by itself: keep replies short and end at a
        # full stop, as a real deployment's stop rules would.
        backend = make_vllm_engine(options.model, sampling_defaults={"max_tokens": 48, "stop": ["."]})
    else:
        raise SystemExit(f"unknown engine {options.engine!r}")
    return PacedEngine(backend, lead_ms=options.lead_ms)


_SPEECH: dict[str, bytes] = {}

#: A file of the callers' speech made earlier by :func:`save_speech` (JSON, text -> base64 pcm16),
#: for a machine without Piper: scripts/device-check.sh carries one to a GPU machine.
SPEECH_FILE_ENV = "DUPLEX_DEMO_SPEECH"


def synthesize_speech(texts: Sequence[str]) -> dict[str, bytes]:
    """The callers' speech, synthesised once per process (Piper is deterministic), or read from
    the file $DUPLEX_DEMO_SPEECH names where it holds the texts."""
    missing = [t for t in texts if t not in _SPEECH]
    if missing and (path := os.environ.get(SPEECH_FILE_ENV)):
        _SPEECH.update(load_speech(Path(path)))
        missing = [t for t in texts if t not in _SPEECH]
    if missing:
        from ..audio.tts import default_tts
        from ..audio.utterances import synthesize_utterance

        tts = default_tts()
        for text in missing:
            _SPEECH[text] = synthesize_utterance(text, tts=tts)
    return {text: _SPEECH[text] for text in texts}


def save_speech(path: Path) -> int:
    """Writes every demo utterance's speech to ``path`` (for $DUPLEX_DEMO_SPEECH); its size."""
    from ..audio.utterances import load_utterances

    utterances = load_utterances()
    speech = synthesize_speech(utterances.turns + utterances.backchannels)
    path.write_text(json.dumps({text: base64.b64encode(pcm).decode() for text, pcm in speech.items()}))
    return path.stat().st_size


def load_speech(path: Path) -> dict[str, bytes]:
    """The speech a :func:`save_speech` file holds."""
    return {text: base64.b64decode(b64) for text, b64 in json.loads(path.read_text()).items()}


async def run_demo(options: DemoOptions, *, console: Console | None = None) -> dict[str, Any]:
    from ..audio.utterances import load_utterances
    from ..audio.vad import SileroVad

    utterances = load_utterances()
    started = time.perf_counter()
    speech = await anyio.to_thread.run_sync(synthesize_speech, utterances.turns + utterances.backchannels)
    synth_s = time.perf_counter() - started
    rng = random.Random(options.seed)
    engine = build_engine(options)
    cpu0 = time.process_time()
    async with Runtime(engine) as runtime:
        callers = []
        for i in range(options.sessions):
            session = await runtime.open_session(
                server_vad=True, auto_respond=True, min_interruption_ms=options.min_interruption_ms
            )
            callers.append(
                Caller(
                    i,
                    session,
                    SileroVad,
                    speech,
                    utterances.turns,
                    utterances.backchannels,
                    random.Random(rng.random()),
                    Behaviour(),
                )
            )
        deadline = time.perf_counter() + options.seconds
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for caller in callers:
                tg.start_soon(caller.run, deadline)
            if options.live and console is not None:
                from .view import live_view

                tg.start_soon(live_view, console, callers, runtime, deadline)
        wall_s = time.perf_counter() - t0
        engine_stats = attrs.asdict(runtime.engine.statistics())
    cpu_s = time.process_time() - cpu0
    report = summarize(callers, options, wall_s, cpu_s, synth_s, engine_stats)
    if options.json_path:
        options.json_path.parent.mkdir(parents=True, exist_ok=True)
        options.json_path.write_text(json.dumps(report, indent=2))
    if options.plot_path:
        from .plot import plot_timeline

        busiest = max(callers, key=lambda c: (len(c.timeline.barge_ins), len(c.timeline.responses)))
        plot_timeline(busiest.timeline, options.plot_path, title=f"caller {busiest.index}")
    return report


def summarize(
    callers: Sequence[Caller],
    options: DemoOptions,
    wall_s: float,
    cpu_s: float,
    synth_s: float,
    engine_stats: dict[str, Any],
) -> dict[str, Any]:
    all_metrics = [m for c in callers for m in c.metrics]
    table = {}
    for name in METRICS:
        values = [m[name] for m in all_metrics if m.get(name) is not None]
        s = Summary.of(values)
        table[name] = {
            "count": s.count,
            "mean": s.mean,
            "p50": s.p50,
            "p90": s.p90,
            "p99": s.p99,
            "source": "server",
        }
    totals = {
        k: sum(getattr(c.stats, k) for c in callers)
        for k in (
            "turns_spoken",
            "responses_completed",
            "responses_cancelled",
            "responses_failed",
            "barge_ins_attempted",
            "backchannels",
            "audio_packets",
            "stale_audio_after_cancel",
        )
    }
    totals["dropped_chunks"] = sum(c.dropped_chunks for c in callers)
    return {
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in attrs.asdict(options).items()},
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "cpu_per_wall": cpu_s / wall_s if wall_s else None,
        "speech_synthesis_s": synth_s,
        "metrics": table,
        "totals": totals,
        "engine": engine_stats,
        "sessions": [{"index": c.index, **attrs.asdict(c.stats)} for c in callers],
    }
