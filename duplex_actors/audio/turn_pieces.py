"""Where a long committed turn is cut into pieces for the recogniser.

The recogniser is shared by every session, and a turn holds it for as long as it takes to
decode. Decoded whole, one session's long turn made a neighbour's short turn wait for most of
it. Decoded in pieces of at most
``max_piece_s``, with sessions taking turns piece by piece (actors/transcription_queue.py), a
neighbour waits for the piece being decoded.

A cut through a word costs the recogniser that word on both sides, so each piece ends in the
quietest 100 ms of its second half: between words, wherever the speaker paused. On piper's
speech these pieces had a lower word error rate than the turn decoded whole, than cuts at the
quietest single 10 ms, and than cuts at a fixed mark (through a word; docs/benchmarks.md).
Pure and cheap (numpy over the search window only); no I/O.
"""

from __future__ import annotations

import numpy as np

#: Seconds of audio a piece holds at most: what a neighbour's turn may wait for (loud noise,
#: the costliest audio to decode, can take longer than real time on a loaded host).
MAX_PIECE_S = 4.0
#: How far back from there a cut is looked for, as a share of the piece: the last 2 s of 4.
SEARCH_SHARE = 0.5

_FRAME_S = 0.010
#: The quiet looked for is 100 ms long: a pause between words or sentences, not the closure
#: of a stop consonant inside a word (a single quietest 10 ms frame often was one).
_PAUSE_FRAMES = 10


def next_cut(pcm: bytes, start: int, sample_rate: int, *, max_piece_s: float = MAX_PIECE_S) -> int:
    """Byte offset where the piece of ``pcm`` (pcm16 mono) that begins at byte ``start`` ends:
    the end of the audio when at most ``max_piece_s`` is left, else the middle of the quietest
    100 ms in the piece's last ``SEARCH_SHARE`` (always past ``start``, always on a sample)."""
    if max_piece_s <= 0:
        raise ValueError("need max_piece_s > 0")
    limit = start + 2 * max(1, int(max_piece_s * sample_rate))
    if limit >= len(pcm):
        return len(pcm)
    frame = max(1, int(_FRAME_S * sample_rate))
    window_start = limit - 2 * int(SEARCH_SHARE * max_piece_s * sample_rate)
    samples = np.frombuffer(pcm, dtype="<i2", count=(limit - window_start) // 2, offset=window_start)
    frames = samples[: len(samples) // frame * frame].reshape(-1, frame).astype(np.float32)
    if not len(frames):
        return limit
    energy = np.einsum("ij,ij->i", frames, frames)
    quietest = int(np.argmin(np.convolve(energy, np.ones(_PAUSE_FRAMES, dtype=np.float32), mode="same")))
    cut = window_start + 2 * (quietest * frame + frame // 2)
    return max(cut, start + 2)  # a piece holds at least a sample
