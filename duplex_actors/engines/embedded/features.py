"""Log-mel features of pcm16 audio, in plain torch (no torchaudio).

These are the thinker's audio input: 25 ms Hann windows every 10 ms, a mel filterbank, a
clamped log. Consecutive frames are stacked into one *audio token* per ``frames_per_token``
frames (80 ms by default) and the model projects each stack into its embedding space, so the
user's audio really shapes the prefix the decoder attends to.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import cast

import torch

SAMPLE_RATE = 16000
N_FFT = 400  # 25 ms at 16 kHz
HOP = 160  # 10 ms at 16 kHz
#: Frames :func:`log_mel_tokens_batch` transforms in one go (its spectra then fit in a core's
#: cache; see docs/embedded.md).
BATCH_FRAMES = 512


def _hz_to_mel(hz: float) -> float:
    return 2595.0 * math.log10(1.0 + hz / 700.0)


def _mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


@functools.lru_cache(maxsize=4)
def mel_filterbank(n_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """Triangular filters on the HTK mel scale, shape (n_fft // 2 + 1, n_mels)."""
    n_bins = n_fft // 2 + 1
    bin_hz = torch.linspace(0.0, sample_rate / 2, n_bins)
    mel_edges = torch.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2), n_mels + 2)
    hz_edges = _mel_to_hz(mel_edges)
    lower, centre, upper = hz_edges[:-2], hz_edges[1:-1], hz_edges[2:]
    rising = (bin_hz[:, None] - lower[None, :]) / (centre - lower)[None, :]
    falling = (upper[None, :] - bin_hz[:, None]) / (upper - centre)[None, :]
    return torch.clamp(torch.minimum(rising, falling), min=0.0)


@functools.lru_cache(maxsize=2)
def _window(n_fft: int) -> torch.Tensor:
    return torch.hann_window(n_fft)


