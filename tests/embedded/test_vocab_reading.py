"""How the thinker reads a text (instructions, typed input): the words its vocabulary knows,
word by word, within a window, never a list of every word of a long text."""

from __future__ import annotations

import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.engines.embedded.vocab import CONTROL_TOKENS, WORDS_READ_PER_ID, default_vocabulary

VOCAB = default_vocabulary()
KNOWN = sorted(w for w in VOCAB.index if w not in CONTROL_TOKENS and w.isalpha())[:40]


def split_reading(text: str, limit: int) -> list[int]:
    """The reading as it was, a whole split of the text: the rule within the window."""
    ids = []
    for raw in text.lower().split():
        word = raw.strip('.,?!;:"()')
        if word in VOCAB.index and word not in CONTROL_TOKENS:
            ids.append(VOCAB.index[word])
            if len(ids) >= limit:
                break
    return ids


words = st.one_of(
    st.sampled_from(KNOWN),
    st.sampled_from(KNOWN).map(str.upper),
    st.sampled_from(KNOWN).map(lambda w: f'"{w}?'),
    st.sampled_from(CONTROL_TOKENS),
    st.text(min_size=1, max_size=6),
)
separators = st.sampled_from([" ", "  ", "\n", "\t", "\u00a0", "\u2003", "\x1c", "\u3000"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(words, separators), max_size=60), st.integers(min_value=1, max_value=20))
def test_within_its_window_the_thinker_reads_what_a_split_of_the_text_gives(pairs, limit):
    text = "".join(w + s for w, s in pairs)
    # Short enough that the window holds every word: the same ids as a split of the whole text.
    assert len(text.split()) <= limit * WORDS_READ_PER_ID
    assert VOCAB.encode_known_words(text, limit) == split_reading(text, limit)


def test_a_long_text_is_read_only_within_its_window_and_never_split_whole():
    limit = 15
    window = limit * WORDS_READ_PER_ID
    unknown = "zzqx " * window
    text = unknown + " ".join(KNOWN[:3]) + " " + "\U0001f600 " * 500_000  # ~4 MiB in memory
    tracemalloc.start()
    try:
        ids = VOCAB.encode_known_words(text, limit)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ids == []  # the known words come after the window: not read
    assert peak < 64 * 1024  # a split would have made a list of a million words (~80 MB)
    # Within the window they are read: two places left in it, two known words read.
    two_left = "zzqx " * (window - 2) + " ".join(KNOWN)
    assert VOCAB.encode_known_words(two_left, limit) == [VOCAB.index[w] for w in KNOWN[:2]]
