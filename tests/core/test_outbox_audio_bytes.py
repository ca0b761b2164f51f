"""The outbox's ``audio_bytes`` is the pcm of the audio deltas it holds, queued and held, after
every operation: the session's shell makes the engine wait on it (actors/session_actor.py), so
a count that drifts low lets a response run ahead of a client that is away, and one that drifts
high stalls a response whose client has taken everything."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.core import events as ev
from duplex_actors.core.outbox import Outbox

RESPONSES = ("resp_a", "resp_b")


def _audio(response_id: str, size: int) -> ev.AudioDeltaEvent:
    return ev.AudioDeltaEvent(seq=0, epoch=0, session_id="s", response_id=response_id, pcm=bytes(size))


def _transcript(response_id: str) -> ev.TranscriptDeltaEvent:
    return ev.TranscriptDeltaEvent(seq=0, epoch=0, session_id="s", response_id=response_id, delta="w ")


def _done(response_id: str) -> ev.ResponseDone:
    return ev.ResponseDone(
        seq=0, epoch=0, session_id="s", response_id=response_id, status="completed", turn_id=1
    )


def _error() -> ev.ErrorEvent:
    return ev.ErrorEvent(seq=0, epoch=0, session_id="s", code="invalid_json", message="bad")


def _pcm_held(box: Outbox) -> int:
    """What the outbox holds of audio, read from its queues (what the counter must equal)."""
    return sum(len(e.pcm) for e in (*box._q, *box._held) if isinstance(e, ev.AudioDeltaEvent))


audio = st.tuples(st.just("audio"), st.sampled_from(RESPONSES), st.integers(0, 5000))
operations = st.one_of(
    audio,
    audio,  # twice: most of what an outbox holds is audio
    st.tuples(st.just("transcript"), st.sampled_from(RESPONSES)),
    st.tuples(st.just("done"), st.sampled_from(RESPONSES)),
    st.tuples(st.just("error")),
    st.tuples(st.just("hold"), st.sampled_from(RESPONSES), st.booleans()),
    st.tuples(st.just("release")),
    st.tuples(st.just("purge"), st.sampled_from(RESPONSES)),
    st.tuples(st.just("take"), st.none() | st.integers(0, 6)),
    st.tuples(st.just("popleft")),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(operations, min_size=8, max_size=120), st.integers(4, 12))
def test_audio_bytes_is_the_pcm_held_after_every_operation(ops, capacity):
    # A small capacity makes pushes past it happen: refused deltas, and terminals that drop the
    # oldest delta to fit past the reserve.
    box = Outbox(capacity=capacity, reserve=2)
    taken = 0
    for op in ops:
        kind = op[0]
        if kind == "audio":
            box.push(_audio(op[1], op[2]))
        elif kind == "transcript":
            box.push(_transcript(op[1]))
        elif kind == "done":
            box.push(_done(op[1]))
        elif kind == "error":
            box.push(_error())
        elif kind == "hold":
            box.hold(op[1], text=op[2])
        elif kind == "release":
            box.release()
        elif kind == "purge":
            box.purge_audio(op[1])
        elif kind == "take":
            taken += len(box.take(op[1]))
        elif kind == "popleft" and box:
            box.popleft()
            taken += 1
        assert box.audio_bytes == _pcm_held(box), (op, taken)
        assert box.audio_bytes >= 0


def test_a_take_of_everything_leaves_the_held_audio_counted():
    box = Outbox(capacity=64, reserve=2)
    box.push(_audio("resp_a", 100))
    box.hold("resp_a")
    box.push(_audio("resp_a", 30))  # held: the user is talking over resp_a
    assert box.audio_bytes == 130
    assert len(box.take()) == 1  # the first delta went; the held one stays
    assert box.audio_bytes == 30
    box.release()
    assert box.audio_bytes == 30 and len(box.take()) == 1 and box.audio_bytes == 0


def test_a_terminal_past_the_reserve_drops_the_oldest_delta_and_its_audio_with_it():
    box = Outbox(capacity=4, reserve=2)
    assert box.push(_audio("resp_a", 100)) and box.push(_audio("resp_a", 50))
    assert not box.push(_audio("resp_a", 7))  # past capacity - reserve: refused, not counted
    assert box.push(_done("resp_a")) and box.push(_done("resp_b"))  # the reserve
    assert box.audio_bytes == 150
    assert box.push(_done("resp_c"))  # no room left: the oldest delta goes
    assert box.audio_bytes == 50 == _pcm_held(box)
