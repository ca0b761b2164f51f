"""Resampling of whole mono clips (a phrase of TTS, a turn for the recogniser), and pcm16 <->
float conversions.

The resampling itself is libsoxr's (the ``soxr`` package), the same library the server's edge
uses for client audio (server/audio_format.py). This module used to hold a windowed-sinc
resampler of our own; soxr's high-quality setting is faster, folds far less of what lies above
the new Nyquist back into the speech band, and reproduces a tone more closely
(tests/embedded/test_audio.py holds it to orders of magnitude; docs/benchmarks.md).

Clips are resampled in one call each, with no state carried between calls: a phrase is a whole
utterance, so there is no seam between calls to smooth over.
"""

from __future__ import annotations

import numpy as np
import soxr


def resample(samples: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Resample float samples from ``src_rate`` to ``dst_rate``; returns float32."""
    if src_rate <= 0 or dst_rate <= 0:
        raise ValueError("sample rates must be positive")
    x = np.asarray(samples, dtype=np.float32)
    if src_rate == dst_rate or x.size == 0:
        return x.copy()
    return np.asarray(soxr.resample(x, src_rate, dst_rate, quality="HQ"), dtype=np.float32)


def float_to_pcm16(samples: np.ndarray) -> bytes:
    clipped = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    return (clipped * 32767.0).astype("<i2").tobytes()


def pcm16_to_float(pcm: bytes) -> np.ndarray:
    if len(pcm) % 2:
        raise ValueError("pcm16 audio must have an even number of bytes")
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
