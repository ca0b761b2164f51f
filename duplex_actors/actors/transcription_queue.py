"""Committed turns waiting for the recogniser, shared fairly between sessions.

The recogniser is one worker process (PocketSphinx holds the GIL and decodes at 0.1-0.8 of
real time here, depending on the audio), shared by every session that asks for input
transcription. Served first come, first served, one session committing faster than the
recogniser decodes (server pacing lets a client send 4x real time) queued its turns in front of
everyone else's, without limit: a neighbour's transcript waited for all of them, and each
waiting turn held its audio.

So the queue is sans-IO and fair:

* one FIFO per session, served *piece by piece* (a turn longer than ``max_piece_s`` is decoded
  in pieces cut at a pause, audio/turn_pieces.py) in core/fair_share.py's order: the tenant
  (API key or client address) served least recently, then its session served least recently.
  Tenants with work all along therefore take turns, and so do the sessions of each; a tenant
  that was idle goes ahead of any served since it was last served. A neighbour's short turn
  waits for the pieces being decoded and not more, whatever the other tenants' backlogs, turn
  lengths and number of sessions. Served turn by turn, one session's 120 s turn of noise held a
  neighbour's 1 s turn for 56 s at the median (``flood_bench --long-turn 120``); shared by
  session rather than by tenant, a client with six sessions each committing 60 s turns held a
  neighbour's 8 s turn 24-28 s (4.2 s alone);
* each session's backlog is bounded in seconds of audio (``max_backlog_s``): a turn past it is
  refused at once, and the runtime answers it with a transcription ``failed`` event saying
  why. Every turn is answered (its pieces' words joined, or one failure) or refused exactly
  once, or forgotten; memory held is at most the bound per session;
* a waiting turn's audio is a copy of its own (the committed audio stays with the session for
  its response), so it counts against the runtime's audio budget in its client's account
  (core/audio_budget.py) from the moment it is queued until the turn is answered or forgotten.
  A client over its share of a full budget has its turns refused like a full backlog: per
  session, the backlog bound alone let many sessions of a client each hold a turn's copy
  beside the buffers the budget already counted (docs/reliability.md);
* a closed session's queued turns are forgotten: nobody is left to tell. Pieces already being
  decoded finish; a forgotten turn's words are dropped.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import attrs

from ..audio.turn_pieces import MAX_PIECE_S, next_cut
from ..core.actions import InputTranscript, TranscribeInput
from ..core.audio_budget import AudioAccount
from ..core.commands import AppendAudio, Command, SpeechStartedSignal, SpeechStoppedSignal
from ..core.fair_share import FairShare


@attrs.frozen(slots=True)
class TranscriptionJob:
    """One committed turn to transcribe, and where its result goes."""

    session_id: str
    action: TranscribeInput
    deliver: Callable[[InputTranscript], None] = attrs.field(eq=False)
    #: Whom the session's turns count against (None: the session alone).
    tenant: str | None = None
    #: The client's account in the runtime's audio budget, which the turn's audio counts in
    #: while it waits (None: no budget).
    account: AudioAccount | None = attrs.field(default=None, eq=False)

    @property
    def seconds(self) -> float:
        return len(self.action.audio) / (2 * self.action.sample_rate)


@attrs.define(slots=True, eq=False)
class _Turn:
    """A job being handed out piece by piece, and the words of its pieces so far."""

    job: TranscriptionJob
    cut: int = 0  # bytes of its audio handed out as pieces
    words: dict[int, str] = attrs.field(factory=dict)  # piece index -> what was heard
    pieces: int = 0  # handed out so far
    said: int = 0  # pieces whose words went out (in order: a later piece may be heard first)
    spoke: bool = False  # some words went out (the next ones follow after a space)
    whole: bool = False  # the last piece has been handed out
    over: bool = False  # answered (or its session forgotten): later pieces' words are dropped


@attrs.frozen(slots=True)
class Heard:
    """Words of a turn to send: ``delta`` (what follows the words sent before), and, once
    every piece is heard, the whole ``transcript`` (None until then)."""

    job: TranscriptionJob
    delta: str
    transcript: str | None = None

    @property
    def final(self) -> bool:
        return self.transcript is not None


@attrs.frozen(slots=True, eq=False)
class TranscriptionPiece:
    """A part of one turn, to decode on its own."""

    turn: _Turn
    index: int
    audio: bytes

    @property
    def job(self) -> TranscriptionJob:
        return self.turn.job

    @property
    def seconds(self) -> float:
        return len(self.audio) / (2 * self.turn.job.action.sample_rate)


class TranscriptionQueue:
    """Per-session FIFOs, served piece by piece in fair-share order (tenant, then session);
    each session's backlog at most ``max_backlog_s``."""

    __slots__ = ("max_backlog_s", "max_piece_s", "_queues", "_share", "_backlog_s")

    def __init__(self, max_backlog_s: float, *, max_piece_s: float = MAX_PIECE_S) -> None:
        if max_backlog_s <= 0 or max_piece_s <= 0:
            raise ValueError("need max_backlog_s > 0 and max_piece_s > 0")
        self.max_backlog_s = max_backlog_s
        self.max_piece_s = max_piece_s
        #: Sessions with pieces left to hand out.
        self._queues: dict[str, deque[_Turn]] = {}
        #: Who goes next. A session is a flow of its tenant; it is forgotten when it closes,
        #: so an idle spell does not wipe its place in line.
        self._share: FairShare[str] = FairShare()
        self._backlog_s: dict[str, float] = {}

    def refusal(self, job: TranscriptionJob) -> str | None:
        """Why :meth:`offer` would refuse ``job``, in words for its client; None: it would not.

        A single turn longer than the bound is still taken when nothing of its session waits:
        the bound is against piling up, not against long turns."""
        backlog = self._backlog_s.get(job.session_id, 0.0)
        if backlog and backlog + job.seconds > self.max_backlog_s:
            return (
                f"transcription backlog full: this session already has {backlog:.1f} s of audio "
                f"waiting for the recogniser (at most {self.max_backlog_s:g} s)"
            )
        account = job.account
        if account is not None and not account.budget.allows(account, len(job.action.audio)):
            return (
                "transcription refused: the server's audio budget is full and this client "
                "already holds more than its share of it; commit less audio while transcripts "
                "are pending"
            )
        return None

    def offer(self, job: TranscriptionJob) -> bool:
        """Queue ``job``; False (nothing queued) if :meth:`refusal` has a reason not to."""
        if self.refusal(job) is not None:
            return False
        sid = job.session_id
        self._backlog_s[sid] = self._backlog_s.get(sid, 0.0) + job.seconds
        if job.account is not None:
            job.account.add(len(job.action.audio))
        queue = self._queues.get(sid)
        if queue is None:
            queue = self._queues[sid] = deque()
            self._share.wait(sid, job.tenant)
        queue.append(_Turn(job))
        return True

    def take(self) -> TranscriptionPiece | None:
        """The next piece: of the oldest turn of the session that goes next (None: nothing
        queued)."""
        sid = self._share.next()
        if sid is None:
            return None
        queue = self._queues[sid]
        turn = queue[0]
        action = turn.job.action
        begin = turn.cut
        turn.cut = end = next_cut(action.audio, begin, action.sample_rate, max_piece_s=self.max_piece_s)
        piece = TranscriptionPiece(turn, turn.pieces, action.audio[begin:end])
        turn.pieces += 1
        if end >= len(action.audio):
            turn.whole = True
            queue.popleft()
        if queue:
            # Its next piece comes after every tenant, and session of its tenant, served before.
            self._share.wait(sid, turn.job.tenant)
        else:
            del self._queues[sid]
        return piece

    def heard(self, piece: TranscriptionPiece, words: str) -> Heard | None:
        """``piece`` (from :meth:`take`) was decoded as ``words``: what of its turn can be sent
        now, in order (None: nothing yet, or the turn was answered already). The deltas joined
        are the transcript: each piece's words, a space between."""
        self._free(piece.job.session_id, piece.seconds)
        turn = piece.turn
        if turn.over:
            return None
        turn.words[piece.index] = words
        delta: list[str] = []
        while turn.said in turn.words:
            said = turn.words[turn.said]
            if said:
                delta.append(" " + said if turn.spoke or delta else said)
            turn.said += 1
        turn.spoke = turn.spoke or bool(delta)
        if turn.whole and turn.said == turn.pieces:
            self._end(turn)
            heard = (turn.words[i] for i in range(turn.pieces))
            return Heard(turn.job, "".join(delta), " ".join(w for w in heard if w))
        return Heard(turn.job, "".join(delta)) if delta else None

    def failed(self, piece: TranscriptionPiece) -> TranscriptionJob | None:
        """Decoding ``piece`` failed, so its whole turn has: the turn, to answer with the
        failure (None if it was answered already). Its pieces not handed out are dropped."""
        self._free(piece.job.session_id, piece.seconds)
        turn = piece.turn
        if turn.over:
            return None
        self._end(turn)
        self._drop_rest(turn)
        return turn.job

    def forget(self, session_id: str) -> int:
        """Drop a closed session's queued turns; how many turns that leaves unanswered (pieces
        being decoded finish, and their words are dropped)."""
        self._share.forget(session_id)
        queue = self._queues.pop(session_id, None)
        if queue is None:
            return 0
        for turn in queue:
            self._end(turn)
            self._drop_rest(turn)
        return len(queue)

    @staticmethod
    def _end(turn: _Turn) -> None:
        """``turn`` is answered or forgotten: later pieces' words are dropped, and its audio
        leaves its client's account. (A forgotten turn's pieces being decoded still hold theirs
        until the recogniser is done: at most one piece per recogniser worker.)"""
        turn.over = True
        account = turn.job.account
        if account is not None:
            account.add(-len(turn.job.action.audio))

    def _drop_rest(self, turn: _Turn) -> None:
        """Forget the pieces of ``turn`` not handed out yet."""
        audio = turn.job.action.audio
        if turn.whole:
            return
        sid = turn.job.session_id
        self._free(sid, (len(audio) - turn.cut) / (2 * turn.job.action.sample_rate))
        turn.cut, turn.whole = len(audio), True
        queue = self._queues.get(sid)
        if queue is not None and turn in queue:
            queue.remove(turn)
            if not queue:
                del self._queues[sid]
                self._share.leave(sid)

    def _free(self, session_id: str, seconds: float) -> None:
        left = self._backlog_s.get(session_id, 0.0) - seconds
        if left > 1e-9:
            self._backlog_s[session_id] = left
        else:
            self._backlog_s.pop(session_id, None)

    def backlog_s(self, session_id: str) -> float:
        """Seconds of ``session_id``'s audio queued or being transcribed."""
        return self._backlog_s.get(session_id, 0.0)

    def __len__(self) -> int:
        """Turns with pieces still to hand out."""
        return sum(len(q) for q in self._queues.values())


