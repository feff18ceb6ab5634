"""LTX-2 image-to-video on the denoise side: the first latent frame's video tokens are the image's.

``LTX2ImageToVideoPipeline`` starts from the image's latent on frame 0 (noise elsewhere), conditions each video
token on ``t * (1 - mask)`` (0 on frame 0; the audio tokens and the transformer's sigma take the row's ``t``),
and steps frames 1 onward only. The engine keeps the joint latents as drawn and puts the image's tokens in
every model input, in the guidance's x0 (its rescale's std covers every video token) and in the result; a
rollout's frame 0 is no Gaussian step, so its elements are left out of the log-probs. With ``patch_size_t``
1 (LTX-2's), frame 0 is the first ``H' W' / p^2`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.diffusion.parts.condition import IMAGE_CONDITION, FirstFrame


def frame0_tokens(info, image: torch.Tensor) -> torch.Tensor:
    """The image's latent [1, C, 1, H', W'] as the packed tokens of frame 0 [1, T0, C p^2]."""
    from diffusers import LTX2Pipeline

    cfg = info.transformer_config
    return LTX2Pipeline._pack_latents(image, cfg.get("patch_size", 1), cfg.get("patch_size_t", 1))


def with_image(info, latents: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
    """``latents`` [n, S, C] with frame 0's tokens the image's (unchanged without an image)."""
    if image is None:
        return latents
    tokens = frame0_tokens(info, image).to(latents.dtype)
    return with_tokens(latents, tokens)


def with_tokens(latents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``latents`` [n, S, C] with their first tokens ``tokens`` [1, T0, C_v] (zero-padded to ``C`` where the
    audio tokens are wider: geometry.py)."""
    if tokens.shape[-1] < latents.shape[-1]:
        tokens = torch.nn.functional.pad(tokens, (0, latents.shape[-1] - tokens.shape[-1]))
    return torch.cat([tokens.expand(latents.shape[0], -1, -1), latents[:, tokens.shape[1]:]], dim=1)


@dataclass(frozen=True, kw_only=True)
class Ltx2FirstFrame(FirstFrame):
    def image_input(self, info):
        return "required"

    def wire_tensors(self, conditioner, images, last_image, params):
        return conditioner.wire_tensors(images, last_image, params)

    def cache_key(self, params):
        """The image's latent depends on the size and the CRF it is re-compressed at."""
        from common.families.ltx2.image import Ltx2ImageConditioner

        return Ltx2ImageConditioner.cache_key(params)

    def from_wire(self, wire):
        c = wire.get(IMAGE_CONDITION.name)
        return None if c is None else c[None]

    def example(self, info, latent_shape, generator, device, dtype):
        return None

    def model_latents(self, info, latents, image):
        return with_image(info, latents, image)

    def final_latents(self, info, latents, image):
        return with_image(info, latents, image)

    def row_timesteps(self, info, timestep, latents, image):
        t = timestep.float().reshape(-1, 1).expand(latents.shape[0], latents.shape[1])
        if image is None:
            return t
        keep = torch.ones(latents.shape[1], dtype=torch.float32, device=latents.device)
        keep[: frame0_tokens(info, image).shape[1]] = 0
        return t * keep  # (the pipeline's t * (1 - conditioning_mask))

    def log_prob_mask(self, info, latents, image):
        if image is None:
            return None
        keep = torch.ones(1, latents.shape[1], 1, dtype=torch.float32, device=latents.device)
        keep[:, : frame0_tokens(info, image).shape[1]] = 0
        return keep
