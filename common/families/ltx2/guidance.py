"""LTX-2's guidance: CFG, STG, modality guidance and rescale, per stream, combined on x0 as
``LTX2Pipeline.__call__`` combines them.

Each pass is a row of the batched forward (transformer.py's row kinds). Per stream, with ``x0 = x - sigma * v``:
``x0_c + (g - 1)(x0_c - x0_u) + s (x0_c - x0_stg) + (m - 1)(x0_c - x0_iso)``, rescaled toward ``x0_c``'s std
when the stream's rescale is above 0, and turned back into a velocity. A pass runs when either stream needs it
(CFG: a scale above 1; STG: above 0; modality: above 1), as the pipeline decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.diffusion.parts.guidance import Guidance
from common.diffusion.parts.text import TextCond, text_kwargs
from common.families.ltx2.condition import with_tokens
from common.families.ltx2.fields import stream_value
from common.families.ltx2.transformer import ISOLATED, PERTURBED, ROW_KIND

NAMES = ("guidance_scale", "stg_scale", "modality_scale", "guidance_rescale")


def _rescale(guided: torch.Tensor, cond: torch.Tensor, factor: float) -> torch.Tensor:
    """diffusers' ``rescale_noise_cfg`` (its order of operations), on one stream's [n, S, C]."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

    return rescale_noise_cfg(guided, cond, guidance_rescale=factor)


@dataclass(frozen=True, kw_only=True)
class Ltx2Guidance(Guidance):
    in_one_forward: bool = True  # [uncond, cond] in one forward, then STG's pass, then modality's
    default_sigmas: bool = True

    def uses_cfg(self, params) -> bool:
        """CFG runs when either stream's scale is above 1 (each stream's own scale is in ``settings``)."""
        return max(stream_value(params, "guidance_scale")) > 1.0

    def passes(self, params, cond) -> tuple:
        stg, modality = stream_value(params, "stg_scale"), stream_value(params, "modality_scale")
        out = []
        if max(stg) > 0.0:
            out.append(_kind(cond, PERTURBED))
        if max(modality) > 1.0:
            out.append(_kind(cond, ISOLATED))
        return tuple(out)

    def settings(self, params) -> "Ltx2Scales":
        return Ltx2Scales(*(stream_value(params, name) for name in NAMES))

    def combine(self, x, outs, scale):
        s: Ltx2Scales = x.settings
        if s is None:  # one pass run alone (a step-caching branch): its own output, guided later with the rest
            return outs[0]
        cfg, stg, iso = s.guidance_scale, s.stg_scale, s.modality_scale
        on = iter(outs[1:])  # the passes present, in ModelInput.branches' order
        uncond = next(on) if max(cfg) > 1.0 else None
        perturbed = next(on) if max(stg) > 0.0 else None
        isolated = next(on) if max(iso) > 1.0 else None
        g, sigma, latents = x.grid.geometry, x.sigma, x.latents.float()
        if x.image is not None:  # image-to-video: x0 from frame 0's true tokens (rescale's std covers them)
            from diffusers import LTX2Pipeline

            latents = with_tokens(latents, LTX2Pipeline._pack_latents(x.image, g.patch_size, g.patch_size_t).float())
        streams = []
        for k, x_t in enumerate(g.split(latents)):
            def x0(v):
                return x_t - g.split(v.float())[k] * sigma
            cond = x0(outs[0])
            guided = cond + (0 if uncond is None else (cfg[k] - 1) * (cond - x0(uncond)))
            guided = guided + (0 if perturbed is None else stg[k] * (cond - x0(perturbed)))
            guided = guided + (0 if isolated is None else (iso[k] - 1) * (cond - x0(isolated)))
            if s.guidance_rescale[k] > 0:
                guided = _rescale(guided, cond, s.guidance_rescale[k])
            streams.append((x_t - guided) / sigma)
        return g.join(*streams)


@dataclass(frozen=True)
class Ltx2Scales:
    """A request's (video, audio) value of each guidance field (the audio ones already fallen back)."""

    guidance_scale: tuple[float, float]
    stg_scale: tuple[float, float]
    modality_scale: tuple[float, float]
    guidance_rescale: tuple[float, float]


def _kind(cond, kind: float) -> TextCond:
    tensors = text_kwargs(cond)
    first = next(iter(tensors.values()))
    return TextCond({**tensors, ROW_KIND: torch.full((1,), kind, dtype=first.dtype, device=first.device)})
