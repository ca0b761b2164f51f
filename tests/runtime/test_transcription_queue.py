"""The recogniser's queue (actors/transcription_queue.py): sessions take turns piece by piece,
each session's backlog is bounded, and every turn offered is refused, answered or forgotten
exactly once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.actors.transcription_queue import Heard, TranscriptionJob, TranscriptionQueue
from duplex_actors.core.actions import TranscribeInput
from duplex_actors.core.audio_budget import AudioAccount, AudioBudget

RATE = 16000


def job(session: str, seconds: float, n: int = 0) -> TranscriptionJob:
    audio = b"\x00\x00" * int(RATE * seconds)
    return TranscriptionJob(session, TranscribeInput(f"{session}_{n}", audio, RATE), lambda result: None)


def test_sessions_take_turns_whatever_their_backlogs():
    q = TranscriptionQueue(max_backlog_s=60.0)
    for i in range(5):
        assert q.offer(job("flooder", 1.0, i))
    assert q.offer(job("neighbour", 1.0))
    order = []
    while (piece := q.take()) is not None:
        order.append(piece.job.action.item_id)
        assert q.heard(piece, "words") == Heard(piece.job, "words", "words")  # one piece: at once
    # Neither was served before, so they go in the order they came: the neighbour after one of
    # the flooder's turns, not after all five.
    assert order == ["flooder_0", "neighbour_0", "flooder_1", "flooder_2", "flooder_3", "flooder_4"]


def test_a_tenants_sessions_share_one_tenants_part():
    # Six sessions of one API key, each with a 1 s turn, then a neighbour's: shared by session,
    # the neighbour would wait for all six; shared by tenant first, it waits for one.
    q = TranscriptionQueue(max_backlog_s=60.0)
    for i in range(6):
        flood = job(f"flood{i}", 1.0)
        assert q.offer(TranscriptionJob(flood.session_id, flood.action, flood.deliver, "key:flooder"))
    mine = job("neighbour", 1.0)
    assert q.offer(TranscriptionJob(mine.session_id, mine.action, mine.deliver, "key:neighbour"))
    order = []
    while (piece := q.take()) is not None:
        order.append(piece.job.session_id)
        q.heard(piece, "")
    assert order == ["flood0", "neighbour", "flood1", "flood2", "flood3", "flood4", "flood5"]


def test_a_sessions_backlog_is_bounded_in_seconds_and_frees_as_turns_are_answered():
    q = TranscriptionQueue(max_backlog_s=3.0)
    assert q.offer(job("s", 2.0, 0))
    assert q.offer(job("s", 1.0, 1))
    assert not q.offer(job("s", 0.5, 2))  # 3.5 s would be over
    assert q.offer(job("other", 2.5))  # another session's backlog is its own
    assert q.backlog_s("s") == pytest.approx(3.0)
    taken = q.take()
    assert q.backlog_s("s") == pytest.approx(3.0)  # being transcribed still counts
    q.heard(taken, "")
    assert q.backlog_s("s") == pytest.approx(1.0)
    assert q.offer(job("s", 2.0, 3))
    # A single long turn is taken when nothing of its session waits: the bound is on piling up.
    assert q.offer(job("long", 10.0))
    assert not q.offer(job("long", 0.1, 1))


def test_a_closed_sessions_turns_are_forgotten():
    q = TranscriptionQueue(max_backlog_s=10.0)
    for i in range(3):
        q.offer(job("gone", 1.0, i))
    q.offer(job("here", 1.0))
    assert q.forget("gone") == 3
    assert q.backlog_s("gone") == 0.0
    assert q.take().job.session_id == "here" and q.take() is None
    with pytest.raises(ValueError):
        TranscriptionQueue(max_backlog_s=0.0)


def speech_with_pauses(seconds: float) -> bytes:
    """Loud 0.9 s stretches with 0.1 s of quiet between them (the pauses a cut should find)."""
    word = (b"\x00\x30" * int(RATE * 0.9)) + (b"\x00\x00" * int(RATE * 0.1))
    whole = word * (int(seconds) + 1)
    return whole[: 2 * int(RATE * seconds)]


def long_job(session: str, seconds: float, n: int = 0) -> TranscriptionJob:
    audio = speech_with_pauses(seconds)
    return TranscriptionJob(session, TranscribeInput(f"{session}_{n}", audio, RATE), lambda result: None)


def test_a_long_turn_is_decoded_in_pieces_cut_at_pauses_and_a_neighbour_waits_for_one_piece():
    q = TranscriptionQueue(max_backlog_s=60.0, max_piece_s=4.0)
    turn = long_job("talker", 20.0)
    assert q.offer(turn)
    first = q.take()  # being decoded when the neighbour commits
    assert q.offer(job("neighbour", 1.0))
    second = q.take()
    # Right after the piece in progress, not after all 20 s of the long turn.
    assert second.job.session_id == "neighbour"
    pieces = [first]
    while (piece := q.take()) is not None:
        pieces.append(piece)
    assert b"".join(p.audio for p in pieces) == turn.action.audio  # nothing lost, nothing twice
    assert len(pieces) >= 5 and all(p.seconds <= 4.0 for p in pieces)
    for p in pieces[:-1]:  # each cut is in a pause, not through a "word"
        assert p.audio[-2:] == b"\x00\x00"
    # Heard out of order (two workers), answered once, its words in the turn's order.
    assert q.heard(second, "hi") == Heard(second.job, "hi", "hi")
    for p in reversed(pieces[1:]):  # nothing can be said before the first piece's words
        assert q.heard(p, "" if p.index == 2 else f"w{p.index}") is None
    words = " ".join(f"w{i}" for i in range(len(pieces)) if i != 2)
    assert q.heard(first, "w0") == Heard(turn, words, words)
    assert q.backlog_s("talker") == 0.0 and q.backlog_s("neighbour") == 0.0


def test_a_failed_piece_fails_its_turn_once_and_its_other_pieces_are_not_decoded():
    q = TranscriptionQueue(max_backlog_s=60.0, max_piece_s=4.0)
    turn = long_job("talker", 20.0)
    q.offer(turn)
    a, b = q.take(), q.take()
    assert q.failed(b) is turn
    assert q.take() is None  # the rest of the turn is dropped, not decoded for nothing
    assert q.heard(a, "words") is None  # answered already: once
    assert q.failed(a) is None
    assert q.backlog_s("talker") == 0.0


def test_a_forgotten_turns_piece_in_flight_is_not_answered():
    q = TranscriptionQueue(max_backlog_s=60.0, max_piece_s=4.0)
    q.offer(long_job("gone", 10.0))
    piece = q.take()
    assert q.forget("gone") == 1
    assert q.take() is None
    assert q.heard(piece, "words") is None
    assert q.backlog_s("gone") == 0.0


@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("offer"), st.sampled_from("abc"), st.floats(0.05, 9.0)),
            st.tuples(st.just("take"), st.none(), st.none()),
            st.tuples(st.just("hear"), st.booleans(), st.integers(0, 3)),
            st.tuples(st.just("forget"), st.sampled_from("abc"), st.none()),
        ),
        max_size=80,
    ),
    bound=st.floats(1.0, 12.0),
    piece_s=st.floats(0.5, 4.0),
)
def test_every_turn_is_refused_answered_or_forgotten_once_and_no_waiting_session_is_skipped(
    ops, bound, piece_s
):
    q = TranscriptionQueue(max_backlog_s=bound, max_piece_s=piece_s)
    accepted = answered = forgotten = n = 0
    # Our own count of each session's turns with pieces to hand out, and an epoch that moves
    # each time a session stops waiting: (session, epoch) names one unbroken stretch of waiting.
    waiting_turns: dict[str, list[TranscriptionJob]] = {s: [] for s in "abc"}
    epoch = {s: 0 for s in "abc"}
    takes: list[tuple[str, set[tuple[str, int]]]] = []  # who was served, and who was waiting
    in_flight: list = []
    handed: dict[str, list] = {}  # item id -> its pieces, in the order handed out
    deltas: dict[str, list[str]] = {}  # item id -> the deltas said so far
    outcome: dict[str, str] = {}  # item id -> "answered" / "forgotten"

    def waiting() -> set[tuple[str, int]]:
        return {(f"{s}#{lives[s]}", epoch[s]) for s in "abc" if waiting_turns[s]}

    def take_one() -> bool:
        before = waiting()
        piece = q.take()
        if piece is None:
            assert not before and len(q) == 0
            return False
        sid, item = piece.job.session_id, piece.job.action.item_id
        assert piece.seconds <= piece_s + 1e-9 and piece.audio
        takes.append((f"{sid}#{lives[sid]}", before))
        last_served[sid] = len(takes)
        handed.setdefault(item, []).append(piece)
        if b"".join(p.audio for p in handed[item]) == piece.job.action.audio:
            waiting_turns[sid].remove(piece.job)
            if not waiting_turns[sid]:
                epoch[sid] += 1
        in_flight.append(piece)
        return True

    def hear(ok: bool, which: int) -> None:
        nonlocal answered
        piece = in_flight.pop(which % len(in_flight))
        item = piece.job.action.item_id
        words = "" if piece.index % 3 == 1 else f"{item}:{piece.index}"  # some pieces say nothing
        result = q.heard(piece, words) if ok else q.failed(piece)
        if result is None:
            return
        job_ = result.job if ok else result
        assert job_ is piece.job and item not in outcome  # nothing after the answer
        if ok:
            assert result.delta or result.final  # an empty delta alone is not sent
            deltas.setdefault(item, []).append(result.delta)
            if not result.final:
                return
            # Every piece's words, in the turn's order, and the deltas add up to them.
            expected = " ".join(f"{item}:{i}" for i in range(len(handed[item])) if i % 3 != 1)
            assert result.transcript == "".join(deltas[item]) == expected
            assert b"".join(p.audio for p in handed[item]) == piece.job.action.audio
        outcome[item] = "answered"
        answered += 1
        sid = piece.job.session_id
        if not ok and piece.job in waiting_turns[sid]:  # its pieces not handed out are dropped
            waiting_turns[sid].remove(piece.job)
            if not waiting_turns[sid]:
                epoch[sid] += 1

    # A session that was idle when it offered goes first when it was served less recently
    # than every session waiting (never served: -1).
    served_next: str | None = None
    last_served = {s: -1 for s in "abc"}
    lives = {s: 0 for s in "abc"}

    for op, arg, value in ops:
        if op == "offer":
            n += 1
            backlog_before = q.backlog_s(arg)
            new = job(arg, value, n)
            served_next = None
            if q.offer(new):
                accepted += 1
                waiting_turns[arg].append(new)
                others = [last_served[w] for w in "abc" if w != arg and waiting_turns[w]]
                if (
                    backlog_before == 0.0
                    and len(waiting_turns[arg]) == 1
                    and all(last_served[arg] < t for t in others)
                ):
                    served_next = arg
                # Only a session with nothing waiting may go past the bound (one long turn).
                assert backlog_before == 0.0 or q.backlog_s(arg) <= bound + 1e-9
            else:
                assert backlog_before + value > bound
        elif op == "take":
            if take_one() and served_next is not None:
                assert takes[-1][0] == f"{served_next}#{lives[served_next]}"
            served_next = None
        elif op == "hear":
            if in_flight:
                hear(arg, value)
        else:
            served_next = None if served_next == arg else served_next
            # last_served[arg] stays: a session named for no tenant is a tenant of its own,
            # keyed by its id, and FairShare remembers a tenant's place past its flows (so
            # that ending flows and starting new ones never jumps the line). The model reset
            # it here, and expected the next session of the same id to go first.
            dropped = q.forget(arg)
            assert dropped == len(waiting_turns[arg])
            for gone in waiting_turns[arg]:
                assert gone.action.item_id not in outcome
                outcome[gone.action.item_id] = "forgotten"
            forgotten += dropped
            waiting_turns[arg] = []
            epoch[arg] += 1
            lives[arg] += 1  # a closed session's id never comes back: a later one is another
        assert len(q) == sum(len(t) for t in waiting_turns.values())
    while take_one() or in_flight:
        if in_flight:
            hear(True, 0)
    assert accepted == answered + forgotten == len(outcome)
    assert len(q) == 0 and all(q.backlog_s(s) == 0.0 for s in "abc")
    # Round robin by piece: between two pieces of one session, every other session that waited
    # all along was served.
    for i, (served, waiting_i) in enumerate(takes):
        nxt = next((k for k in range(i + 1, len(takes)) if takes[k][0] == served), None)
        if nxt is None:
            continue
        between = {takes[k][0] for k in range(i + 1, nxt)}
        for other in waiting_i & takes[nxt][1]:
            if other[0] != served:
                assert other[0] in between, (served, other, takes)


# -- the audio budget -------------------------------------------------------------------------


def counted(job_: TranscriptionJob, account: AudioAccount) -> TranscriptionJob:
    return TranscriptionJob(job_.session_id, job_.action, job_.deliver, job_.tenant, account)


def test_a_waiting_turns_audio_counts_in_its_clients_account_until_it_is_answered():
    budget = AudioBudget(2 * RATE * 30)  # 30 s of audio
    mine, theirs = budget.join("mine"), budget.join("theirs")
    q = TranscriptionQueue(max_backlog_s=60.0, max_piece_s=4.0)
    turn = counted(long_job("talker", 10.0), mine)
    assert q.offer(turn)
    assert budget.total == mine.held == 2 * RATE * 10
    pieces = [q.take() for _ in range(3)]
    for piece in pieces:  # handed out and heard, but the turn is not answered yet
        assert not q.heard(piece, "w").final
    assert mine.held == 2 * RATE * 10  # the turn's audio is held until its last piece is heard
    while (piece := q.take()) is not None:
        q.heard(piece, "w")
    assert mine.held == budget.total == 0
    # A failed turn and a forgotten one give theirs back too.
    failing = counted(long_job("talker", 6.0, 1), mine)
    gone = counted(job("other", 2.0), theirs)
    assert q.offer(failing)
    first = q.take()
    assert q.offer(gone)
    assert budget.total == 2 * RATE * 8
    assert q.failed(first) is failing
    assert mine.held == 0 and theirs.held == 2 * RATE * 2
    assert q.forget("other") == 1
    assert budget.total == theirs.held == 0


def test_a_client_over_its_share_of_a_full_budget_has_its_turn_refused_and_nothing_changes():
    budget = AudioBudget(2 * RATE * 10)  # 10 s: 5 s a client while two hold audio
    greedy, modest = budget.join("greedy"), budget.join("modest")
    greedy.add(2 * RATE * 6)  # its buffers hold 6 s: over its share
    q = TranscriptionQueue(max_backlog_s=60.0)
    assert q.offer(counted(job("g", 3.0), greedy))  # the total stays within the budget: taken
    refused = counted(job("g2", 2.0), greedy)
    why = q.refusal(refused)
    assert why is not None and "audio budget" in why and "share" in why
    assert not q.offer(refused)
    assert greedy.held == 2 * RATE * 9 and len(q) == 1 and q.backlog_s("g2") == 0.0
    # The other client is within its share: taken, though the total passes the budget.
    assert q.offer(counted(job("m", 4.0), modest))
    assert budget.total == 2 * RATE * 13
    # The backlog's own bound is said first, in its own words.
    full = TranscriptionQueue(max_backlog_s=1.0)
    assert full.offer(counted(job("b", 1.0), modest))
    assert "backlog full" in str(full.refusal(counted(job("b", 0.5, 1), modest)))


@settings(max_examples=150)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("offer"), st.sampled_from("abc"), st.floats(0.05, 6.0)),
            st.tuples(st.just("take"), st.none(), st.none()),
            st.tuples(st.just("hear"), st.booleans(), st.integers(0, 3)),
            st.tuples(st.just("forget"), st.sampled_from("abc"), st.none()),
        ),
        max_size=60,
    ),
    budget_s=st.floats(1.0, 20.0),
)
def test_the_budget_counts_exactly_the_turns_neither_answered_nor_forgotten(ops, budget_s):
    # Sessions a and b are one client's, c another's.
    budget = AudioBudget(int(2 * RATE * budget_s))
    accounts = {"x": budget.join("x"), "y": budget.join("y")}
    client = {"a": "x", "b": "x", "c": "y"}
    q = TranscriptionQueue(max_backlog_s=8.0, max_piece_s=2.0)
    live: dict[str, TranscriptionJob] = {}  # item id -> a turn still counted
    waiting: dict[str, list[str]] = {s: [] for s in "abc"}  # turns with pieces to hand out
    in_flight: list = []
    n = 0
    for op, arg, value in ops:
        if op == "offer":
            n += 1
            account = accounts[client[arg]]
            new = counted(long_job(arg, value, n), account)
            total, held = budget.total, account.held
            over = not budget.allows(account, len(new.action.audio))
            accepted = q.offer(new)
            if accepted:
                assert not over
                live[new.action.item_id] = new
                waiting[arg].append(new.action.item_id)
            else:
                assert budget.total == total and account.held == held  # a refusal takes nothing
        elif op == "take":
            piece = q.take()
            if piece is not None:
                in_flight.append(piece)
                item = piece.job.action.item_id
                if piece.turn.whole:
                    waiting[piece.job.session_id].remove(item)
        elif op == "hear" and in_flight:
            piece = in_flight.pop(value % len(in_flight))
            item = piece.job.action.item_id
            if arg:
                heard = q.heard(piece, "w")
                if heard is not None and heard.final:
                    del live[item]
            else:
                if q.failed(piece) is not None:
                    del live[item]
                    sid = piece.job.session_id
                    if item in waiting[sid]:
                        waiting[sid].remove(item)
        elif op == "forget":
            assert q.forget(arg) == len(waiting[arg])
            for item in waiting[arg]:
                del live[item]
            waiting[arg] = []
        for name, account in accounts.items():
            assert account.held == sum(
                len(j.action.audio) for j in live.values() if client[j.session_id] == name
            )
        assert budget.total == sum(a.held for a in accounts.values())
    while (piece := q.take()) is not None or in_flight:
        if piece is not None:
            in_flight.append(piece)
        q.heard(in_flight.pop(), "w")
    assert budget.total == 0
