"""The decoder's optional accelerator (pybase64, extra 'fast') reads every append as the
standard library's base64 does: the same audio, or the same refusal."""

from __future__ import annotations

import base64
import json

import pytest

from duplex_actors.errors import DuplexError
from duplex_actors.server import wire

AUDIO = [
    base64.b64encode(bytes(range(256)) * 4).decode(),  # 1024 bytes
    base64.b64encode(b"\x01\x00" * 480).decode(),  # a 20 ms frame at 24 kHz
    "AAA",  # bad padding
    "AA==AA==",  # padding inside
    "AA AA",  # whitespace
    "AAAA\n",
    "====",
    "",
    "A===",
    "AB==",
    "AB=",
    "ABC=",  # one byte: odd length for pcm16
    "AB-_",  # the URL-safe alphabet
    "é",  # not ASCII
    "AAAA" * 70_000,  # past max_chunk_bytes
]


def _outcome(frame: str) -> tuple:
    try:
        event = wire.decode(frame, sample_rate=24000)
    except DuplexError as err:
        return (type(err).__name__, err.code, str(err))
    return (type(event).__name__, getattr(event, "pcm", None), getattr(event, "data", None))


@pytest.mark.parametrize("audio", AUDIO)
def test_pybase64_and_the_standard_library_decode_appends_alike(audio, monkeypatch):
    pybase64 = pytest.importorskip("pybase64")
    frame = json.dumps({"type": "input_audio_buffer.append", "audio": audio})
    monkeypatch.setattr(wire, "_b64decode", pybase64.b64decode)
    fast = _outcome(frame)
    monkeypatch.setattr(wire, "_b64decode", base64.b64decode)
    assert fast == _outcome(frame)
