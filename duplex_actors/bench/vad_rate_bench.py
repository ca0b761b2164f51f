"""Server VAD at 8 kHz against 16 kHz: the turns it finds, and what it costs.

Silero runs at 16 kHz (512-sample windows) or 8 kHz (256-sample windows), both 32 ms. At 8 kHz
the network costs less per window, so less per second of audio; the session's audio would
then be resampled from its 16 kHz once more. Whether that is worth it depends on whether the
turns come out the same, which this bench measures before anything adopts it.

``python -m duplex_actors.bench.vad_rate_bench [--sentences 20] [--snr clean 20 10 5]``
speaks ``--sentences`` sentences with the packaged piper voice, pauses between them (some
under the 500 ms of silence that ends a turn, most over it), adds white noise at each
``--snr`` (dB against the speech), and runs server VAD's turn detector over the same audio in
20 ms chunks at both rates: 16 kHz is the baseline. Per noise level it reports the turns each
rate ended, how many of them match (ends within 200 ms of each other), how far the matched ends
are apart, and the CPU of each rate per second of audio (the 8 kHz arm's resampling included)
as a ratio to 16 kHz's. Prints one line per level, then JSON (``--json PATH`` also writes it).

``--against int8`` measures server VAD's int8 network at 16 kHz (``serve --vad-precision int8``)
against float32 instead of 8 kHz (keys ``turns_int8``, ``cpu_int8_vs_16k``, ...; its CPU is one
window at a time, where the server's batches save more: docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

SENTENCES = (
    "Hello there, can you hear me?",
    "I would like to book a table for two tonight.",
    "Actually, make that three people.",
    "What time do you close on Sundays?",
    "Okay.",
    "Could you repeat the address, please?",
    "Thanks, that is all for now.",
    "Wait, one more thing.",
    "Do you have vegetarian options?",
    "Great, see you at eight.",
)
SESSION_RATE = 16000
#: Two turn ends further apart than this are different turns.
MATCH_MS = 200.0


def _speech(sentences: int, seed: int) -> np.ndarray:
    """``sentences`` sentences at the session's rate (float), with pauses: every third one
    shorter than the silence that ends a turn, so the detector must not end it there."""
    from ..audio.resample import resample
    from ..audio.tts import default_tts

    tts = default_tts()
    rng = np.random.default_rng(seed)
    parts = [np.zeros(SESSION_RATE // 2, np.float32)]
    for k in range(sentences):
        text = SENTENCES[k % len(SENTENCES)]
        parts.append(resample(tts.synthesize(text, varied=False), tts.native_rate, SESSION_RATE))
        pause = rng.uniform(0.25, 0.45) if k % 3 == 0 else rng.uniform(0.9, 1.6)
        parts.append(np.zeros(int(pause * SESSION_RATE), np.float32))
    return np.concatenate(parts).astype(np.float32)


def _with_noise(speech: np.ndarray, snr_db: float | None, seed: int) -> np.ndarray:
    if snr_db is None:
        return speech
    loud = np.abs(speech) > 1e-4
    speech_rms = float(np.sqrt(np.mean(speech[loud] ** 2)))
    noise = np.random.default_rng(seed).standard_normal(len(speech)).astype(np.float32)
    noisy: np.ndarray = speech + noise * (speech_rms / 10 ** (snr_db / 20))
    return noisy


def chunks_at(audio: np.ndarray, rate: int) -> Iterator[np.ndarray]:
    """``audio`` (float, at the session's rate) in 20 ms chunks as Silero at ``rate`` hears it.
    Below the session's rate each chunk goes through one streaming resampler first, as a server
    would run one per session. In float: soxr dithers int16 output with a seed of its own, and
    two runs of a bench would not hear the same audio."""
    import soxr

    chunk = SESSION_RATE // 50
    stream = None if rate == SESSION_RATE else soxr.ResampleStream(SESSION_RATE, rate, 1, dtype="float32")
    for i in range(0, len(audio), chunk):
        piece = audio[i : i + chunk]
        yield (
            piece if stream is None else stream.resample_chunk(piece.astype(np.float32).reshape(-1, 1))[:, 0]
        )


def _turn_ends(audio: np.ndarray, rate: int, precision: str = "float32") -> tuple[list[int], float]:
    """The ends of the turns server VAD's detector finds in ``audio`` (at the session's rate)
    with Silero at ``rate`` and ``precision``, and the CPU seconds it took, resampling included."""
    from ..audio.turn_detection import SpeechStopped, TurnDetectionConfig, TurnDetector
    from ..audio.vad import SileroVad

    detector = TurnDetector(TurnDetectionConfig(), SileroVad(rate, precision=precision))
    began = time.thread_time()
    ends = []
    for samples in chunks_at(audio, rate):
        pcm = np.clip(np.rint(samples * 32767.0), -32768, 32767).astype("<i2")
        signals = detector.feed(pcm.tobytes(), 0.0)
        ends += [s.audio_end_ms for s in signals if isinstance(s, SpeechStopped)]
    return ends, time.thread_time() - began


def _matched(base: list[int], other: list[int]) -> list[tuple[int, int]]:
    """Pairs of turn ends, one from each list, within MATCH_MS of each other (each end used
    once, in order)."""
    pairs, j = [], 0
    for end in base:
        while j < len(other) and other[j] < end - MATCH_MS:
            j += 1
        if j < len(other) and abs(other[j] - end) <= MATCH_MS:
            pairs.append((end, other[j]))
            j += 1
    return pairs


#: What ``--against`` compares float32 at 16 kHz with: its label, Silero's rate and precision.
AGAINST = {"8k": (8000, "float32"), "int8": (SESSION_RATE, "int8")}


def run(
    sentences: int = 20,
    snrs: tuple[float | None, ...] = (None, 20.0, 10.0, 5.0),
    seed: int = 3,
    against: str = "8k",
) -> dict[str, Any]:
    other_rate, other_precision = AGAINST[against]
    speech = _speech(sentences, seed)
    seconds = len(speech) / SESSION_RATE
    levels = {}
    for snr in snrs:
        audio = _with_noise(speech, snr, seed + 1)
        ends16, cpu16 = _turn_ends(audio, SESSION_RATE)
        ends_x, cpu_x = _turn_ends(audio, other_rate, other_precision)
        pairs = _matched(ends16, ends_x)
        apart = [abs(a - b) for a, b in pairs]
        levels["clean" if snr is None else f"snr{snr:g}"] = {
            "turns_16k": len(ends16),
            f"turns_{against}": len(ends_x),
            "matched": len(pairs),
            "only_16k": len(ends16) - len(pairs),
            f"only_{against}": len(ends_x) - len(pairs),
            "end_apart_ms_median": statistics.median(apart) if apart else None,
            "end_apart_ms_max": max(apart) if apart else None,
            "cpu_ms_per_audio_s_16k": 1e3 * cpu16 / seconds,
            f"cpu_ms_per_audio_s_{against}": 1e3 * cpu_x / seconds,
            f"cpu_{against}_vs_16k": cpu_x / cpu16,
        }
    return {
        "sentences": sentences,
        "audio_s": seconds,
        "match_ms": MATCH_MS,
        "against": against,
        "levels": levels,
    }


def _snr(text: str) -> float | None:
    """A noise level: ``clean`` (none), or the speech's level over the noise in dB."""
    if text == "clean":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'clean' nor a number of dB") from None


