"""The edge's audio conversion: output packets are converted on their own (a replayed event
must encode to the same bytes), and the input resampler starts over cleanly after a commit
(it is rebuilt lazily, at the next chunk, to keep filter design off the commit's path)."""

from __future__ import annotations

import math

import numpy as np
import soxr
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.server.audio_format import GA_DEFAULT, PCM, AudioFormat, InputConverter, encode_output


def tone(ms: int, rate: int, freq: float = 440.0) -> bytes:
    n = rate * ms // 1000
    t = np.arange(n) / rate
    return (np.sin(2 * math.pi * freq * t) * 8000).astype("<i2").tobytes()


def test_an_output_packet_encodes_to_the_same_bytes_whatever_came_before():
    a, b = tone(20, 16000, 300.0), tone(20, 16000, 1200.0)
    first = encode_output(a, 16000, GA_DEFAULT)
    encode_output(b, 16000, GA_DEFAULT)
    encode_output(tone(7, 16000), 16000, GA_DEFAULT)
    assert encode_output(a, 16000, GA_DEFAULT) == first
    assert len(first) == 2 * 480  # 20 ms at 24 kHz
    # Not by luck: soxr dithers an int16 output with a seed of its own, so the same packet
    # resampled as int16 came out differently now and then within one process.
    again = set()
    for k in range(40):
        encode_output(tone(5 + k, 16000, 500.0 + 37 * k), 16000, GA_DEFAULT)
        again.add(encode_output(a, 16000, GA_DEFAULT))
    assert again == {first}


def test_the_input_resampler_starts_over_after_a_flush():
    chunks = [tone(100, 24000, f) for f in (200.0, 700.0, 1500.0)]

    def run(converter: InputConverter) -> bytes:
        return b"".join(converter.convert(c) for c in chunks) + converter.flush()

    used = InputConverter(AudioFormat(PCM, 24000), 16000)
    used.convert(tone(55, 24000, 3000.0))
    used.flush()  # a commit: what came before must leave nothing behind
    assert _same_audio(run(used), run(InputConverter(AudioFormat(PCM, 24000), 16000)))
    used.convert(tone(30, 24000, 900.0))
    used.reset()  # input_audio_buffer.clear
    assert _same_audio(run(used), run(InputConverter(AudioFormat(PCM, 24000), 16000)))


def _same_audio(a: bytes, b: bytes) -> bool:
    """As many samples, each within a rounding step or two: soxr dithers the input stream's
    int16 output with a seed of its own (left on: the input is never replayed, and rounding in
    float costs more than the rest of the conversion). What a flush failed to clear would
    differ by far more: the 3 kHz tone is thousands of steps loud."""
    x, y = (np.frombuffer(pcm, dtype="<i2").astype(int) for pcm in (a, b))
    return len(x) == len(y) > 0 and int(np.abs(x - y).max()) <= 2


def test_a_flush_with_nothing_converted_since_holds_nothing():
    converter = InputConverter(AudioFormat(PCM, 24000), 16000)
    assert converter.flush() == b""
    converter.convert(tone(20, 24000))
    assert converter.flush() != b""  # the filter's tail
    assert converter.flush() == b""
    assert not converter.passthrough
    assert InputConverter(AudioFormat(PCM, 16000), 16000).passthrough


_SIGNAL = (np.random.default_rng(7).standard_normal(4800) * 3000).astype("<i2")  # 200 ms, 24 kHz


@given(st.lists(st.integers(min_value=1, max_value=len(_SIGNAL) - 1), max_size=12, unique=True))
@settings(max_examples=60, deadline=None)
def test_the_input_resampler_is_soxrs_stream_chunk_for_chunk(cuts):
    # The converter hands soxr each chunk as a column (its own layout): what comes out must be
    # what soxr's stream gives for the same chunks, as many samples, each within a rounding
    # step (soxr dithers its int16 output: two runs of one stream differ by a step or so).
    bounds = [0, *sorted(cuts), len(_SIGNAL)]
    chunks = [_SIGNAL[a:b] for a, b in zip(bounds, bounds[1:])]
    converter = InputConverter(AudioFormat(PCM, 24000), 16000)
    ours = b"".join(converter.convert(chunk.tobytes()) for chunk in chunks) + converter.flush()
    stream = soxr.ResampleStream(24000, 16000, 1, dtype="int16")
    theirs = np.concatenate(
        [stream.resample_chunk(chunk) for chunk in chunks] + [stream.resample_chunk(_SIGNAL[:0], last=True)]
    )
    samples = np.frombuffer(ours, dtype="<i2").astype(int)
    assert len(samples) == len(theirs) == 3200  # 200 ms at 16 kHz
    assert np.abs(samples - theirs.astype(int)).max() <= 2
    # However the client cuts its audio, the session gets the same audio.
    whole = InputConverter(AudioFormat(PCM, 24000), 16000)
    once = np.frombuffer(whole.convert(_SIGNAL.tobytes()) + whole.flush(), dtype="<i2")
    assert np.abs(samples - once.astype(int)).max() <= 2