@attrs.define(slots=True, eq=False)
class Speculation:
    """A decode started before its turn was committed (InputSpeculator): ``audio`` is decoded,
    ``speech`` (its part from where speech began) is what a committed turn must hold for the
    decode to be its transcript."""

    audio: bytes = attrs.field(repr=lambda b: f"<{len(b)} bytes>")
    speech: bytes = attrs.field(repr=lambda b: f"<{len(b)} bytes>")
    sample_rate: int
    #: Set to stop the decode (the recogniser checks it between tokens): speech resumed, a
    #: committed turn needs the recogniser, or the session closed.
    cancelled: threading.Event = attrs.field(factory=threading.Event)
    done: bool = False
    words: str | None = None  # what was heard, once done (None: stopped or failed)
    error: str | None = None
    #: The committed turn this decode answers, once claimed (then it is never cancelled).
    job: TranscriptionJob | None = None

    def covers(self, action: TranscribeInput) -> bool:
        """Whether ``action``'s committed audio holds this decode's speech unchanged (the rest
        of it is the quiet before and after: the VAD heard no speech there, or this decode
        would have been discarded)."""
        return action.sample_rate == self.sample_rate and bool(self.speech) and self.speech in action.audio

    def claim(self, job: TranscriptionJob) -> bool:
        """Make this decode ``job``'s answer, if it still can be (not cancelled, and its
        speech is the committed turn's)."""
        if self.cancelled.is_set() or self.job is not None or not self.covers(job.action):
            return False
        self.job = job
        return True

    def cancel(self) -> None:
        if self.job is None:
            self.cancelled.set()


