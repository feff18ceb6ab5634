"""One copy of each distinct text's conditioning among the requests the denoise worker holds."""

from __future__ import annotations

import collections
import hashlib

import torch

from common.diffusion.binding import Binding
from common.diffusion.parts.text import Conditioning, cond_to


def _digest(wire: dict[str, torch.Tensor], length: int) -> tuple:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(wire):
        t = wire[name]
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy())
    return length, h.digest()


class TextTable:
    """A text's conditioning on the device, by content, most recently used last.

    Requests with the same prompt (a trainer's groups of one prompt, sent as
    several requests) or the same negative prompt (nearly all of them) then hold
    the same object, which is what lets a batched forward compute their
    text-only layers once (:mod:`common.diffusion.shared_text`); it also keeps one copy
    of it in device memory instead of one per request.
    """

    def __init__(self, family: Binding, device: torch.device, dtype: torch.dtype, max_entries: int = 64):
        self.family, self.device, self.dtype, self.max_entries = family, device, dtype, max_entries
        self.items: collections.OrderedDict[tuple, Conditioning] = collections.OrderedDict()

    def conditioning(self, wire: dict[str, torch.Tensor], max_sequence_length: int) -> Conditioning:
        """A prompt's wire tensors -> the shared conditioning the transformer takes (e.g. Wan's [1, L, D])."""
        key = _digest(wire, max_sequence_length)
        hit = self.items.get(key)
        if hit is None:
            hit = self.items[key] = cond_to(self.family.text.conditioning(wire, max_sequence_length), self.device,
                                            self.dtype)
            if len(self.items) > self.max_entries:
                self.items.popitem(last=False)
        else:
            self.items.move_to_end(key)
        return hit
