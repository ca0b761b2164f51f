"""InputBuffer reads exactly like the bytearray it replaced, for the operations the core uses."""

from hypothesis import given
from hypothesis import strategies as st

from duplex_actors.core.audio_budget import AudioBudget
from duplex_actors.core.input_buffer import InputBuffer

chunks = st.lists(st.binary(max_size=64), max_size=20)


@given(chunks, chunks, st.integers(min_value=0, max_value=2000))
def test_same_as_bytearray(first, second, cut):
    buf, ref = InputBuffer(), bytearray()
    for c in first:
        buf += c
        ref += c
    assert len(buf) == len(ref) and bool(buf) == bool(ref) and bytes(buf) == bytes(ref)
    assert buf[:cut] == bytes(ref[:cut])
    del buf[:cut]
    del ref[:cut]
    for c in second:
        buf += c
        ref += c
    assert len(buf) == len(ref) and bytes(buf) == bytes(ref) and bytes(buf) == bytes(ref)


def test_mutable_audio_is_copied_as_it_is_added():
    """A bytearray or memoryview the caller changes afterwards leaves the buffered audio as it
    was when added (bytes, immutable, are kept without a copy)."""
    buf = InputBuffer()
    source = bytearray(b"\x01\x02\x03\x04")
    buf += source
    buf += memoryview(source)[:2]
    source[:] = b"\x00\x00\x00\x00"
    assert bytes(buf) == b"\x01\x02\x03\x04\x01\x02"
    assert len(buf) == 6


_op = st.one_of(
    st.tuples(st.just("add"), st.sampled_from("ab"), st.binary(max_size=64)),
    st.tuples(st.just("drop"), st.sampled_from("ab"), st.integers(0, 200)),
    st.tuples(st.just("keep"), st.sampled_from("ab"), st.integers(0, 100).map(lambda n: n * 2)),
    st.tuples(st.just("move"), st.sampled_from("ab"), st.none()),
    st.tuples(st.just("clear"), st.sampled_from("ab"), st.none()),
)


@given(st.lists(_op, max_size=40))
def test_two_buffers_read_as_bytearrays_and_their_account_counts_exactly_what_they_hold(operations):
    # A session's input and committed buffers, one client's account: a commit moves the input's
    # chunks into the committed buffer (move_into) without copying them.
    budget = AudioBudget(1 << 30)
    account = budget.join("client")
    bufs = {"a": InputBuffer(account), "b": InputBuffer(account)}
    refs = {"a": bytearray(), "b": bytearray()}
    for op, name, arg in operations:
        buf, ref = bufs[name], refs[name]
        other = "b" if name == "a" else "a"
        if op == "add":
            buf += arg
            ref += arg
        elif op == "drop":
            del buf[:arg]
            del ref[:arg]
        elif op == "keep":
            buf.keep_last(arg)
            if len(ref) > arg:
                del ref[: len(ref) - arg]
        elif op == "move":
            buf.move_into(bufs[other])
            refs[other] += ref
            ref.clear()
        else:
            buf.clear()
            ref.clear()
        for key in "ab":
            assert bytes(bufs[key]) == bytes(refs[key]) and len(bufs[key]) == len(refs[key])
        assert account.held == budget.total == len(refs["a"]) + len(refs["b"])
    bufs["a"].detach()
    bufs["b"].detach()
    assert account.held == budget.total == 0
