"""Overlap policy: is the user's speech over an active response a backchannel or a barge-in?

A listener says "mm-hm" or "yeah" while the model talks; cancelling the response for that
would make the model unbearable. So speech over a response only barges in once it has lasted
``min_interruption_ms``; an overlap that ends sooner was a backchannel and the response keeps
going. (LiveKit's default minimum is 0.5 s; vLLM-Omni treats <= 0.7 s as short acks.)

Pure: the caller says how long the overlap has lasted and whether the user is still talking.
The session chart asks it on every chunk of speech over a response (the
``overlap_is_interruption`` guard of the ``overlap`` row); no timer is involved.

While it decides, the response's audio is held from the client (the chart's speech_started
row; core/outbox.py), as OpenAI stops at speech_started: a verdict that comes late costs a
pause, not talk-over. Measured on a Piper + noise corpus (bench/barge_in_bench.py,
docs/benchmarks.md): at 500 ms, 20% of backchannels cancel and 7% of interruptions (a bare
"Stop.") are missed on clean audio; duration alone cannot tell the two apart.
"""

from __future__ import annotations

import enum

import attrs


class OverlapVerdict(enum.Enum):
    #: The user is still talking and has not reached the minimum yet: keep speaking, watch.
    UNDECIDED = "undecided"
    #: The overlap ended before the minimum: keep the response going.
    BACKCHANNEL = "backchannel"
    #: The overlap reached the minimum: cancel the response and listen.
    BARGE_IN = "barge_in"


@attrs.frozen(slots=True)
class OverlapPolicy:
    min_interruption_ms: float = attrs.field(default=500.0)

    @min_interruption_ms.validator
    def _check(self, _attribute: attrs.Attribute[float], value: float) -> None:
        if value < 0:
            raise ValueError("min_interruption_ms must be >= 0")

    def judge(self, overlap_ms: float, *, still_speaking: bool) -> OverlapVerdict:
        if overlap_ms < 0:
            raise ValueError("an overlap cannot last a negative time")
        if overlap_ms >= self.min_interruption_ms:
            return OverlapVerdict.BARGE_IN
        return OverlapVerdict.UNDECIDED if still_speaking else OverlapVerdict.BACKCHANNEL
