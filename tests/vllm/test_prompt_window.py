"""Fitting a prompt into a model's window (engines/prompt_window.py), with stand-in tokenizers:
the words a turn brings are cut from their start, the instructions kept, the reply given room.
No vLLM needed; tests/vllm/test_vllm_ga_details.py has the same on vLLM's tokenizer."""

from __future__ import annotations

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.core.conversation import ContentPart, Item
from duplex_actors.core.engine_io import ModelTurnRequest, TurnKind
from duplex_actors.core.fence import Fence
from duplex_actors.engines.prompt_window import (
    CHARS_PER_TOKEN_CEILING,
    DEFAULT_REPLY_TOKENS,
    fit_prompt,
    prompt_budget,
)
from duplex_actors.engines.vllm_engine import describe_turn

BOS = 1_000_000


def byte_encode(text: str) -> list[int]:
    """A byte-level tokenizer with a BOS token, as Llama's: one token per UTF-8 byte."""
    return [BOS, *text.encode()]


def byte_decode(ids) -> str:
    return bytes(i for i in ids if i != BOS).decode(errors="replace")


def word_encode(text: str) -> list[int]:
    """A tokenizer whose tokens are whole words (the count is all a fit reads of them)."""
    return [BOS, *range(len(text.split()))]


def _request(words: str, instructions: str | None = None) -> ModelTurnRequest:
    fence = Fence("sess_window", 0, 0)
    return ModelTurnRequest(
        fence.request_id(), fence, TurnKind.RESPONSE, b"", instructions=instructions, input_text=words
    )


_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=600)


@settings(max_examples=300, deadline=None)
@given(words=_TEXT, instructions=st.none() | st.text(max_size=80), budget=st.integers(8, 400))
def test_a_fitted_prompt_fits_keeps_the_instructions_and_the_newest_words(words, instructions, budget):
    request = _request(words, instructions)
    fitted = fit_prompt(request, describe_turn, byte_encode, byte_decode, budget)
    kept = fitted.request.input_text
    assert fitted.text == describe_turn(fitted.request)
    assert list(fitted.token_ids) == byte_encode(fitted.text)
    assert words.endswith(kept) and fitted.dropped_chars == len(words) - len(kept)
    assert fitted.request.instructions == instructions  # never cut
    if len(byte_encode(describe_turn(request))) <= budget:
        assert fitted.dropped_chars == 0 and fitted.request == request
    elif len(byte_encode(describe_turn(attrs.evolve(request, input_text="")))) <= budget:
        assert len(fitted.token_ids) <= budget
        if kept.strip():
            # Nothing was cut that fitted: short of the budget by at most one character's
            # bytes (a cut inside a character leaves all of it out) and the whitespace the
            # prompt strips from the words' start.
            stripped = len(kept.encode()) - len(kept.lstrip().encode())
            assert len(fitted.token_ids) > budget - 4 - stripped


def test_a_decode_that_cannot_rebuild_the_words_still_converges():
    # Decoding a tail of word_encode's ids gives the whole text back: the cut then drops a
    # share of the characters each pass.
    words = " ".join(f"w{i}" for i in range(2000))
    fitted = fit_prompt(_request(words), describe_turn, word_encode, lambda ids: words, 300)
    assert fitted.dropped_chars > 0 and words.endswith(fitted.request.input_text)


def test_a_turn_far_longer_than_the_window_is_cut_before_it_is_tokenized():
    seen: list[int] = []

    def encode(text: str) -> list[int]:
        seen.append(len(text))
        return byte_encode(text)

    fitted = fit_prompt(_request("a" * 262_144 + " end?"), describe_turn, encode, byte_decode, 200)
    assert max(seen) <= 200 * CHARS_PER_TOKEN_CEILING + 64
    assert fitted.request.input_text.endswith("end?") and len(fitted.token_ids) <= 200


def test_instructions_longer_than_the_window_are_not_cut_and_the_words_go_first():
    fitted = fit_prompt(_request("hello there", "x" * 500), describe_turn, byte_encode, byte_decode, 100)
    assert fitted.request.instructions == "x" * 500 and fitted.request.input_text == ""
    assert len(fitted.token_ids) > 100  # the model refuses it, as before, with its own message


def test_the_reply_gets_its_max_tokens_or_a_default_never_more_than_half_the_window():
    assert prompt_budget(2048, 100) == 1948
    assert prompt_budget(2048, None) == 2048 - DEFAULT_REPLY_TOKENS
    assert prompt_budget(2048, 0) == 2048 - DEFAULT_REPLY_TOKENS
    assert prompt_budget(1024, 4096) == 512


def _said(text: str, role: str = "user") -> Item:
    part = "input_text" if role == "user" else "output_text"
    return Item(id=f"it_{abs(hash((text, role)))}", role=role, content=(ContentPart(type=part, text=text),))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.text(min_size=1, max_size=60), st.sampled_from(["user", "assistant"])), max_size=12
    ),
    st.text(max_size=200),
    st.integers(30, 400),
)
def test_the_oldest_history_goes_first_then_the_words_are_cut(turns, words, budget):
    history = tuple(_said(text, role) for text, role in turns)
    request = attrs.evolve(_request(words), history=history)
    fitted = fit_prompt(request, describe_turn, byte_encode, byte_decode, budget)
    kept = fitted.request.history
    assert history[len(history) - len(kept) :] == kept and fitted.dropped_items == len(history) - len(kept)
    if fitted.dropped_chars:
        assert kept == ()  # words are cut only once no history is left
    if len(byte_encode(describe_turn(attrs.evolve(request, history=(), input_text="")))) <= budget:
        assert len(fitted.token_ids) <= budget
        if fitted.dropped_items and not fitted.dropped_chars:
            # The fewest left out: one more of them kept and it would not fit.
            one_more = attrs.evolve(fitted.request, history=history[len(history) - len(kept) - 1 :])
            assert len(byte_encode(describe_turn(one_more))) > budget


def test_a_long_history_is_cut_by_characters_before_any_of_it_is_tokenized():
    seen: list[int] = []

    def encode(text: str) -> list[int]:
        seen.append(len(text))
        return byte_encode(text)

    history = tuple(_said(f"turn {i} " + "x" * 500) for i in range(500))  # 250,000 characters
    fitted = fit_prompt(
        attrs.evolve(_request("and now?"), history=history), describe_turn, encode, byte_decode, 300
    )
    assert max(seen) <= 300 * CHARS_PER_TOKEN_CEILING + 600
    assert fitted.request.input_text == "and now?" and len(fitted.token_ids) <= 300
    assert fitted.dropped_items >= 499
