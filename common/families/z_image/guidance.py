"""Z-Image's classifier-free guidance, as ``ZImagePipeline.__call__`` computes it.

On when ``guidance_scale > 0`` (so the Turbo setting, 0, runs one row per sample), per sample
``pos + g * (pos - neg)`` in float32; with ``cfg_normalization`` above 0 the guided prediction is scaled down
to at most that multiple of the conditional one's norm (over the whole sample); with ``cfg_truncation`` at most
1, a step whose ``(1000 - t) / 1000`` exceeds it takes the conditional prediction alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.diffusion.parts.guidance import Guidance
from common.diffusion.request_fields import field_value
from common.families.z_image.fields import CFG_NORMALIZATION, CFG_TRUNCATION


@dataclass(frozen=True)
class ZImageCfg:
    """A request's guidance settings."""

    scale: float
    normalization: float
    truncation: float | None

    def truncated(self, timestep: torch.Tensor) -> bool:
        """Whether the step at ``timestep`` runs without guidance (the pipeline's ``_precomputed_t_norms``)."""
        if self.truncation is None or self.truncation > 1:
            return False
        t = timestep.reshape(-1)[0].float()  # the request's samples share their step
        return ((1000 - t) / 1000).item() > self.truncation


def pipeline_sigmas(n: int) -> list[float]:
    """ZImagePipeline's default sigmas: ``torch.linspace(1, 1/N, N)`` in float32, not numpy's float64 of the
    other flow pipelines (at 6 steps the second shifted sigma is then 0.9375, not 0.93750006: the transformer's
    time input sees the difference)."""
    return torch.linspace(1.0, 1 / n, n).tolist()


@dataclass(frozen=True, kw_only=True)
class ZImageGuidance(Guidance):
    default_sigmas: object = pipeline_sigmas

    def uses_cfg(self, params) -> bool:
        """On above 0 (``do_classifier_free_guidance``), not 1: the Turbo setting, 0, runs one pass."""
        return self.scale(params) > 0.0

    def settings(self, params) -> ZImageCfg:
        return ZImageCfg(self.scale(params), float(field_value(params, CFG_NORMALIZATION.name) or 0.0),
                         field_value(params, CFG_TRUNCATION.name))

    def combine(self, x, outs, scale):
        s: ZImageCfg | None = x.settings
        if len(outs) == 1 or s is None or s.truncated(x.timestep):
            return outs[0]
        pos, neg = outs[0].float(), outs[1].float()
        guided = pos + s.scale * (pos - neg)
        if s.normalization > 0.0:
            guided = torch.stack([_renormalized(g, p, s.normalization) for g, p in zip(guided, pos)])
        return guided


def _renormalized(guided: torch.Tensor, pos: torch.Tensor, ratio: float) -> torch.Tensor:
    """One sample's guided prediction scaled to at most ``ratio`` times the norm of its conditional one."""
    new_norm, most = torch.linalg.vector_norm(guided), torch.linalg.vector_norm(pos) * ratio
    return guided * (most / new_norm) if new_norm > most else guided
