"""The encoder worker's cache of recently encoded prompts."""

from __future__ import annotations

import collections
from collections.abc import Hashable

import torch


def _nbytes(value: torch.Tensor | dict[str, torch.Tensor]) -> int:
    tensors = value.values() if isinstance(value, dict) else (value,)
    return sum(t.numel() * t.element_size() for t in tensors)


class EmbeddingCache:
    """Recently encoded prompts (the text encoder never changes while serving).

    RL groups repeat a prompt n times and most requests share a negative
    prompt; those then cost no text-encoder call. Bounded by bytes, least
    recently used first out.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.items: collections.OrderedDict[Hashable, torch.Tensor | dict] = collections.OrderedDict()

    def get(self, text: Hashable):
        hit = self.items.get(text)
        if hit is not None:
            self.items.move_to_end(text)
        return hit

    def put(self, text: Hashable, embeds: torch.Tensor | dict[str, torch.Tensor]) -> None:
        """``text``: the prompt (and its token budget); ``embeds``: a tensor or a prompt's wire tensors."""
        size = _nbytes(embeds)
        if size > self.max_bytes or text in self.items:
            return
        self.items[text] = embeds
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self.items.popitem(last=False)
            self.bytes -= _nbytes(old)
