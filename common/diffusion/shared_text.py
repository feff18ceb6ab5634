"""Rows of a batched forward that share their text: the text side computed once per distinct text.

A GRPO group's samples share one prompt (their conditional rows) and one
negative prompt (their unconditional rows), yet a cross-attention transformer (Wan's, for one) would project
the text tokens of every row: the text embedder and, in every block, the
cross-attention keys and values. When the latents are small (few tokens next to
512 text tokens) that is most of a forward. With a :class:`TextPlan`, the
model is given only the distinct texts ([U, 512, D] instead of [B, 512, D]),
so its text embedder runs on U rows, and :class:`SharedTextAttention` (the
cross-attention processor of every block, diffusers' own extension point)
projects keys and values for the U texts and lets each text's rows attend to
them together: their queries side by side in one attention call, which is the
same attention for every query (cross-attention has no mask). Results agree
with a row-per-text forward to float32 rounding. Without a plan, the processor
is diffusers' own, untouched.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from common.diffusion.opaque import opaque_like


@dataclass(frozen=True)
class TextPlan:
    """Which of the U distinct texts each of a forward's B rows has."""

    first: list[int]  # [U]: the first row of each distinct text
    rows_of: list[slice | torch.Tensor]  # [U]: the rows of each text (a slice when they are consecutive)

    @classmethod
    def of(cls, keys: list[Hashable], device: torch.device) -> "TextPlan | None":
        """The plan for rows with ``keys`` (equal keys: equal text-side activations); None if none repeats."""
        index: dict[Hashable, list[int]] = {}
        for r, k in enumerate(keys):
            index.setdefault(k, []).append(r)
        if len(index) == len(keys):
            return None
        rows_of = [slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] + 1 == len(rows)
                   else torch.tensor(rows, device=device) for rows in index.values()]
        return cls([rows[0] for rows in index.values()], rows_of)


class SharedText:
    """The plan of the forward running now, read by the processors :func:`install` put in place."""

    def __init__(self):
        self.plan: TextPlan | None = None

    @contextmanager
    def active(self, plan: TextPlan | None) -> Iterator[None]:
        self.plan = plan
        try:
            yield
        finally:
            self.plan = None


def install(cross_attentions: list) -> SharedText:
    """Put :class:`SharedTextAttention` on each of a model's text-only cross-attentions (its transformer part
    says which they are)."""
    shared = SharedText()
    for attn in cross_attentions:
        attn.set_processor(SharedTextAttention(shared, attn.processor))
    return shared


class SharedTextAttention:
    """A cross-attention over a forward's distinct texts; diffusers' processor when no plan is active."""

    def __init__(self, shared: SharedText, original):
        self.shared, self.original = shared, original
        # Under torch.compile the attention per text is one opaque op (common/diffusion/opaque.py): traced, each
        # plan's rows would be guards, a recompile per plan. The projections around it stay in the graph.
        self._attend = opaque_like(self._attend_per_text)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        plan = self.shared.plan
        if plan is None or encoder_hidden_states is None or attention_mask is not None \
                or encoder_hidden_states.shape[0] == hidden_states.shape[0]:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))  # [B, Lq, H, d]
        if attn.fused_projections:
            key, value = attn.to_kv(encoder_hidden_states).chunk(2, dim=-1)
        else:
            key, value = attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))  # [U, Lk, H, d]
        value = value.unflatten(2, (attn.heads, -1))
        out = self._attend(query, key, value).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))

    def _attend_per_text(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Each text's rows: their queries side by side against that text's keys and values."""
        out = torch.empty_like(query)
        backend = getattr(self.original, "_attention_backend", None)
        for u, rows in enumerate(self.shared.plan.rows_of):
            q = query[rows]
            o = dispatch_attention_fn(q.reshape(1, -1, *q.shape[2:]), key[u : u + 1], value[u : u + 1],
                                      attn_mask=None, dropout_p=0.0, is_causal=False, backend=backend)
            out[rows] = o.reshape(q.shape)
        return out
