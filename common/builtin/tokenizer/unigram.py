"""The T5 / UMT5 tokenizer of the built-ins (Wan's UMT5, SD3's and FLUX's T5): a T5-style unigram tokenizer
estimated here, deterministically, on the corpus of :mod:`common.builtin.tokenizer.corpus`."""

from __future__ import annotations

import math
import string
from collections import Counter
from typing import TYPE_CHECKING

from common.builtin.tokenizer.corpus import corpus

if TYPE_CHECKING:
    from transformers import T5Tokenizer

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2 as in T5
_MAX_PIECE_LEN = 8
# Every printable ASCII character is a piece, so English prompts never
# collapse to <unk> and different prompts give different ids.
ALPHABET = sorted(set("\u2581" + string.ascii_letters + string.digits + string.punctuation))
# A vocabulary must be larger than this: the special tokens and the alphabet come first.
FIXED_TOKENS = len(SPECIAL_TOKENS) + len(ALPHABET)


def unigram_vocab(lines: list[str], vocab_size: int) -> list[tuple[str, float]]:
    """Estimate a SentencePiece-style unigram vocabulary from corpus counts.

    The ``tokenizers`` UnigramTrainer is not reproducible across processes
    (hash-map iteration order breaks ties differently), so pieces are chosen
    here deterministically: the alphabet plus the substrings of
    ``\u2581``-prefixed words covering the most text, scored by log frequency.
    """
    words = Counter("\u2581" + w for line in lines for w in line.split())
    counts: Counter[str] = Counter()
    for word, n in words.items():
        for i in range(len(word)):
            for j in range(i + 1, min(len(word), i + _MAX_PIECE_LEN) + 1):
                counts[word[i:j]] += n

    n_pieces = vocab_size - FIXED_TOKENS
    candidates = sorted(
        (p for p in counts if len(p) > 1),
        key=lambda p: (-counts[p] * len(p), p),
    )
    if len(candidates) < n_pieces:
        raise ValueError(f"corpus too small for vocab_size={vocab_size}")
    pieces = ALPHABET + candidates[:n_pieces]
    total = sum(max(counts[p], 1) for p in pieces)
    # Rounded so the serialised scores do not depend on libm's last ulp.
    scored = sorted(((p, round(math.log(max(counts[p], 1) / total), 6)) for p in pieces),
                    key=lambda ps: (-ps[1], ps[0]))
    return [(tok, 0.0) for tok in SPECIAL_TOKENS] + scored


def t5_tokenizer(vocab_size: int) -> T5Tokenizer:
    """A T5 tokenizer of ``vocab_size`` tokens."""
    from transformers import T5Tokenizer

    # In transformers 5 T5Tokenizer is the tokenizers-backed class (there is
    # no separate *Fast class); it is what AutoTokenizer returns for a T5/UMT5
    # directory. Constructing it from a Unigram vocab gives exactly the backend
    # (WhitespaceSplit + Metaspace, "$A </s>" post-processor) that
    # from_pretrained rebuilds from tokenizer.json, so ids round-trip.
    # extra_ids=0: sentinel tokens would grow the vocab past vocab_size.
    tokenizer = T5Tokenizer(vocab=unigram_vocab(corpus(), vocab_size), extra_ids=0, model_max_length=512)
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, expected {vocab_size}")
    return tokenizer
