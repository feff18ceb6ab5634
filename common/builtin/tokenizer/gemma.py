"""The Gemma-style tokenizer of the built-in models with a Gemma text encoder: ``GemmaTokenizer`` (Gemma's
special tokens, byte fallback, a BOS token first), its BPE merges learnt here from the corpus
(:mod:`common.builtin.tokenizer.corpus`) plus any text the family's pipeline always puts before a prompt, so
that such a text takes a few hundred tokens, as with Gemma's vocabulary."""

from __future__ import annotations

import string
from collections import Counter
from typing import TYPE_CHECKING

from common.builtin.tokenizer.bpe import learn_merges
from common.builtin.tokenizer.corpus import corpus

if TYPE_CHECKING:
    from transformers import GemmaTokenizer

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")  # ids 0..4, as Gemma's
NUM_MERGES = 400
MODEL_MAX_LENGTH = 8192


def words_of(lines: list[str]) -> Counter[tuple[str, ...]]:
    """The words of ``lines`` as their characters, each after the first of a line marked by a leading \u2581
    (as SentencePiece's), with their counts."""
    return Counter(tuple(w) for line in lines for w in line.replace(" ", " \u2581").split(" ") if w)


def gemma_tokenizer(extra_lines: tuple[str, ...] | list[str] = ()) -> GemmaTokenizer:
    """The tokenizer (``AutoTokenizer.from_pretrained`` reloads it as ``GemmaTokenizer``): the special tokens,
    the 256 byte tokens, the corpus' characters, then the merges learnt from the corpus and ``extra_lines``."""
    from transformers import GemmaTokenizer

    merges = learn_merges(words_of(corpus() + list(extra_lines)), NUM_MERGES)
    chars = sorted(set("\u2581\n" + string.ascii_letters + string.digits + string.punctuation))
    vocab = {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + [f"<0x{b:02X}>" for b in range(256)] + chars)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, model_max_length=MODEL_MAX_LENGTH)
