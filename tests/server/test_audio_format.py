"""The edge's audio conversion: output packets are converted on their own (a replayed event
must encode to the same bytes), and the input resampler starts over cleanly after a commit
(it is rebuilt lazily, at the next chunk, to keep filter design off the commit's path)."""

from __future__ import annotations

import math

import numpy as np

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


def test_the_input_resampler_starts_over_after_a_flush():
    chunks = [tone(100, 24000, f) for f in (200.0, 700.0, 1500.0)]

    def run(converter: InputConverter) -> bytes:
        return b"".join(converter.convert(c) for c in chunks) + converter.flush()

    used = InputConverter(AudioFormat(PCM, 24000), 16000)
    used.convert(tone(55, 24000, 3000.0))
    used.flush()  # a commit: what came before must leave nothing behind
    assert run(used) == run(InputConverter(AudioFormat(PCM, 24000), 16000))
    used.convert(tone(30, 24000, 900.0))
    used.reset()  # input_audio_buffer.clear
    assert run(used) == run(InputConverter(AudioFormat(PCM, 24000), 16000))


def test_a_flush_with_nothing_converted_since_holds_nothing():
    converter = InputConverter(AudioFormat(PCM, 24000), 16000)
    assert converter.flush() == b""
    converter.convert(tone(20, 24000))
    assert converter.flush() != b""  # the filter's tail
    assert converter.flush() == b""
    assert not converter.passthrough
    assert InputConverter(AudioFormat(PCM, 16000), 16000).passthrough
