"""The built-ins' CLIP tokenizers: byte-level BPE laid out like CLIP's, with merges learned here,
deterministically, from the corpus of :mod:`common.builtin.tokenizer.corpus`.

SD3 ships two CLIP tokenizers with the same vocabulary and merges that differ only in their pad token:
``tokenizer`` (CLIP-L) pads with ``<|endoftext|>``, ``tokenizer_2`` (CLIP-G) with ``!``; FLUX's CLIP-L is
the first.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from common.builtin.tokenizer.bpe import learn_merges
from common.builtin.tokenizer.corpus import corpus

if TYPE_CHECKING:
    from transformers import CLIPTokenizer

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
CLIP_L_PAD_TOKEN = EOS_TOKEN
CLIP_G_PAD_TOKEN = "!"
# CLIP's context length; SD3 pads and truncates both CLIP prompts to it.
MODEL_MAX_LENGTH = 77
# Merges learned from the corpus; enough that its common words are single tokens.
NUM_MERGES = 256
_END_OF_WORD = "</w>"  # CLIP's BPE marks a word's last symbol with this suffix


def byte_alphabet() -> list[str]:
    """The 256 byte-level symbols in CLIP's order (printable ASCII first, so ``!`` is id 0).

    Every byte is a token, bare and word-final, so no prompt (ASCII or not) ever maps to unk.
    """
    from tokenizers import pre_tokenizers

    # Sorting by code point gives the byte-level mapping's own order: bytes 33-126, 161-172 and
    # 174-255 stand for themselves, the others for U+0100 onwards.
    return sorted(pre_tokenizers.ByteLevel.alphabet())


def _base_vocab() -> dict[str, int]:
    symbols = byte_alphabet()
    return {tok: i for i, tok in enumerate(symbols + [s + _END_OF_WORD for s in symbols])}


def _with_specials(vocab: dict[str, int]) -> dict[str, int]:
    # As in CLIP, the special tokens take the last two ids.
    return {**vocab, BOS_TOKEN: len(vocab), EOS_TOKEN: len(vocab) + 1}


def _make(vocab: dict[str, int], merges: list[tuple[str, str]], pad_token: str) -> CLIPTokenizer:
    from transformers import CLIPTokenizer

    # In transformers 5 CLIPTokenizer is the tokenizers-backed class; it sets up CLIP's normaliser
    # (NFC, whitespace, lowercase), pre-tokeniser (CLIP's split + byte level) and post-processor
    # (<|startoftext|> ... <|endoftext|>), all of which from_pretrained rebuilds identically.
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=pad_token,
        model_max_length=MODEL_MAX_LENGTH,
    )


def _corpus_words() -> Counter[str]:
    """The corpus as the tokenizer sees it: normalised and pre-tokenised into byte-level words."""
    backend = _make(_with_specials(_base_vocab()), [], CLIP_L_PAD_TOKEN).backend_tokenizer
    words: Counter[str] = Counter()
    for line in corpus():
        words.update(w for w, _ in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(line)))
    return words


def clip_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's layout: bytes, word-final bytes, merged tokens in merge order, then the special tokens."""
    # Each word as its symbols, the last one carrying the end-of-word suffix.
    words = {tuple(w[:-1]) + (w[-1] + _END_OF_WORD,): n for w, n in sorted(_corpus_words().items())}
    merges = learn_merges(words, NUM_MERGES)
    if len(merges) < NUM_MERGES:
        raise ValueError(f"corpus too small for {NUM_MERGES} merges")
    vocab = _base_vocab()
    for left, right in merges:
        # Two different pairs can spell the same token; it keeps its first id.
        vocab.setdefault(left + right, len(vocab))
    return _with_specials(vocab), merges


def clip_tokenizer(pad_token: str) -> CLIPTokenizer:
    """A CLIP tokenizer; ``pad_token`` is :data:`CLIP_L_PAD_TOKEN` or :data:`CLIP_G_PAD_TOKEN`."""
    vocab, merges = clip_vocab_and_merges()
    tokenizer = _make(vocab, merges, pad_token)
    if len(tokenizer) != len(vocab):
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, expected {len(vocab)}")
    return tokenizer
