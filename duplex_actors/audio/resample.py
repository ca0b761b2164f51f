"""Band-limited resampling of mono float audio with numpy (no scipy).

Windowed-sinc interpolation evaluated at each output instant. Downsampling lowers the cutoff
to the new Nyquist frequency first, so 22.05 kHz TTS audio brought to 16 kHz does not fold its
5-11 kHz content back into the speech band (which plain linear interpolation would do).

Between two integer rates the fractional offsets of the output instants repeat with period
``dst / gcd``, so the filter weights are computed once per (rates, phase) and cached: each
call is then one gather and one weighted sum.
"""

from __future__ import annotations

import functools
import math

import numpy as np


@functools.lru_cache(maxsize=8)
def _phase_table(src_rate: int, dst_rate: int, half_taps: int) -> tuple[np.ndarray, np.ndarray]:
    g = math.gcd(src_rate, dst_rate)
    up, down = dst_rate // g, src_rate // g  # output n sits at input position n * down / up
    phases = np.arange(up)
    frac = (phases * down % up) / up  # fractional part of the input position per phase
    offsets = np.arange(-half_taps + 1, half_taps + 1)
    dist = frac[:, None] - offsets[None, :]
    cutoff = min(1.0, dst_rate / src_rate)
    weights = cutoff * np.sinc(cutoff * dist) * (0.5 + 0.5 * np.cos(np.pi * dist / half_taps))
    return weights.astype(np.float32), offsets


def resample(samples: np.ndarray, src_rate: int, dst_rate: int, *, half_taps: int = 16) -> np.ndarray:
    """Resample float samples from ``src_rate`` to ``dst_rate``; returns float32."""
    x = np.asarray(samples, dtype=np.float32)
    if src_rate == dst_rate or x.size == 0:
        return x.copy()
    if src_rate <= 0 or dst_rate <= 0:
        raise ValueError("sample rates must be positive")
    weights, offsets = _phase_table(src_rate, dst_rate, half_taps)
    g = math.gcd(src_rate, dst_rate)
    up, down = dst_rate // g, src_rate // g
    n_out = int(x.size * up // down)
    n = np.arange(n_out, dtype=np.int64)
    base = n * down // up
    padded = np.pad(x, (half_taps, half_taps))
    taps = padded[(base + half_taps)[:, None] + offsets[None, :]]
    return np.einsum("nk,nk->n", taps, weights[n % up]).astype(np.float32)


def float_to_pcm16(samples: np.ndarray) -> bytes:
    clipped = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    return (clipped * 32767.0).astype("<i2").tobytes()


def pcm16_to_float(pcm: bytes) -> np.ndarray:
    if len(pcm) % 2:
        raise ValueError("pcm16 audio must have an even number of bytes")
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
