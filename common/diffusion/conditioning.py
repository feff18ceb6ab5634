"""A request's conditioning as tensors, for an answer (``return_conditioning``) and back for a recompute.

What the transformer takes besides the latents and the timestep: each text's keyword tensors (the prompt's and,
with classifier-free guidance, the negative prompt's), the image side's condition (an image-to-video latent, an
edit's reference tokens and grids) and the embedded guidance of guidance-distilled models. Names are
``cond.<keyword>``, ``uncond.<keyword>``, ``image.<name>`` and ``guidance``; each tensor [1, ...] as the denoise
worker holds it, so a trainer that feeds them to :class:`rl.TrainerPolicy` gets the rollout's numbers.
"""

from __future__ import annotations

import torch

from common.diffusion.parts.text import Conditioning, text_kwargs


def conditioning_tensors(cond: Conditioning, uncond: Conditioning | None, image, guidance: float | None
                         ) -> dict[str, torch.Tensor]:
    out = {f"cond.{k}": v for k, v in text_kwargs(cond).items()}
    if uncond is not None:
        out.update({f"uncond.{k}": v for k, v in text_kwargs(uncond).items()})
    if isinstance(image, torch.Tensor):
        out["image.condition"] = image
    elif image is not None:  # an edit's reference tokens and the grids they are made of
        out["image.reference_latents"] = image.tokens
        out["image.reference_grids"] = torch.tensor(image.grids, dtype=torch.int64)
    if guidance is not None:
        out["guidance"] = torch.tensor([guidance], dtype=torch.float32)
    return out


def grouped(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor] | torch.Tensor]:
    """``{"cond": {...}, "uncond": {...}, "image": {...}, "guidance": t}`` from the flat names."""
    out: dict = {}
    for name, t in tensors.items():
        head, _, rest = name.partition(".")
        if rest:
            out.setdefault(head, {})[rest] = t
        else:
            out[head] = t
    return out
