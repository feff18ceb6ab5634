"""SANA's decode: ``AutoencoderDC`` on ``latents / scaling_factor``, then (resolution binning) the image resized
and centre-cropped back to the requested size, as ``SanaPipeline`` does."""

from __future__ import annotations

import torch

from common.diffusion.parts.decoder import image_frames
from common.diffusion.vae_tiling import VaeTiling
from common.diffusion.loading import load_component


class SanaDecoder:
    def __init__(self, vae, device, tiling: VaeTiling = VaeTiling()):
        self.vae, self.device, self.tiling = vae, device, tiling
        self.scale = 2 ** (len(vae.config.encoder_block_out_channels) - 1)

    @classmethod
    def load(cls, info, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()) -> "SanaDecoder":
        from diffusers import AutoencoderDC

        vae = load_component(AutoencoderDC, info.path / "vae", dtype)
        return cls(vae.to(device).eval().requires_grad_(False), device, tiling)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Latents [n, C, H', W'] (at the size they were made at) -> float32 frames [n, 1, height, width, 3] in
        [0, 1], the requested size."""
        from diffusers.image_processor import PixArtImageProcessor

        latents = latents.to(self.device, self.vae.dtype)
        self.tiling.apply(self.vae, 1, latents.shape[-2] * self.scale, latents.shape[-1] * self.scale)
        image = self.vae.decode(latents / self.vae.config.scaling_factor, return_dict=False)[0]
        # The identity when the latents are the requested size (binning off, or a size that is its own bin).
        image = PixArtImageProcessor.resize_and_crop_tensor(image, width, height)
        return image_frames(image)
