"""Greedy byte-pair merges, learnt here deterministically (the ``tokenizers`` trainer breaks ties differently
from run to run): the CLIP and Gemma tokenizers' merges."""

from __future__ import annotations

from collections import Counter


def learn_merges(words: dict[tuple[str, ...], int], count: int) -> list[tuple[str, str]]:
    """Up to ``count`` merges of ``words`` (each word as its symbols -> its count): repeatedly the most frequent
    adjacent pair of symbols, ties to the lexicographically smallest pair, so the result does not depend on hash
    or dict order; fewer when every word is a single symbol."""
    merges: list[tuple[str, str]] = []
    while len(merges) < count:
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, n in words.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        # Distinct words stay distinct after a merge (their symbols spell them).
        words = {_apply_merge(symbols, best): n for symbols, n in words.items()}
    return merges


def _apply_merge(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)
