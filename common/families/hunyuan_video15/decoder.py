"""HunyuanVideo 1.5's decode: ``latents / scaling_factor`` through ``AutoencoderKLHunyuanVideo15`` (tiled above the
tiling budget), frames as the pipeline's video processor makes them."""

from __future__ import annotations

import torch

from common.diffusion.vae_tiling import VaeTiling
from common.diffusion.loading import load_component


class HunyuanVideo15Decoder:
    def __init__(self, vae, device, tiling: VaeTiling = VaeTiling()):
        self.vae, self.device, self.tiling = vae, device, tiling

    @classmethod
    def load(cls, info, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()) -> "HunyuanVideo15Decoder":
        from diffusers import AutoencoderKLHunyuanVideo15

        vae = load_component(AutoencoderKLHunyuanVideo15, info.path / "vae", dtype)
        vae.encoder = None  # the image side (encoder worker) encodes
        return cls(vae.to(device).eval().requires_grad_(False), device, tiling)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int = 0, width: int = 0) -> torch.Tensor:
        """Latents [n, C, F', H', W'] -> frames [n, F, H, W, 3] float32 in [0, 1]."""
        vae = self.vae
        latents = latents.to(self.device, vae.dtype) / vae.config.scaling_factor
        _, _, frames, h, w = latents.shape
        self.tiling.apply(vae, (frames - 1) * vae.temporal_compression_ratio + 1, h * vae.spatial_compression_ratio,
                          w * vae.spatial_compression_ratio)
        video = vae.decode(latents, return_dict=False)[0]
        # The video processor's order: de-normalise and clamp in the VAE's dtype, then widen.
        return (video / 2 + 0.5).clamp(0, 1).float().permute(0, 2, 3, 4, 1).contiguous()
