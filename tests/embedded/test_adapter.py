"""The three rules of the model adapter contract, one test each (plus the plumbing they need)."""

from __future__ import annotations

import attrs
import pytest

pytest.importorskip("torch")

from duplex_actors.core.engine_io import SamplingOverrides, TurnKind
from duplex_actors.engines.embedded import SamplingParams, ThinkerConfig, WordThinkerAdapter
from duplex_actors.engines.embedded.vocab import default_vocabulary
from duplex_actors.errors import InvalidCommand

from .helpers import request

pytestmark = pytest.mark.embedded


def _adapter(defaults: SamplingParams = SamplingParams()) -> WordThinkerAdapter:
    vocab = default_vocabulary()
    return WordThinkerAdapter(ThinkerConfig(vocab_size=len(vocab)), vocab, defaults)


def test_budget_is_computed_from_the_pcm_and_a_claimed_budget_is_ignored():
    adapter = _adapter()
    one_second = bytes(2 * 16000)
    honest = adapter.audio_budget(one_second, 16000)
    lying = adapter.audio_budget(one_second, 16000, claimed_tokens=10_000)
    # 80 ms per audio token: 1 s of audio is ceil(16000 / 1280) = 13 tokens, whatever is claimed.
    assert honest.tokens == lying.tokens == 13
    assert lying.frames == 13 * 8 and not lying.truncated
    # The prompt really carries that many audio positions.
    prompt = adapter.build_prompt(request("s", audio=one_second), claimed_tokens=1)
    assert prompt.audio_features.shape[0] == 13
    # Longer audio than the model's window is cut to the window, never beyond it.
    long = adapter.audio_budget(bytes(2 * 16000 * 60), 16000, claimed_tokens=5)
    assert long.tokens == adapter.cfg.max_audio_tokens and long.truncated
    with pytest.raises(InvalidCommand):
        adapter.audio_budget(b"\x00\x01\x02", 16000)


def test_decision_comes_from_the_current_unit_snapshot_not_history():
    adapter = _adapter()
    v = adapter.vocab
    speak_unit = [v.speak, v.id("hello") if "hello" in v.index else v.id("yes"), v.id(".")]
    assert adapter.decide(speak_unit) is True
    # After a speaking unit, a fresh unit's snapshot without a decision token is undecided ...
    assert adapter.decide([]) is None
    assert adapter.decide([v.id("yes")]) is None
    # ... and a listen snapshot is listen, whatever the session said before.
    assert adapter.decide([v.listen]) is False
    # Only the snapshot's own first decision counts.
    assert adapter.decide([v.listen, v.speak]) is False


def test_session_sampling_overrides_merge_onto_a_copy_of_the_defaults():
    defaults = SamplingParams(temperature=0.8, top_k=40, max_tokens=48)
    adapter = _adapter(defaults)
    snapshot = attrs.asdict(adapter.defaults)
    adapter.set_session_sampling("sess_hot", SamplingOverrides(temperature=1.3, seed=7))
    hot = adapter.sampling_for("sess_hot")
    hot_short = adapter.sampling_for("sess_hot", SamplingOverrides(max_tokens=5))
    cold = adapter.sampling_for("sess_cold")
    assert (hot.temperature, hot.seed, hot.top_k) == (1.3, 7, 40)
    assert (hot_short.temperature, hot_short.max_tokens) == (1.3, 5)
    assert cold == defaults  # another session sees none of it
    assert attrs.asdict(adapter.defaults) == snapshot and adapter.defaults is defaults
    # Asking past the KV budget is capped, not honoured.
    assert (
        adapter.sampling_for("sess_cold", SamplingOverrides(max_tokens=10_000)).max_tokens
        == adapter.cfg.max_new_tokens
    )
    adapter.forget_session("sess_hot")
    assert adapter.sampling_for("sess_hot") == defaults


def test_unit_prompts_ask_for_a_decision_and_response_prompts_do_not():
    adapter = _adapter()
    unit = adapter.build_prompt(request("s", kind=TurnKind.UNIT, unit=0))
    resp = adapter.build_prompt(request("s"))
    assert unit.decide_first and unit.suffix_ids == (adapter.vocab.unit,)
    assert not resp.decide_first and resp.suffix_ids == (adapter.vocab.respond,)


def test_typed_user_text_reaches_the_prompt_as_words():
    """conversation.item.create text is read like instructions: the words the vocabulary knows."""
    adapter = _adapter()
    vocab = adapter.vocab
    known = [w for w in ("hello", "how", "are", "you") if w in vocab.index]
    assert known, "the test needs words the vocabulary knows"
    plain = adapter.build_prompt(request("s"))
    typed = adapter.build_prompt(attrs.evolve(request("s"), input_text=" ".join(known) + " zzzqx"))
    assert typed.prefix_ids[: len(plain.prefix_ids)] == plain.prefix_ids
    assert typed.prefix_ids[len(plain.prefix_ids) :] == tuple(vocab.index[w] for w in known)


def test_typed_text_longer_than_the_prompt_gives_its_newest_words():
    # A pasted text and a question after it: the thinker reads the question, as a text model's
    # prompt keeps the newest words (engines/prompt_window.py). It read the first words.
    adapter = _adapter()
    vocab = adapter.vocab
    room = adapter.cfg.max_prefix_tokens - 1
    filler, *question = [w for w in ("the", "how", "are", "you", "what", "is", "this") if w in vocab.index][
        :4
    ]
    assert len(question) == 3, "the test needs words the vocabulary knows"
    pasted = " ".join([filler] * 200)
    prompt = adapter.build_prompt(attrs.evolve(request("s"), input_text=f"{pasted} {' '.join(question)}?"))
    words = prompt.prefix_ids[1:]
    assert len(words) == room
    assert words[-3:] == tuple(vocab.index[w] for w in question)
