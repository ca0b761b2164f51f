"""A session's uncommitted user audio, kept as the chunks it arrived in.

Why not a bytearray: with many sessions each growing its own buffer, an append kept
reallocating and copying a buffer that was cold in the cache, several times what it costs to
keep a reference to the (immutable) chunk and join once when the audio is taken
(docs/benchmarks.md). Appends are the runtime's most frequent message: 50 per second per session.

It answers the bytearray operations the core uses on its input (``+=``, ``len``, ``bytes``,
a prefix slice and deleting a prefix), so the core reads the same either way, plus
:meth:`InputBuffer.keep_last`, the window server VAD keeps while nobody speaks, and
:meth:`InputBuffer.clear`. Given an :class:`~.audio_budget.AudioAccount`, every change of its
size is added to the account as it happens, so the runtime's audio budget counts exactly what
the buffers hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .audio_budget import AudioAccount


#: An append is joined onto the last chunk while that is shorter than this. Kept one object
#: each, a stream of one-sample appends held about 58 bytes for every 2 it counted (a bytes
#: object and its list slot): 29 times what the audio budget saw. Joined, every chunk but the
#: last is at least this long, so what the objects add is a small fraction of the audio, and
#: each append copies at most this much more than itself. A stream of 20 ms chunks at 16 kHz
#: (640 bytes) is never copied.
SMALL_CHUNK = 512


class InputBuffer:
    __slots__ = ("_chunks", "nbytes", "account")

    def __init__(self, account: AudioAccount | None = None) -> None:
        self._chunks: list[bytes] | None = None  # created on first audio: idle sessions stay small
        #: Bytes held: what ``len()`` answers, readable without a call (every append's
        #: input_fits check reads it).
        self.nbytes = 0
        #: Told every change of ``nbytes`` (None: counted nowhere).
        self.account = account

    def __iadd__(self, pcm: bytes) -> InputBuffer:
        if pcm:
            # Kept as it came when it is bytes (immutable), what commands carry: the bytes()
            # call was a no-op paid on every append. Anything mutable is copied.
            if type(pcm) is not bytes:
                pcm = bytes(pcm)
            chunks = self._chunks
            n = len(pcm)
            if chunks is None:
                self._chunks = [pcm]
            elif len(chunks[-1]) < SMALL_CHUNK:
                chunks[-1] += pcm  # a copy of at most SMALL_CHUNK more than this append
            else:
                chunks.append(pcm)
            self.nbytes += n
            account = self.account
            if account is not None:  # AudioAccount.add, inline: this runs on every append
                account.held += n
                account.budget.total += n
        return self

    def __len__(self) -> int:
        return self.nbytes

    def __bool__(self) -> bool:
        return self.nbytes > 0

    def __bytes__(self) -> bytes:
        chunks = self._chunks
        if not chunks:
            return b""
        if len(chunks) > 1:
            joined = b"".join(chunks)
            self._chunks = [joined]  # joined once, however often it is read
            return joined
        return chunks[0]

    def __getitem__(self, key: slice) -> bytes:
        if not isinstance(key, slice):
            raise TypeError("InputBuffer supports slices only")
        return bytes(self)[key]

    def __delitem__(self, key: slice) -> None:
        if not isinstance(key, slice) or key.start is not None or key.step is not None:
            raise TypeError("InputBuffer can only drop a prefix: del buf[:n]")
        rest = bytes(self)[key.stop :]
        self._chunks = [rest] if rest else None
        self._resized(len(rest))

    def keep_last(self, size: int) -> None:
        """Forget all but the newest ``size`` bytes (an even number: whole samples).

        Whole chunks are dropped and at most one is cut, so keeping a short window over a long
        stream costs about one chunk's copy per call, however long the stream has run."""
        excess = self.nbytes - size
        if excess <= 0:
            return
        chunks = self._chunks
        assert chunks is not None  # a buffer longer than size holds at least one chunk
        dropped = 0
        while dropped < len(chunks) and excess >= len(chunks[dropped]):
            excess -= len(chunks[dropped])
            dropped += 1
        del chunks[:dropped]
        if excess:
            chunks[0] = chunks[0][excess:]
        self._resized(size)
        if not chunks:
            self._chunks = None

    def move_into(self, other: InputBuffer) -> None:
        """Hand every chunk to ``other``, after its own, without copying them (a commit).

        Joining them instead copied the audio and freed the chunks: their memory, scattered
        between other sessions' chunks, stayed with the process (glibc gives back only whole
        free pages, and only at a trim), so a server whose clients committed and were then
        refused more by the audio budget held far more than its buffers did."""
        chunks = self._chunks
        if not chunks:
            return
        nbytes = self.nbytes
        self._chunks = None
        self._resized(0)
        if other._chunks is None:
            other._chunks = chunks
        else:
            other._chunks.extend(chunks)
        other._resized(other.nbytes + nbytes)

    def clear(self) -> None:
        """Forget everything held."""
        self._chunks = None
        self._resized(0)

    def detach(self) -> None:
        """Give what is held back to the account and count nothing more (its session closed)."""
        if self.account is not None:
            self.account.add(-self.nbytes)
            self.account = None

    def _resized(self, nbytes: int) -> None:
        if self.account is not None:
            self.account.add(nbytes - self.nbytes)
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"InputBuffer(<{self.nbytes} bytes>)"
