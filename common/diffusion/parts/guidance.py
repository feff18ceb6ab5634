"""The guidance part: which request field scales classifier-free guidance, how a request's two passes
combine and run, and the transformer's embedded guidance.

:class:`Guidance` is classic CFG on ``guidance_scale``; :class:`TrueGuidance` is true CFG on
``true_cfg_scale`` (a negative prompt's second pass), optionally rescaled to the conditional prediction's norm,
beside a guidance-distilled transformer's embedded guidance (``guidance_scale``, when the config has
``guidance_embeds``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from common.diffusion.request_fields import field_value

if TYPE_CHECKING:
    from common.diffusion.model_facts import ModelFacts


class Guided(Protocol):
    """What a guidance part reads of a request's input at one step (``common.diffusion.policy.ModelInput``)."""

    latents: torch.Tensor  # [n, *latent]
    timestep: torch.Tensor
    grid: object  # the latents part's layout
    image: object  # the latent-side image condition, or None
    sigma: torch.Tensor | None
    settings: object  # what :meth:`Guidance.settings` made of the request


@dataclass(frozen=True, kw_only=True)
class Guidance:
    field: str = "guidance_scale"  # the request field that scales classifier-free guidance
    # A single request's two passes as the pipeline runs them: one forward ([uncond, cond]), or two (cond, uncond).
    in_one_forward: bool = False
    # The pipeline hands its scheduler ``sigmas = linspace(1, 1/N, N)`` (numpy's, float64) when a request gives
    # none, or a function of N gives them (a pipeline that computes them otherwise); else the scheduler spaces
    # its own steps.
    default_sigmas: object = False
    # The pipeline casts the model's output to float32 before guiding it (SanaPipeline's ``noise_pred.float()``):
    # in bf16 the combination then rounds as the pipeline's does.
    float32_output: bool = False

    def scale(self, params) -> float:
        """The request's classifier-free guidance scale (guidance runs above 1)."""
        value = field_value(params, self.field)
        return 1.0 if value is None else float(value)

    def uses_cfg(self, params) -> bool:
        """Whether a request runs classifier-free guidance's unconditional pass (its negative prompt encoded):
        above a scale of 1, as in diffusers."""
        return self.scale(params) > 1.0

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """Classifier-free guidance of one request's two passes, in its pipeline's order of operations."""
        return uncond + scale * (cond - uncond)

    def refusal(self, info: "ModelFacts", request: dict) -> tuple[str, str] | None:
        """(field, why) where this model directory refuses a request's guidance fields, else None."""
        return None

    def embedded(self, info: "ModelFacts", guidance_scale: float) -> float | None:
        """The transformer's guidance-embedding input for a request's ``guidance_scale``, else None."""
        return None

    def passes(self, params, cond) -> tuple:
        """The conditionings of the passes a request runs beyond CFG's two (none here)."""
        return ()

    def settings(self, params) -> object:
        """What :meth:`combine` reads of a request beyond its scale (none here)."""
        return None

    def combine(self, x: Guided, outs: list[torch.Tensor], scale: float) -> torch.Tensor:
        """The guided output of ``x`` from its passes' outputs (``ModelInput.branches``' order: cond, uncond,
        further passes); one output is the model's own."""
        if self.float32_output:
            outs = [out.float() for out in outs]
        return outs[0] if len(outs) == 1 else self.guide(outs[0], outs[1], scale)


@dataclass(frozen=True, kw_only=True)
class TrueGuidance(Guidance):
    field: str = "true_cfg_scale"
    default_sigmas: bool = True
    rescale: bool = False  # the guided prediction rescaled to the conditional one's norm per token

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        combined = uncond + scale * (cond - uncond)
        if not self.rescale:
            return combined
        return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def embedded(self, info: "ModelFacts", guidance_scale: float) -> float | None:
        return float(guidance_scale) if info.transformer_config.get("guidance_embeds") else None
