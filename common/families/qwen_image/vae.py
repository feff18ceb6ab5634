"""Qwen-Image's VAE decode: the unpacked latents de-normalised, ``AutoencoderKLQwenImage`` as the pipeline
(tiled above the tiling budget)."""

from __future__ import annotations

import torch

from common.diffusion.vae_tiling import VaeTiling
from common.diffusion.loading import load_component


class QwenImageDecoder:
    def __init__(self, vae, device, tiling: VaeTiling = VaeTiling()):
        self.vae, self.device, self.tiling = vae, device, tiling

    @classmethod
    def load(cls, info, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()) -> "QwenImageDecoder":
        from diffusers import AutoencoderKLQwenImage

        vae = load_component(AutoencoderKLQwenImage, info.path / "vae", dtype)
        return cls(vae.to(device).eval().requires_grad_(False), device, tiling)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Latents [n, C, H', W'] -> float32 frames [n, 1, H, W, 3] in [0, 1]."""
        latents = latents.to(self.device)[:, :, None].to(self.vae.dtype)  # [n, C, 1, H', W']
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        self.tiling.apply(self.vae, 1, height, width)
        image = self.vae.decode(latents / inv_std + mean, return_dict=False)[0][:, :, 0]
        return (image / 2 + 0.5).clamp(0, 1).float().permute(0, 2, 3, 1).unsqueeze(1).contiguous()
