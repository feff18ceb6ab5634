"""Wan's VAE decode: de-normalise the latents, decode (tiled above the tiling budget), frames as diffusers'
VideoProcessor makes them."""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan

from common.diffusion.vae_tiling import VaeTiling
from common.diffusion.loading import load_component


def to_frames(video: torch.Tensor) -> torch.Tensor:
    """VAE output [n, 3, F, H, W] in [-1, 1] -> float32 frames [n, F, H, W, 3] in [0, 1]."""
    # Denormalise in the VAE's dtype first, then widen: diffusers' VideoProcessor order.
    return (video / 2 + 0.5).clamp(0, 1).float().permute(0, 2, 3, 4, 1).contiguous()


class WanDecoder:
    def __init__(self, vae: AutoencoderKLWan, device, tiling: VaeTiling = VaeTiling()):
        self.vae, self.device, self.tiling = vae, device, tiling
        z = vae.config.z_dim
        self.latents_mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
        self.latents_std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)

    @classmethod
    def load(cls, info, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()) -> "WanDecoder":
        vae = load_component(AutoencoderKLWan, info.path / "vae", dtype)
        return cls(vae.to(device).eval().requires_grad_(False), device, tiling)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int = 0, width: int = 0) -> torch.Tensor:
        dtype = self.vae.dtype
        latents = latents.to(self.device, dtype)
        # Same order of operations as diffusers: x / (1 / std) + mean, in the VAE's dtype.
        inv_std = 1.0 / self.latents_std.to(self.device, dtype)
        latents = latents / inv_std + self.latents_mean.to(self.device, dtype)
        cfg = self.vae.config
        _, _, frames, h, w = latents.shape
        self.tiling.apply(self.vae, (frames - 1) * cfg.scale_factor_temporal + 1, h * cfg.scale_factor_spatial,
                          w * cfg.scale_factor_spatial)
        return to_frames(self.vae.decode(latents, return_dict=False)[0])
