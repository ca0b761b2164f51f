"""Fitting a turn's prompt into a text model's context window, keeping the newest words.

A session keeps up to ``max_conversation_chars`` of words pending for the next response (a
pasted document, a long system message, function outputs). A model's window is usually far
smaller: a 2,048-token model refused every such prompt, and the response ended failed. OpenAI's
Realtime API truncates by default ("auto": the oldest input goes first, the instructions stay),
and so does this: the conversation's oldest items go first (``history``), then the words the
turn brings are cut from their start, until the prompt, with room left for the reply, fits the
window. The instructions are never cut; a prompt whose instructions alone overflow is still the
model's to refuse, as before.

Pure: the prompt builder, the tokenizer's encode and decode are passed in, so the rule is
tested without a model, and with vLLM's own tokenizer where vLLM runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from ..core.engine_io import ModelTurnRequest

#: Room kept for the reply when the turn sets no max_tokens (and never more than half the window).
DEFAULT_REPLY_TOKENS = 256
#: Before tokenizing, words beyond this many characters per token of the window are cut at
#: once: a token is rarely longer, and tokenizing the whole of a 262,144-character turn to
#: keep the last few thousand tokens of it would hold the event loop for nothing.
CHARS_PER_TOKEN_CEILING = 32
#: A cut is measured again after decoding (the join may tokenize differently); a few passes at most.
FIT_PASSES = 4
_REPLACEMENT = "\ufffd"


@attrs.frozen(slots=True)
class FittedPrompt:
    """The prompt the model reads: its text, its token ids, and what was cut to fit."""

    text: str
    token_ids: Sequence[int]
    #: The request the prompt was built from (its ``input_text`` cut when it did not fit).
    request: ModelTurnRequest
    #: Characters left out from the start of the turn's words (0: all of them fit).
    dropped_chars: int = 0
    #: The conversation's oldest items left out (0: all of them fit).
    dropped_items: int = 0


def prompt_budget(window: int, max_tokens: int | None) -> int:
    """The prompt tokens a ``window``-token model may read with room left for its reply."""
    room = max_tokens if max_tokens else DEFAULT_REPLY_TOKENS
    return window - min(room, window // 2)


def fit_prompt(
    request: ModelTurnRequest,
    build: Callable[[ModelTurnRequest], str],
    encode: Callable[[str], Sequence[int]],
    decode: Callable[[Sequence[int]], str],
    budget: int,
) -> FittedPrompt:
    """The prompt ``build`` makes of ``request``, its oldest history items left out, then its
    words cut from the start, until it is at most ``budget`` tokens (or nothing is left to
    cut: the instructions alone may still be longer)."""
    words = request.input_text
    ceiling = budget * CHARS_PER_TOKEN_CEILING
    if len(words) > ceiling:
        request = attrs.evolve(request, input_text=words[-ceiling:])
    history = request.history
    request, dropped_items = _drop_oldest_items(
        request, build, encode, budget, ceiling - len(request.input_text)
    )
    text = build(request)
    ids = encode(text)
    specials = None  # the tokens an encode adds to any text (a BOS): not the words' own
    for _ in range(FIT_PASSES):
        kept = request.input_text
        if len(ids) <= budget or not kept:
            break
        if specials is None:
            specials = len(encode(""))
        word_ids = encode(kept)
        room = len(word_ids) - specials - (len(ids) - budget)
        # A cut inside a character decodes to U+FFFD: the partial character is left out too.
        cut = decode(word_ids[-room:]).lstrip(_REPLACEMENT) if room > 0 else ""
        if len(cut) >= len(kept):  # the decode gave back as much as before: drop a tenth more
            cut = kept[len(kept) // 10 + 1 :]
        request = attrs.evolve(request, input_text=cut)
        text = build(request)
        ids = encode(text)
    return FittedPrompt(
        text, ids, request, len(words) - len(request.input_text), len(history) - len(request.history)
    )


def _drop_oldest_items(
    request: ModelTurnRequest,
    build: Callable[[ModelTurnRequest], str],
    encode: Callable[[str], Sequence[int]],
    budget: int,
    room_chars: int,
) -> tuple[ModelTurnRequest, int]:
    """``request`` with the fewest of its oldest history items left out for its prompt to fit
    ``budget`` (all of them, when even that does not), and how many. Items beyond what
    ``room_chars`` characters hold are left out before any is tokenized."""
    history = request.history
    if not history:
        return request, 0
    first, chars = len(history), 0  # the oldest item that may be kept
    for item in reversed(history):  # newest first: what the characters' room holds
        chars += item.chars
        if chars > max(room_chars, 0):
            break
        first -= 1
    if first == 0 and len(encode(build(request))) <= budget:
        return request, 0
    # The fewest left out that fit: a binary search over how many, each probe one tokenizing.
    low, high = max(first, 1), len(history)
    if len(encode(build(attrs.evolve(request, history=())))) > budget:
        low = high  # even none of them fits: the words are cut next
    while low < high:
        middle = (low + high) // 2
        if len(encode(build(attrs.evolve(request, history=history[middle:])))) <= budget:
            high = middle
        else:
            low = middle + 1
    return attrs.evolve(request, history=history[low:]), low


__all__ = ["CHARS_PER_TOKEN_CEILING", "DEFAULT_REPLY_TOKENS", "FittedPrompt", "fit_prompt", "prompt_budget"]
