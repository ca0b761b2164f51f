"""A tiny, randomly initialised Llama built on this machine, for testing engine backends.

Nothing here downloads anything. The tokenizer is a byte-level BPE trained with the
``tokenizers`` library on the short English text below; the model is a ``LlamaForCausalLM``
with seeded random weights. It produces fluent-looking *tokens*, not language: it exists so
that vLLM (or any Hugging Face-format loader) has a real checkpoint to load, batch and stream.

The shapes respect vLLM's CPU attention kernels, which only accept some head sizes
(32, 64, 80, ...): 16 is refused, so the default is two heads of 32.

Usage::

    python -m duplex_actors.engines.tiny_llama /path/to/folder

Needs ``transformers``, ``tokenizers`` and ``torch`` (all three come with vLLM).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = structlog.get_logger(__name__)

# A few paragraphs of plain English about talking, so the learnt merges look like words.
# The text is repeated with small variations by _training_corpus() to give BPE enough pairs.
_CORPUS = """\
A conversation is a shared piece of work. One person speaks, the other listens, and then
they trade places, often before the first has quite finished. People do this without
thinking: they hear the end of a sentence coming, they nod, they say "mm-hm" or "right",
and they start their own reply a fraction of a second after the other voice stops.
A speech system that wants to feel natural has to do the same. It must listen while it
talks, notice when the user starts speaking over it, and stop at once when that happens.
It should not stop for a short laugh or a quiet "yes", because those are signs of
attention, not requests to take the floor. Timing matters more than words here: a reply
that arrives half a second late feels slow, and one that arrives two seconds late feels
broken. The numbers people remember are the time to the first word, the time to the first
sound, and how quickly the machine falls silent when interrupted.
Good systems keep a ledger of what was generated, what was sent, and what was actually
played, so that the history of the conversation only holds what the listener heard.
They count turns, they fence old work away from new work, and they never let a late
answer from a cancelled question leak into the next one. The weather was mild that
morning; the train left the station on time, and the children walked to school along the
river, talking about numbers, colours, animals, music and the names of distant cities.
Hello, how are you today? I am fine, thank you. What would you like to talk about? Tell me
a story about a small robot who learned to listen before it learned to speak.
"""

_TOKENIZER_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")


_SYLLABLES = [
    "ba",
    "be",
    "bi",
    "bo",
    "da",
    "de",
    "di",
    "do",
    "fa",
    "fe",
    "fi",
    "ga",
    "go",
    "ka",
    "ke",
    "ki",
    "ko",
    "la",
    "le",
    "li",
    "lo",
    "lu",
    "ma",
    "me",
    "mi",
    "mo",
    "mu",
    "na",
    "ne",
    "ni",
    "no",
    "pa",
    "pe",
    "pi",
    "po",
    "ra",
    "re",
    "ri",
    "ro",
    "ru",
    "sa",
    "se",
    "si",
    "so",
    "ta",
    "te",
    "ti",
    "to",
    "va",
    "ve",
    "vi",
    "wa",
    "we",
    "wi",
    "ya",
    "yo",
    "za",
    "ber",
    "con",
    "dis",
    "ent",
    "ing",
    "ion",
    "ly",
    "ment",
    "ous",
    "pre",
    "pro",
    "ter",
    "tion",
    "un",
    "ver",
]


def _training_corpus(repeats: int = 40, pseudo_words: int = 6000) -> list[str]:
    """The built-in text, reshuffled, plus seeded English-like pseudo-words.

    The text alone has too few distinct words to fill a ~2k vocabulary; pronounceable
    syllable combinations give BPE more pairs to merge without any external data.
    """
    import random

    rng = random.Random(1234)
    sentences = [s.strip() for s in _CORPUS.replace("\n", " ").split(".") if s.strip()]
    lines = []
    for _ in range(repeats):
        rng.shuffle(sentences)
        lines.append(". ".join(sentences) + ".")
    words = ["".join(rng.choices(_SYLLABLES, k=rng.randint(2, 4))) for _ in range(pseudo_words)]
    lines.extend(" ".join(words[i : i + 12]) for i in range(0, len(words), 12))
    return lines


def train_tokenizer(vocab_size: int = 2048) -> Tokenizer:
    """Train a byte-level BPE tokenizer on the built-in text; returns a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_TOKENIZER_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    return tok


def build_tiny_llama(
    path: str | Path,
    *,
    vocab_size: int = 2048,
    hidden_size: int = 64,
    head_dim: int = 32,
    num_layers: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> Path:
    """Write a random Llama checkpoint and its tokenizer to ``path``; returns the folder.

    ``vocab_size`` is an upper bound: the model's vocabulary is exactly the tokenizer's, so
    every id the model can sample decodes. Idempotent: an existing complete folder is reused.
    """
    if head_dim < 32:
        raise ValueError(f"head_dim={head_dim}: vLLM's CPU attention needs head sizes >= 32")
    if hidden_size % head_dim:
        raise ValueError(f"hidden_size={hidden_size} is not a multiple of head_dim={head_dim}")
    folder = Path(path)
    marker = folder / "tiny_llama.json"
    if marker.exists() and (folder / "config.json").exists():
        log.info("tiny_llama.reused", path=str(folder))
        return folder

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    started = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    raw = train_tokenizer(vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tokenizer.model_max_length = max_position_embeddings
    tokenizer.save_pretrained(folder)

    n_vocab = raw.get_vocab_size()
    heads = hidden_size // head_dim
    config = LlamaConfig(
        vocab_size=n_vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    marker.write_text(
        json.dumps(
            {
                "what": "random-weight Llama for tests; not a language model",
                "seed": seed,
                "vocab_size": n_vocab,
                "hidden_size": hidden_size,
                "head_dim": head_dim,
                "num_layers": num_layers,
                "parameters": n_params,
            },
            indent=2,
        )
    )
    log.info(
        "tiny_llama.built",
        path=str(folder),
        vocab=n_vocab,
        parameters=n_params,
        seconds=round(time.perf_counter() - started, 2),
    )
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="folder to write (reused if already complete)")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    folder = build_tiny_llama(args.path, vocab_size=args.vocab_size, seed=args.seed)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
