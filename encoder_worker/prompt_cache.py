"""The encoder worker's cache of recently encoded prompts."""

from __future__ import annotations

import collections

import torch


class EmbeddingCache:
    """Recently encoded prompts (the text encoder never changes while serving).

    RL groups repeat a prompt n times and most requests share a negative
    prompt; those then cost no text-encoder call. Bounded by bytes, least
    recently used first out.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.items: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()

    def get(self, text: str) -> torch.Tensor | None:
        hit = self.items.get(text)
        if hit is not None:
            self.items.move_to_end(text)
        return hit

    def put(self, text: str, embeds: torch.Tensor) -> None:
        size = embeds.numel() * embeds.element_size()
        if size > self.max_bytes or text in self.items:
            return
        self.items[text] = embeds
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self.items.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