class InputSpeculator:
    """Starts a turn's transcription before the turn is committed (sans-IO: it only calls
    ``start`` and ``discard``).

    Server VAD commits a turn after ``silence_duration_ms`` (500 ms by default) of quiet, but
    the words are all there when the quiet begins. This watches one session's server-VAD
    output (:meth:`heard`: the commands ServerVad returns for each appended chunk, and whether
    any of its VAD frames was speech by the detector's own measure) and, once the user has been
    quiet for ``after_ms`` (100 ms by default: starting sooner takes time off ``completed``'s
    p50, docs/benchmarks.md), calls ``start(prefix, speech)``: ``speech`` is
    the turn's audio from the chunk where speech began to now, ``prefix`` up to ``prefix_ms``
    of the audio before it. The runtime decodes that while the VAD is still waiting; when the turn is
    committed and its audio holds ``speech`` unchanged, that decode is the turn's transcript
    (Runtime.transcribe). Speech again before the commit calls ``discard()``: the decode is
    dropped unseen (or stopped) and the next quiet starts another; so does a new turn.

    The turn's audio kept here is a copy (the session's input buffer holds the same audio), so
    given the client's ``account`` in the runtime's audio budget it counts there while kept;
    :meth:`release` gives it back (the runtime calls it when the session closes, or when a new
    speculator replaces this one).
    """

    __slots__ = (
        "start",
        "discard",
        "wanted",
        "after_bytes",
        "max_bytes",
        "prefix_bytes",
        "_before",
        "_turn",
        "_quiet",
        "_started",
        "_unclaimed",
        "account",
    )

    def __init__(
        self,
        start: Callable[[bytes, bytes], None],
        discard: Callable[[], None],
        *,
        sample_rate: int,
        after_ms: float = 100.0,
        prefix_ms: float = 300.0,
        max_s: float = 20.0,
        wanted: Callable[[], bool] = lambda: True,
        account: AudioAccount | None = None,
    ) -> None:
        self.start = start
        self.account = account
        self.discard = discard
        #: Asked as each turn begins: whether to follow it (the session transcribes). A turn
        #: not followed costs nothing: its audio is not copied.
        self.wanted = wanted
        self.after_bytes = 2 * int(sample_rate * after_ms / 1000)
        #: A turn longer than this is left to the queue (decoded in pieces after its commit),
        #: and its audio is not kept here.
        self.max_bytes = 2 * int(sample_rate * max_s)
        self.prefix_bytes = 2 * int(sample_rate * prefix_ms / 1000)
        self._before = bytearray()  # the latest audio outside a turn, at most prefix_bytes
        self._turn: bytearray | None = None  # the turn's audio since speech began
        self._quiet = 0  # bytes of quiet at the end of the turn so far
        self._started = False  # a decode of this quiet was started (and not discarded)
        self._unclaimed = False  # a decode of the last turn may still wait for its commit

    def heard(self, commands: list[Command], speech: bool) -> None:
        """ServerVad's commands for one chunk, in order; ``speech``: one of its VAD frames
        was speech (a probability at or above the detector's release level), so the quiet,
        if any, is over."""
        for command in commands:
            if isinstance(command, SpeechStartedSignal):
                if self._unclaimed:
                    self.discard()  # the last turn's decode, if its commit never claimed it
                self._forget_turn()
                self._turn = bytearray() if self.wanted() else None
                self._quiet, self._started, self._unclaimed = 0, False, False
            elif isinstance(command, SpeechStoppedSignal):
                # The turn is being committed: its decode (if any) waits for the commit.
                self._forget_turn()
                self._started = False
                self._before.clear()
            elif isinstance(command, AppendAudio):
                self._audio(command.pcm, speech)

    def _audio(self, pcm: bytes, speech: bool) -> None:
        turn = self._turn
        if turn is not None and len(turn) + len(pcm) > self.max_bytes:
            if self._started:
                self._started = self._unclaimed = False
                self.discard()
            self._forget_turn()
            self._before.clear()
            return  # too long to guess: not followed until the next turn
        if turn is None:
            before = self._before
            before += pcm
            if len(before) > self.prefix_bytes:
                del before[: len(before) - self.prefix_bytes]
            return
        turn += pcm
        if self.account is not None:
            self.account.add(len(pcm))
        if speech:
            if self._started:
                self._started = self._unclaimed = False
                self.discard()
            self._quiet = 0
            return
        self._quiet += len(pcm)
        if not self._started and self._quiet >= self.after_bytes:
            self._started = self._unclaimed = True
            self.start(bytes(self._before), bytes(turn))

    def _forget_turn(self) -> None:
        turn, self._turn = self._turn, None
        if turn is not None and self.account is not None:
            self.account.add(-len(turn))

    def release(self) -> None:
        """Give the kept audio back to the account and stop counting (its session closed, or a
        new speculator took over); what follows is followed uncounted."""
        self._forget_turn()
        self.account = None
