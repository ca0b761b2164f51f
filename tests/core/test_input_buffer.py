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


_sizes = st.sampled_from([0, 1, 2, 300, 511, 512, 513, 640, 1500])


@given(st.lists(st.one_of(_sizes.map(lambda n: b"\x01" * n), st.binary(max_size=1500)), max_size=300))
def test_what_the_chunks_add_is_bounded_however_small_the_appends(appends):
    # A client appending one sample at a time (binary frames of 2 bytes) had each kept as its
    # own object: about 58 bytes held for 2 counted, 29 times what the audio budget saw. Small
    # appends are joined, so every chunk but the last is at least SMALL_CHUNK long.
    from duplex_actors.core.input_buffer import SMALL_CHUNK

    buf = InputBuffer()
    for pcm in appends:
        buf += pcm
    chunks = list(buf._chunks or [])  # before bytes(), which joins them
    assert all(len(chunk) >= SMALL_CHUNK for chunk in chunks[:-1])
    assert len(chunks) <= len(buf) // SMALL_CHUNK + 1
    assert b"".join(chunks) == bytes(buf) == b"".join(appends)


def test_a_stream_of_single_samples_holds_little_more_than_its_audio():
    import tracemalloc

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        buf = InputBuffer()
        for _ in range(15_000):
            buf += b"\x01\x00"
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(buf) == 30_000
    assert held < 1.25 * len(buf), held  # kept one object each: about 29 times
