"""One copy of each distinct text's conditioning among the requests the denoise worker holds."""

from __future__ import annotations

import collections
import hashlib

import torch

from common.families.wan.text import pad_embeddings


def _digest(embeds: torch.Tensor) -> tuple:
    data = embeds.detach().contiguous().cpu().view(torch.uint8).numpy()
    return tuple(embeds.shape), str(embeds.dtype), hashlib.blake2b(data, digest_size=16).digest()


class TextTable:
    """Padded embeddings on the device, by content, most recently used last.

    Requests with the same prompt (a trainer's groups of one prompt, sent as
    several requests) or the same negative prompt (nearly all of them) then hold
    the same tensor, which is what lets a batched forward compute their
    text-only layers once (:mod:`common.diffusion.shared_text`); it also keeps one copy
    of it in device memory instead of one per request.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, max_entries: int = 64):
        self.device, self.dtype, self.max_entries = device, dtype, max_entries
        self.items: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()

    def padded(self, embeds: torch.Tensor) -> torch.Tensor:
        """[L, D] trimmed embeddings -> the shared [1, 512, D] tensor the transformer takes."""
        key = _digest(embeds)
        hit = self.items.get(key)
        if hit is None:
            hit = self.items[key] = pad_embeddings(embeds).to(self.device, self.dtype)
            if len(self.items) > self.max_entries:
                self.items.popitem(last=False)
        else:
            self.items.move_to_end(key)
        return hit
