"""The thinker's vocabulary: control tokens, punctuation and a few hundred common English words.

The thinker has random weights, so what it says is word salad; but every token it can emit is
a real, pronounceable word or a punctuation mark, so the talker can speak the output and
phrases end where punctuation falls. Words carry a rough frequency rank (their order here):
the model's output bias starts from a Zipf-like prior over that rank, so common words are
common and a stop or comma turns up every few words.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from itertools import islice

import attrs

# Control tokens first, so their ids are small and stable whatever the word list becomes.
PAD = "<pad>"
BOS = "<bos>"
EOS = "<eos>"
RESPOND = "<respond>"  # the prompt asks for a response (TurnKind.RESPONSE)
UNIT = "<unit>"  # the prompt asks for a listen/speak decision (TurnKind.UNIT)
LISTEN = "<listen>"
SPEAK = "<speak>"
CONTROL_TOKENS = (PAD, BOS, EOS, RESPOND, UNIT, LISTEN, SPEAK)

PUNCTUATION = (".", ",", "?", "!")
#: A word of a text the thinker reads: what ``str.split()`` would give, one at a time.
_WORD = re.compile(r"\S+")
#: Words of a text read for each id wanted (``encode_known_words``); the rest are not read.
WORDS_READ_PER_ID = 64
#: Reading a text's newest words, its last this many characters per word of the window are
#: read (a window of words is found from the end without splitting what comes before it).
CHARS_PER_WORD_READ = 16
#: The newest words are looked for this many characters at a time, from the end.
NEWEST_CHUNK_CHARS = 256
#: Punctuation after which a spoken phrase may end.
PHRASE_END = frozenset(PUNCTUATION)

_WORDS = [
    "the",
    "i",
    "you",
    "it",
    "to",
    "and",
    "a",
    "that",
    "is",
    "of",
    "in",
    "we",
    "what",
    "this",
    "yes",
    "no",
    "so",
    "know",
    "do",
    "well",
    "not",
    "have",
    "be",
    "okay",
    "right",
    "think",
    "on",
    "just",
    "for",
    "with",
    "my",
    "your",
    "can",
    "me",
    "like",
    "but",
    "all",
    "they",
    "there",
    "was",
    "it's",
    "that's",
    "don't",
    "going",
    "get",
    "about",
    "here",
    "now",
    "one",
    "go",
    "how",
    "if",
    "or",
    "are",
    "at",
    "sure",
    "good",
    "yeah",
    "oh",
    "really",
    "see",
    "want",
    "time",
    "people",
    "mean",
    "would",
    "then",
    "out",
    "up",
    "some",
    "could",
    "thing",
    "things",
    "more",
    "say",
    "said",
    "make",
    "when",
    "who",
    "very",
    "much",
    "because",
    "let's",
    "little",
    "also",
    "maybe",
    "lot",
    "thank",
    "thanks",
    "tell",
    "need",
    "where",
    "something",
    "actually",
    "back",
    "way",
    "been",
    "an",
    "as",
    "by",
    "from",
    "would've",
    "work",
    "day",
    "today",
    "tomorrow",
    "will",
    "two",
    "three",
    "first",
    "next",
    "last",
    "new",
    "great",
    "nice",
    "idea",
    "question",
    "answer",
    "sound",
    "sounds",
    "fine",
    "love",
    "help",
    "try",
    "talk",
    "call",
    "week",
    "weather",
    "morning",
    "night",
    "home",
    "place",
    "start",
    "stop",
    "wait",
    "sorry",
    "please",
    "listen",
    "music",
    "play",
    "song",
    "call",
    "later",
    "again",
    "still",
    "always",
    "never",
    "often",
    "sometimes",
    "every",
    "other",
    "same",
    "different",
    "kind",
    "sort",
    "part",
    "point",
    "fact",
    "case",
    "plan",
    "sure",
    "true",
    "false",
    "better",
    "best",
    "bad",
    "worse",
    "quite",
    "pretty",
    "almost",
    "enough",
    "only",
    "even",
    "ever",
    "already",
    "soon",
    "long",
    "short",
    "big",
    "small",
    "old",
    "young",
    "high",
    "low",
    "early",
    "late",
    "hard",
    "easy",
    "simple",
    "clear",
    "open",
    "close",
    "left",
    "give",
    "take",
    "find",
    "keep",
    "put",
    "bring",
    "show",
    "turn",
    "move",
    "run",
    "walk",
    "drive",
    "read",
    "write",
    "learn",
    "hear",
    "feel",
    "seem",
    "look",
    "looks",
    "looking",
    "thought",
    "think",
    "thinking",
    "remember",
    "forget",
    "understand",
    "believe",
    "guess",
    "hope",
    "wish",
    "happen",
    "happened",
    "change",
    "check",
    "set",
    "use",
    "used",
    "using",
    "meet",
    "send",
    "pay",
    "buy",
    "sell",
    "cook",
    "eat",
    "drink",
    "sleep",
    "coffee",
    "tea",
    "water",
    "food",
    "lunch",
    "dinner",
    "breakfast",
    "city",
    "street",
    "road",
    "car",
    "train",
    "bus",
    "trip",
    "travel",
    "family",
    "friend",
    "friends",
    "name",
    "number",
    "hour",
    "minute",
    "minutes",
    "hours",
    "year",
    "years",
    "month",
    "today's",
    "weekend",
    "world",
    "country",
    "story",
    "book",
    "movie",
    "game",
    "team",
    "school",
    "office",
    "room",
    "house",
    "door",
    "window",
    "table",
    "phone",
    "computer",
    "email",
    "message",
    "news",
    "rain",
    "sun",
    "cold",
    "warm",
    "hot",
    "wind",
    "snow",
    "sky",
    "light",
    "dark",
    "color",
    "blue",
    "green",
    "red",
    "white",
    "black",
    "quiet",
    "loud",
    "fast",
    "slow",
    "happy",
    "glad",
    "busy",
    "free",
    "ready",
    "tired",
    "hungry",
    "interesting",
    "fun",
    "funny",
    "strange",
    "important",
    "possible",
    "different",
    "special",
    "perfect",
    "wonderful",
    "beautiful",
    "terrible",
    "around",
    "before",
    "after",
    "during",
    "since",
    "until",
    "while",
    "through",
    "over",
    "under",
    "between",
    "into",
    "across",
    "along",
    "again",
    "anyway",
    "though",
    "although",
    "however",
    "instead",
    "perhaps",
    "probably",
    "certainly",
    "definitely",
    "exactly",
    "usually",
    "especially",
    "together",
    "alone",
    "near",
    "far",
    "away",
    "inside",
    "outside",
    "above",
    "below",
    "behind",
    "ahead",
    "these",
    "those",
    "them",
    "their",
    "our",
    "his",
    "her",
    "its",
    "he",
    "she",
    "us",
    "him",
    "yours",
    "ours",
    "should",
    "must",
    "might",
    "shall",
    "may",
    "did",
    "does",
    "doing",
    "done",
    "made",
    "making",
    "went",
    "gone",
    "came",
    "come",
    "coming",
    "got",
    "has",
    "had",
    "having",
    "says",
    "saying",
    "asked",
    "ask",
    "tells",
    "told",
    "knew",
    "known",
    "gave",
    "given",
    "took",
    "taken",
]


def _dedupe(words: Iterable[str]) -> tuple[str, ...]:
    seen: set[str] = set()
    out = []
    for w in words:
        if w not in seen:
            seen.add(w)
            out.append(w)
    return tuple(out)


WORDS: tuple[str, ...] = _dedupe(_WORDS)


@attrs.frozen(slots=True)
class Vocabulary:
    """Id <-> token mapping plus the ids the scheduler and adapter need by name."""

    tokens: tuple[str, ...]
    index: dict[str, int] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "index", {t: i for i, t in enumerate(self.tokens)})

    def __len__(self) -> int:
        return len(self.tokens)

    def id(self, token: str) -> int:
        return self.index[token]

    @property
    def pad(self) -> int:
        return self.index[PAD]

    @property
    def bos(self) -> int:
        return self.index[BOS]

    @property
    def eos(self) -> int:
        return self.index[EOS]

    @property
    def respond(self) -> int:
        return self.index[RESPOND]

    @property
    def unit(self) -> int:
        return self.index[UNIT]

    @property
    def listen(self) -> int:
        return self.index[LISTEN]

    @property
    def speak(self) -> int:
        return self.index[SPEAK]

    @property
    def control_ids(self) -> frozenset[int]:
        return frozenset(self.index[t] for t in CONTROL_TOKENS)

    @property
    def punctuation_ids(self) -> frozenset[int]:
        return frozenset(self.index[t] for t in PUNCTUATION)

    def encode_known_words(self, text: str, limit: int, *, newest: bool = False) -> list[int]:
        """Ids of the words of ``text`` that the vocabulary knows (instructions, say); the
        rest are dropped because the thinker has no sub-word units to spell them with.
        ``newest``: the last ``limit`` of them (what a user typed last: a question after a
        pasted text), as a text model's prompt keeps the newest words (prompt_window.py);
        otherwise the first.

        Word by word, and only within a window (the first ``limit * WORDS_READ_PER_ID`` words,
        or as many of the last, within ``CHARS_PER_WORD_READ`` characters for each): the thinker reads
        ``limit`` words at most, so the rest of a long text (a response's context may be a
        megabyte) is never split into a list of every word, tens of bytes each, nor searched
        in the engine's thread while every session's turn waits for it."""
        limit = max(limit, 0)
        window = limit * WORDS_READ_PER_ID
        if not newest:
            ids: list[int] = []
            for word in islice(_WORD.finditer(text), window):
                known = self._known(word.group())
                if known is not None:
                    ids.append(known)
                    if len(ids) >= limit:
                        break
            return ids
        return self._newest_known(text, limit, max(0, len(text) - window * CHARS_PER_WORD_READ))

    def _newest_known(self, text: str, limit: int, floor: int) -> list[int]:
        """The last ``limit`` known words of ``text[floor:]`` (a word the floor cuts is not
        read), found from the end a chunk at a time: reading the window forwards cost a few
        milliseconds of the engine's thread a turn for a long text, most of it for words older
        than the ones it keeps."""
        found: list[int] = []  # newest first
        end, size = len(text), NEWEST_CHUNK_CHARS
        unread = limit * WORDS_READ_PER_ID  # and no more words than the first reading reads
        while end > floor and len(found) < limit and unread > 0:
            start = max(floor, end - size)
            words = _WORD.findall(text, start, end)
            if words and start and not text[start - 1].isspace() and not text[start].isspace():
                # The chunk begins inside a word: it is read whole with the next chunk (or not
                # at all, where the window begins inside it).
                if start == floor:
                    words = words[1:]
                    next_end = start
                elif len(words) == 1:
                    size *= 2  # one word longer than the chunk: a longer chunk
                    continue
                else:
                    next_end = start + len(words[0])
                    words = words[1:]
            else:
                next_end = start
            for raw in reversed(words):
                unread -= 1
                if unread < 0:
                    break
                known = self._known(raw)
                if known is not None:
                    found.append(known)
                    if len(found) >= limit:
                        break
            end = next_end
        found.reverse()
        return found

    def _known(self, raw: str) -> int | None:
        """The id of a word as a text has it (any case, punctuation around it), if the
        thinker may read it."""
        word = raw.lower().strip('.,?!;:"()')
        return self.index[word] if word in self.index and word not in CONTROL_TOKENS else None

    def render(self, token_id: int, *, first: bool) -> str:
        """The text a token adds to the running response: words get a leading space except
        at the very start, punctuation attaches to the previous word, control tokens add
        nothing."""
        token = self.tokens[token_id]
        if token in CONTROL_TOKENS:
            return ""
        if token in PHRASE_END:
            return token
        if token == "i":
            token = "I"
        return token if first else " " + token

    def detokenize(self, ids: Sequence[int]) -> str:
        return "".join(self.render(t, first=(n == 0)) for n, t in enumerate(ids))


def default_vocabulary() -> Vocabulary:
    return Vocabulary(CONTROL_TOKENS + PUNCTUATION + WORDS)
