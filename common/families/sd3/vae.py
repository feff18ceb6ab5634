"""SD3's VAE decode: ``AutoencoderKL`` (16 channels) with its scaling and shift, as the pipeline decodes (tiled
above the tiling budget)."""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL

from common.diffusion.vae_tiling import VaeTiling


class SD3Decoder:
    def __init__(self, vae: AutoencoderKL, device, tiling: VaeTiling = VaeTiling()):
        self.vae, self.device, self.tiling = vae, device, tiling
        self.scale = 2 ** (len(vae.config.block_out_channels) - 1)  # pixels per latent, as the pipeline's

    @classmethod
    def load(cls, path, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()) -> "SD3Decoder":
        vae = AutoencoderKL.from_pretrained(path / "vae", dtype=dtype)
        return cls(vae.to(device).eval().requires_grad_(False), device, tiling)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int = 0, width: int = 0) -> torch.Tensor:
        """Latents [n, 16, H', W'] -> float32 frames [n, 1, H, W, 3] in [0, 1] (one frame: an image)."""
        cfg = self.vae.config
        latents = latents.to(self.device, self.vae.dtype)
        latents = (latents / cfg.scaling_factor) + cfg.shift_factor  # StableDiffusion3Pipeline's order
        self.tiling.apply(self.vae, 1, latents.shape[-2] * self.scale, latents.shape[-1] * self.scale)
        image = self.vae.decode(latents, return_dict=False)[0]
        # VaeImageProcessor.postprocess: denormalise in the VAE's dtype, then widen.
        return (image / 2 + 0.5).clamp(0, 1).float().permute(0, 2, 3, 1).unsqueeze(1).contiguous()
