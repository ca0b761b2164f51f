"""Audio at the edge: the formats a Realtime client declares, converted to and from the session.

Theory of operation
-------------------
Sessions (and their VAD and engine) run on pcm16 mono at one internal rate (16 kHz by
default). Clients declare what they send and want back, as OpenAI's GA contract lets them:
``audio/pcm`` (24 kHz, the only rate GA clients can declare; 16 kHz is accepted as our
extension), ``audio/pcmu`` (G.711 mu-law, 8 kHz) or ``audio/pcma`` (G.711 A-law, 8 kHz). This
module converts at the server's edge, so nothing behind it knows about wire formats:

* input: :class:`InputConverter` decodes G.711 to pcm16 and resamples to the session's rate
  with one streaming soxr resampler per session (its filter state runs across chunks, so
  chunk boundaries add no clicks);
* output: :func:`encode_output` converts one engine packet to the declared output format.
  Each packet is resampled on its own, deliberately: the same event may be sent twice (a
  resume replays it) and must encode to the same bytes both times, which a resampler whose
  state moved on could not promise, nor one that dithers (soxr does, on int16 output: the
  packet is resampled in float and rounded here).

G.711 uses the standard library's ``audioop`` (``audioop-lts`` on Python 3.13+, where the
standard module is gone).
"""

from __future__ import annotations

import sys

import attrs
import numpy as np
import soxr

if sys.version_info >= (3, 13):  # pragma: no cover - audioop left the standard library
    import audioop  # provided by the audioop-lts package
else:
    import warnings

    with warnings.catch_warnings():  # deprecated since 3.11, still the fastest G.711 codec here
        warnings.simplefilter("ignore", DeprecationWarning)
        import audioop

PCM, PCMU, PCMA = "audio/pcm", "audio/pcmu", "audio/pcma"
#: Rates a client may declare for audio/pcm: 24 kHz is GA's; 16 kHz is our extension.
PCM_RATES = (24000, 16000)
G711_RATE = 8000
#: Beta (pre-GA) names of the same formats.
LEGACY_NAMES = {"pcm16": PCM, "g711_ulaw": PCMU, "g711_alaw": PCMA}


@attrs.frozen(slots=True)
class AudioFormat:
    type: str = PCM
    rate: int = 24000

    @classmethod
    def of(cls, kind: str, rate: int | None = None) -> AudioFormat:
        if kind == PCM:
            return cls(PCM, 24000 if rate is None else rate)
        return cls(kind, G711_RATE)

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.type == PCM else 1

    def to_wire(self) -> dict[str, str | int]:
        """The GA ``format`` object (pcmu/pcma carry no rate: it is always 8 kHz)."""
        if self.type == PCM:
            return {"type": PCM, "rate": self.rate}
        return {"type": self.type}


GA_DEFAULT = AudioFormat(PCM, 24000)


def _to_pcm16(data: bytes, fmt: AudioFormat) -> bytes:
    if fmt.type == PCMU:
        return audioop.ulaw2lin(data, 2)
    if fmt.type == PCMA:
        return audioop.alaw2lin(data, 2)
    return data


def _from_pcm16(pcm: bytes, fmt: AudioFormat) -> bytes:
    if fmt.type == PCMU:
        return audioop.lin2ulaw(pcm, 2)
    if fmt.type == PCMA:
        return audioop.lin2alaw(pcm, 2)
    return pcm


def _resample(pcm: bytes, rate_in: int, rate_out: int) -> bytes:
    if rate_in == rate_out or not pcm:
        return pcm
    # In float, rounded here: soxr dithers an int16 output with a seed of its own (taken from
    # the clock and an address), so one packet encoded twice could differ by a step, and a
    # replayed event must encode to the bytes it did the first time.
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32)
    out = soxr.resample(samples, rate_in, rate_out)
    resampled: bytes = np.clip(np.rint(out), -32768, 32767).astype("<i2").tobytes()  # ufuncs are typed Any
    return resampled


class InputConverter:
    """One session's input: client format -> pcm16 at the session's rate, streaming."""

    __slots__ = ("format", "session_rate", "_resamples", "_stream")

    def __init__(self, fmt: AudioFormat, session_rate: int) -> None:
        self.format = fmt
        self.session_rate = session_rate
        self._resamples = fmt.rate != session_rate
        # Built at the first chunk after a start or a flush, not at the flush itself: building
        # one designs its filter, and a flush is on a commit's latency path.
        self._stream: soxr.ResampleStream | None = None

    @property
    def passthrough(self) -> bool:
        return not self._resamples and self.format.type == PCM

    def flush(self) -> bytes:
        """The samples the resampler still holds (a commit ends the stream); then start over."""
        if self._stream is None:  # nothing went in since the last start: nothing is held
            return b""
        out = self._stream.resample_chunk(np.zeros(0, dtype="<i2"), last=True)
        self.reset()
        return np.asarray(out, dtype="<i2").tobytes()

    def reset(self) -> None:
        self._stream = None

    def convert(self, data: bytes) -> bytes:
        pcm = _to_pcm16(data, self.format)
        if not self._resamples:
            return pcm
        stream = self._stream
        if stream is None:
            stream = self._stream = soxr.ResampleStream(self.format.rate, self.session_rate, 1, dtype="int16")
        # A column (frames x one channel) is soxr's own layout: a flat chunk costs a reshape on
        # the way in and numpy's squeeze on the way out, on every chunk of every session.
        out = stream.resample_chunk(np.frombuffer(pcm, dtype="<i2").reshape(-1, 1))
        return np.asarray(out, dtype="<i2").tobytes()


def encode_output(pcm: bytes, rate: int, fmt: AudioFormat) -> bytes:
    """One packet of engine audio (pcm16 at ``rate``) in the client's output format."""
    return _from_pcm16(_resample(pcm, rate, fmt.rate), fmt)
