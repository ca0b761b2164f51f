"""The per-session output buffer: events produced but not yet handed to the client.

Bounded, with a reserve that only terminal events (response.done, session.closed) may use, so
a slow consumer can never make a session lose its terminal events. When a non-terminal event
does not fit, ``push`` returns False and the session applies its declared slow-consumer policy
(close with reason ``slow_consumer``); memory never grows without bound.

``error`` events answer the client's own refused commands, so their number is the client's
choice: a client that floods bad frames and never reads could otherwise fill memory through
them. They may not use the reserve; past ``capacity - reserve`` they are counted
(``dropped_errors``) and dropped, never queued.

Audio of a cancelled response that is still here was never heard: barge-in purges it.

While the user talks over a response (server VAD's speech_started), the chart may *hold* that
response's audio: its audio and transcript deltas are kept aside, not handed to the client,
until the overlap policy decides. An interruption purges them (never heard), a backchannel
releases them in order. Held events count against the capacity like queued ones, so a hold
cannot grow memory past the bound either.

The capacity counts events, and an audio delta may be of any size, so the outbox also keeps
``audio_bytes``: the pcm it holds, queued and held. The session's shell makes the engine wait
while either is high (actors/session_actor.py, ``listener_behind``): a response is not produced
faster than its listener takes it, whether the client reads slowly or is away, and the engine's
output alone never overflows the capacity; what the client asks for itself still can.
"""

from __future__ import annotations

from collections import deque

from .events import AudioDeltaEvent, ErrorEvent, ServerEvent, TextDeltaEvent, TranscriptDeltaEvent


class Outbox:
    __slots__ = (
        "capacity",
        "reserve",
        "_q",
        "overflowed",
        "dropped_errors",
        "_held",
        "holding",
        "_held_kinds",
        "audio_bytes",
    )

    def __init__(self, capacity: int = 1024, reserve: int = 16) -> None:
        if reserve < 2 or capacity <= reserve:
            raise ValueError("need capacity > reserve >= 2")
        self.capacity = capacity
        self.reserve = reserve
        self._q: deque[ServerEvent] = deque()
        self.overflowed = False
        self.dropped_errors = 0
        self._held: deque[ServerEvent] = deque()
        #: The response whose audio is held (None: nothing held), and which of its deltas.
        self.holding: str | None = None
        self._held_kinds: tuple[type, ...] = _AUDIO
        #: Bytes of pcm in the audio deltas held here, queued or held.
        self.audio_bytes = 0

    def push(self, event: ServerEvent) -> bool:
        if type(event) is ErrorEvent:
            if len(self._q) >= self.capacity - self.reserve:
                self.dropped_errors += 1  # count-and-drop: the reserve is for response ends
            else:
                self._q.append(event)
            return True
        limit = self.capacity if event.TERMINAL else self.capacity - self.reserve
        depth = len(self._q)
        if self._held:  # nearly always empty: only a hold fills it
            depth += len(self._held)
        if depth >= limit:
            if not event.TERMINAL:
                self.overflowed = True
                return False
            # The reserve is sized for a session's terminal events; past it something is badly
            # wrong, and keeping the terminal beats keeping an older delta.
            self._drop_oldest_nonterminal()
        if type(event) is AudioDeltaEvent:
            self.audio_bytes += len(event.pcm)
        if (
            self.holding is not None
            and isinstance(event, self._held_kinds)
            and getattr(event, "response_id", None) == self.holding
        ):
            self._held.append(event)
        else:
            self._q.append(event)
        return True

    def hold(self, response_id: str, *, text: bool = False) -> None:
        """Keep this response's audio (and its transcript deltas) aside from now on; ``text``:
        its text deltas too (a response with text beside its audio keeps both in order)."""
        self.holding = response_id
        self._held_kinds = _AUDIO_AND_TEXT if text else _AUDIO

    def release(self) -> int:
        """End the hold: what was held follows what is queued, in the order it came."""
        released = len(self._held)
        self._q.extend(self._held)
        self._held.clear()
        self.holding = None
        return released

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def depth(self) -> int:
        """Events here, queued and held (what the capacity counts)."""
        return len(self._q) + len(self._held)

    def _drop_oldest_nonterminal(self) -> None:
        for box in (self._held, self._q):  # held audio first: it may never be heard anyway
            for i, ev in enumerate(box):
                if not ev.TERMINAL:
                    del box[i]
                    self.audio_bytes -= _audio_bytes(ev)
                    return

    def purge_audio(self, response_id: str) -> int:
        """Drop undelivered audio (and its transcript deltas) of one response, held or queued;
        a hold of it ends."""
        before = len(self._q) + len(self._held)
        self._q = deque(ev for ev in self._q if not _is_audio_of(ev, response_id))
        # Everything held of it goes: none of it was delivered.
        self._held = deque(ev for ev in self._held if getattr(ev, "response_id", None) != response_id)
        if self.holding == response_id:
            self.release()  # nothing of it is left to release; later audio is not held
        self.audio_bytes = sum(map(_audio_bytes, self._q)) + sum(map(_audio_bytes, self._held))
        return before - len(self._q) - len(self._held)

    def popleft(self) -> ServerEvent:
        event = self._q.popleft()
        self.audio_bytes -= _audio_bytes(event)
        return event

    def take(self, limit: int | None = None) -> list[ServerEvent]:
        """Hand over the queued events, oldest first (at most ``limit`` of them; held ones stay
        held). One call per take rather than a test and a pop per event: every event of every
        session passes here."""
        q = self._q
        if limit is None or limit >= len(q):
            taken = list(q)
            q.clear()
            if self.audio_bytes:
                # Whatever audio is left is held (nearly always none).
                held = self._held
                self.audio_bytes = sum(map(_audio_bytes, held)) if held else 0
            return taken
        taken = [q.popleft() for _ in range(max(limit, 0))]
        if self.audio_bytes:
            self.audio_bytes -= sum(map(_audio_bytes, taken))
        return taken

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)


_AUDIO: tuple[type, ...] = (AudioDeltaEvent, TranscriptDeltaEvent)
_AUDIO_AND_TEXT: tuple[type, ...] = (AudioDeltaEvent, TranscriptDeltaEvent, TextDeltaEvent)


def _audio_bytes(event: ServerEvent) -> int:
    return len(event.pcm) if type(event) is AudioDeltaEvent else 0


def _is_audio_of(event: ServerEvent, response_id: str) -> bool:
    return isinstance(event, (AudioDeltaEvent, TranscriptDeltaEvent)) and event.response_id == response_id