def _sentences(text: str) -> int:
    count = int(text)
    if count < 1:
        raise argparse.ArgumentTypeError("at least one sentence")
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m duplex_actors.bench.vad_rate_bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--sentences", type=_sentences, default=20)
    parser.add_argument("--snr", type=_snr, nargs="+", default=[None, 20.0, 10.0, 5.0], help="dB, or 'clean'")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument(
        "--against",
        choices=tuple(AGAINST),
        default="8k",
        help="what float32 at 16 kHz is compared with: Silero at 8 kHz, or its int8 network at 16 kHz",
    )
    args = parser.parse_args(argv)
    report = run(args.sentences, tuple(args.snr), args.seed, args.against)
    label = args.against
    what = "at 8 kHz" if label == "8k" else "in int8"
    print(
        f"server VAD {what} against float32 at 16 kHz, {report['sentences']} sentences, "
        f"{report['audio_s']:.1f} s of audio"
    )
    for name, level in report["levels"].items():
        median, most = level["end_apart_ms_median"], level["end_apart_ms_max"]
        apart = "-" if median is None else f"median {median:.0f} ms, max {most:.0f} ms"
        print(
            f"  {name}: turns 16k {level['turns_16k']} | {label} {level[f'turns_{label}']}, matched {level['matched']} "
            f"(only 16k {level['only_16k']}, only {label} {level[f'only_{label}']}); matched ends apart: {apart} | "
            f"CPU per audio second {level[f'cpu_ms_per_audio_s_{label}']:.2f} ms | 16k "
            f"{level['cpu_ms_per_audio_s_16k']:.2f} ms | ratio {level[f'cpu_{label}_vs_16k']:.2f}x"
        )
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
