"""How the thinker reads a text (instructions, typed input): the words its vocabulary knows,
word by word, within a window, never a list of every word of a long text."""

from __future__ import annotations

import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.engines.embedded.vocab import (
    CHARS_PER_WORD_READ,
    CONTROL_TOKENS,
    WORDS_READ_PER_ID,
    default_vocabulary,
)

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


def newest_split_reading(text: str, limit: int) -> list[int]:
    """The last ``limit`` known words of a whole split of the text."""
    return split_reading(text, 10**9)[-limit:] if limit else []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(words, separators), max_size=60), st.integers(min_value=0, max_value=20))
def test_within_its_window_the_newest_reading_is_the_last_known_words_a_split_gives(pairs, limit):
    # What a user typed last (a question after a pasted text) is what the thinker reads, as a
    # text model's prompt keeps the newest words (engines/prompt_window.py).
    text = "".join(w + s for w, s in pairs)
    if len(text) <= limit * WORDS_READ_PER_ID * CHARS_PER_WORD_READ:
        assert VOCAB.encode_known_words(text, limit, newest=True) == newest_split_reading(text, limit)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(words, separators), max_size=40), st.integers(0, 3), st.integers(1, 3))
def test_the_newest_reading_of_a_long_text_does_not_read_the_word_its_window_cuts(pairs, cut, limit):
    # The window of characters begins inside "there" (its last letters "here", or "ere"...):
    # that word is not read, though its tail may be a word the vocabulary knows.
    tail = " " + "".join(w + s for w, s in pairs)
    window = limit * WORDS_READ_PER_ID * CHARS_PER_WORD_READ
    cut_into = "there"[cut + 1 :]  # what of "there" the window holds: "here", "ere", "re" or "e"
    after = tail + " " * (window - len(cut_into) - len(tail))  # spaces read as nothing
    text = "zzqx " * 3 + "there" + after
    assert text[-window:] == cut_into + after
    ids = VOCAB.encode_known_words(text, limit, newest=True)
    assert ids == newest_split_reading(tail, limit)
    # A window that begins where "there" begins reads it whole.
    whole = "zzqx there" + tail + " " * (window - len("there") - len(tail))
    assert whole[-window:].startswith("there ")
    assert VOCAB.encode_known_words(whole, limit, newest=True) == newest_split_reading("there" + tail, limit)


def test_a_long_texts_newest_words_are_read_and_its_start_is_never_split():
    limit = 15
    known = " ".join(KNOWN[:3])
    text = known + " " + "\U0001f600 " * 500_000 + "zzqx " * 10 + known  # ~4 MiB in memory
    tracemalloc.start()
    try:
        ids = VOCAB.encode_known_words(text, limit, newest=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ids == [VOCAB.index[w] for w in KNOWN[:3]]  # the ones at the end, once
    assert peak < 64 * 1024


def test_the_newest_reading_reads_no_more_words_than_the_first_reading_does():
    limit = 2
    unknown = "zzqx " * (limit * WORDS_READ_PER_ID)  # a whole window's words, none known
    assert VOCAB.encode_known_words(" ".join(KNOWN[:2]) + " " + unknown, limit, newest=True) == []
    one_less = "zzqx " * (limit * WORDS_READ_PER_ID - 1)
    assert VOCAB.encode_known_words(" ".join(KNOWN[:2]) + " " + one_less, limit, newest=True) == [
        VOCAB.index[KNOWN[1]]
    ]
