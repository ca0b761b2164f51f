"""InputBuffer reads exactly like the bytearray it replaced, for the operations the core uses."""

from hypothesis import given
from hypothesis import strategies as st

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
