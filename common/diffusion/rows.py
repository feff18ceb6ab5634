"""The rows of one transformer forward, and the forward of some of them on this process.

:class:`Rows` is everything a rank needs to run any share of a batched forward:
the latents and timesteps of every row, the distinct texts and which one each
row has, each row's LoRA adapter, and where the conditional rows end (CFG
parallel runs the rows before ``cond_rows`` on one group of ranks and the rest
on another). :func:`forward_rows` runs a slice of them: the shared-text plan
(:mod:`common.diffusion.shared_text`) and the LoRA rows (:mod:`common.diffusion.lora`) are
built for that slice, so a single device and every rank of a multi-device
worker compute a row the same way.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from common.diffusion.binding import Binding
from common.diffusion.parts.text import Conditioning, text_kwargs
from common.diffusion.lora import LoraAdapter, LoraHooks
from common.diffusion.shared_text import SharedText, TextPlan

LoraChoice = tuple[LoraAdapter, float] | None  # (adapter, scale) of a row; None: the base model


@dataclass(frozen=True)
class Rows:
    hidden_states: torch.Tensor  # [B, *latent] in the model's dtype
    timestep: torch.Tensor  # [B]
    texts: dict[str, torch.Tensor]  # the distinct texts: each text keyword's [U, ...] tensor
    text_of: list[int]  # [B]: which of ``texts`` each row has
    loras: list[LoraChoice]  # [B]
    cond_rows: int  # rows [0, cond_rows) are conditional passes, the rest unconditional ones
    grid: tuple[int, int] = (0, 0)  # packed families: the token grid (rows, columns), the same for every row
    guidance: torch.Tensor | None = None  # [B] embedded guidance (guidance-distilled models), else None

    @property
    def n(self) -> int:
        return self.hidden_states.shape[0]

    @classmethod
    def of(cls, family: Binding, hidden_states: torch.Tensor, timestep: torch.Tensor, texts: list[Conditioning],
           loras: list[LoraChoice], cond_rows: int | None = None, grid: tuple[int, int] = (0, 0),
           guidance: torch.Tensor | None = None) -> "Rows":
        """Rows from one conditioning per row; the same object on two rows is one text."""
        index: dict[int, int] = {}
        distinct: list[Conditioning] = []
        text_of = []
        for t in texts:
            if id(t) not in index:
                index[id(t)] = len(distinct)
                distinct.append(t)
            text_of.append(index[id(t)])
        stacked = family.text.stack([text_kwargs(t) for t in distinct])
        return cls(hidden_states, timestep, stacked, text_of, loras,
                   hidden_states.shape[0] if cond_rows is None else cond_rows, grid, guidance)


def forward_rows(family: Binding, model: torch.nn.Module, hooks: LoraHooks, shared: SharedText | None, rows: Rows,
                 start: int = 0, stop: int | None = None) -> torch.Tensor:
    """The model's output for rows ``start:stop`` of ``rows`` (all by default). ``shared``: the model's
    shared-text processors (None: its family computes every row's text side)."""
    stop = rows.n if stop is None else stop
    text_of, loras = rows.text_of[start:stop], rows.loras[start:stop]
    keys = [(t, None if lo is None else (id(lo[0]), lo[1])) for t, lo in zip(text_of, loras)]
    plan = None if shared is None else TextPlan.of(keys, rows.hidden_states.device)
    # With a plan the model sees each distinct text (and adapter) once: see common/diffusion/shared_text.py.
    firsts = range(len(keys)) if plan is None else plan.first
    which = [text_of[r] for r in firsts]
    text = {k: _pick(v, which) for k, v in rows.texts.items()}
    text_loras = None if plan is None else [loras[r] for r in plan.first]
    with hooks.rows(loras, text_loras), (shared.active(plan) if shared is not None else nullcontext()):
        guidance = None if rows.guidance is None else rows.guidance[start:stop]
        return family.transformer.forward(model, rows.hidden_states[start:stop], rows.timestep[start:stop], text,
                                          rows.grid, guidance)


def _pick(texts: torch.Tensor, which: list[int]) -> torch.Tensor:
    """``texts[which]``, a view when ``which`` is one text for every row (a single request's pass)."""
    if len(set(which)) == 1:
        return texts[which[0] : which[0] + 1].expand(len(which), *texts.shape[1:])
    return texts[torch.tensor(which, device=texts.device)]