@functools.lru_cache(maxsize=8)
def _transform_constants(n_mels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The Hann window and the mel filterbank, on ``device`` (copied there once)."""
    return _window(N_FFT).to(device), mel_filterbank(n_mels).to(device)


def pcm16_to_float(pcm: bytes) -> torch.Tensor:
    """pcm16 little-endian mono bytes -> float32 samples in [-1, 1)."""
    if len(pcm) % 2:
        raise ValueError("pcm16 audio must have an even number of bytes")
    if not pcm:
        return torch.zeros(0)
    samples = torch.frombuffer(bytearray(pcm), dtype=torch.int16)
    return samples.to(torch.float32) / 32768.0


def log_mel_tokens(
    samples: torch.Tensor, n_tokens: int, *, n_mels: int, frames_per_token: int
) -> torch.Tensor:
    """Exactly ``n_tokens`` stacked log-mel tokens of ``samples``: shape
    (n_tokens, n_mels * frames_per_token).

    The audio is zero-padded (or its oldest part dropped) so that the frame count is exactly
    ``n_tokens * frames_per_token``: the budget is decided by the caller (the adapter) from the
    PCM length, and the features must match it.
    """
    return _log_mel(_fit(samples, n_tokens, frames_per_token)[None], n_tokens, n_mels, frames_per_token)[0]


def log_mel_tokens_batch(
    samples: Sequence[torch.Tensor],
    n_tokens: Sequence[int],
    *,
    n_mels: int,
    frames_per_token: int,
    device: torch.device | str | None = None,
) -> list[torch.Tensor]:
    """:func:`log_mel_tokens` of several pieces of audio (``n_tokens[i]`` tokens of
    ``samples[i]``), in order. Pieces with the same token count go through one FFT and one
    filterbank product: a turn's second of audio is a dozen small torch ops, whose per-call
    cost outweighs their arithmetic, so a burst of admitted turns pays it once per length
    instead of once per turn.

    ``device`` (a GPU): the samples of each length cross to it in one copy and are transformed
    there, and the tokens are returned there: on the CPU they were the largest part of a GPU
    engine's host work in a burst, where the device does them in a few launches."""

    def fitted(where: list[int], n: int) -> torch.Tensor:
        return torch.stack([_fit(samples[i], n, frames_per_token) for i in where])

    return _batched(fitted, n_tokens, n_mels, frames_per_token, device)


def log_mel_tokens_of_pcm(
    pcms: Sequence[bytes],
    n_tokens: Sequence[int],
    *,
    n_mels: int,
    frames_per_token: int,
    device: torch.device | str | None = None,
) -> list[torch.Tensor]:
    """:func:`log_mel_tokens_batch` of pcm16 audio as it arrives: the same tokens, but each
    length's pieces are fitted as bytes (a slice or zero bytes appended, a memory copy each),
    joined, and become samples in one conversion (on a GPU, after one copy there of half the
    bytes). Converting and fitting each piece as its own tensor, several small CPU ops per
    turn, was the largest part of a GPU engine's host work in a burst of turns."""

    def fitted(where: list[int], n: int) -> torch.Tensor:
        width = 2 * _fitted_samples(n, frames_per_token)
        joined = bytearray()
        for i in where:
            pcm = pcms[i]
            if len(pcm) % 2:
                raise ValueError("pcm16 audio must have an even number of bytes")
            if len(pcm) >= width:
                joined += memoryview(pcm)[len(pcm) - width :]
            else:
                joined += pcm
                joined += bytes(width - len(pcm))
        return torch.frombuffer(joined, dtype=torch.int16).view(len(where), width // 2)

    return _batched(fitted, n_tokens, n_mels, frames_per_token, device, scale=1.0 / 32768.0)


def _batched(
    fitted: Callable[[list[int], int], torch.Tensor],
    n_tokens: Sequence[int],
    n_mels: int,
    frames_per_token: int,
    device: torch.device | str | None,
    scale: float | None = None,
) -> list[torch.Tensor]:
    """The tokens of each piece, grouped by token count: ``fitted(where, n)`` gives the
    pieces ``where`` as one (k, samples) batch; ``scale`` (for integer samples) makes them
    floats where the transform runs."""
    out: list[torch.Tensor | None] = [None] * len(n_tokens)
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(n_tokens):
        by_length.setdefault(n, []).append(i)
    on_device = device is not None and torch.device(device).type != "cpu"
    for n, same in by_length.items():
        # On the CPU, in chunks that keep the intermediate spectra in its cache: one product
        # over every piece of a large burst streams tens of MB through memory several times.
        # A GPU takes each length at once.
        per_chunk = len(same) if on_device else max(1, BATCH_FRAMES // (n * frames_per_token))
        for start in range(0, len(same), per_chunk):
            where = same[start : start + per_chunk]
            batch = fitted(where, n)
            if on_device:
                batch = batch.to(device)
            if scale is not None:
                batch = batch.to(torch.float32) * scale
            for i, tokens in zip(where, _log_mel(batch, n, n_mels, frames_per_token).unbind(0)):
                out[i] = tokens
    # Every place is filled above (each index is in exactly one length group).
    return cast(list[torch.Tensor], out)


def _fitted_samples(n_tokens: int, frames_per_token: int) -> int:
    """How many samples make exactly ``n_tokens * frames_per_token`` frames."""
    return (n_tokens * frames_per_token - 1) * HOP + N_FFT


def _fit(samples: torch.Tensor, n_tokens: int, frames_per_token: int) -> torch.Tensor:
    """The samples that make exactly ``n_tokens * frames_per_token`` frames: zero-padded at the
    end, or the oldest dropped (the most recent audio is what a response reacts to)."""
    needed = _fitted_samples(n_tokens, frames_per_token)
    if samples.numel() < needed:
        return torch.nn.functional.pad(samples, (0, needed - samples.numel()))
    return samples[samples.numel() - needed :]


def _log_mel(batch: torch.Tensor, n_tokens: int, n_mels: int, frames_per_token: int) -> torch.Tensor:
    """(k, samples) fitted audio -> (k, n_tokens, n_mels * frames_per_token) tokens."""
    window, filterbank = _transform_constants(n_mels, batch.device)
    frames = batch.unfold(1, N_FFT, HOP)  # (k, n_frames, N_FFT)
    spectrum = torch.fft.rfft(frames * window, dim=-1)
    power = spectrum.real.square() + spectrum.imag.square()
    mel = power @ filterbank
    log_mel = torch.log10(torch.clamp(mel, min=1e-10))
    # Whisper-style dynamic range, per piece: keep 8 decades below its loudest bin, then centre
    # and scale to roughly unit range so random projections see inputs of a sane size.
    log_mel = torch.maximum(log_mel, log_mel.amax(dim=(1, 2), keepdim=True) - 8.0)
    log_mel = (log_mel + 4.0) / 4.0
    return log_mel.reshape(batch.shape[0], n_tokens, frames_per_token * n_mels)
