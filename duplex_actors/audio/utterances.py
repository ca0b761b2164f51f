"""The demo's user utterances: text shipped with the package, speech made with Piper.

The simulated callers need real speech (so the real VAD has something to detect) without
shipping recordings: the texts live in ``duplex_actors/assets/utterances.txt`` and
:func:`synthesize_utterance` speaks them with the packaged Piper voice at 16 kHz pcm16.
"""

from __future__ import annotations

import functools
from importlib import resources

import attrs

from .tts import OUTPUT_RATE, PiperTTS, default_tts

_BACKCHANNEL_HEADER = "[backchannels]"


@attrs.frozen(slots=True)
class Utterances:
    turns: tuple[str, ...]
    backchannels: tuple[str, ...]


def parse_utterances(text: str) -> Utterances:
    turns: list[str] = []
    backchannels: list[str] = []
    target = turns
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line == _BACKCHANNEL_HEADER:
            target = backchannels
            continue
        target.append(line)
    if not turns:
        raise ValueError("the utterance file has no user turns")
    return Utterances(tuple(turns), tuple(backchannels))


@functools.lru_cache(maxsize=1)
def load_utterances() -> Utterances:
    text = resources.files("duplex_actors").joinpath("assets", "utterances.txt").read_text(encoding="utf-8")
    return parse_utterances(text)


def synthesize_utterance(
    text: str, *, tts: PiperTTS | None = None, sample_rate: int = OUTPUT_RATE, varied: bool = True
) -> bytes:
    """pcm16 mono speech of ``text`` at ``sample_rate`` (16 kHz by default). Blocking: run it
    in a thread when an event loop is live. Uses the shared packaged voice unless given one.
    ``varied=False``: the same samples every time (PiperTTS.synthesize)."""
    if not text.strip():
        raise ValueError("nothing to say")
    return (tts or default_tts()).synthesize_pcm16(text, sample_rate, varied=varied)
