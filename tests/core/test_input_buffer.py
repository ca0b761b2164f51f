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
