"""FLUX's VAE decode: packed tokens unpacked, then ``AutoencoderKL`` as ``FluxPipeline`` decodes."""

from __future__ import annotations

import torch

from common.diffusion.packed import unpack
from common.diffusion.vae_tiling import VaeTiling
from common.families.sd3.vae import SD3Decoder


class FluxDecoder:
    def __init__(self, info, image: SD3Decoder):
        self.info, self.image = info, image

    @classmethod
    def load(cls, info, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()) -> "FluxDecoder":
        return cls(info, SD3Decoder.load(info.path, dtype, device, tiling))  # the same VAE, scaling, shift, tiling

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents [n, seq, 64] -> float32 frames [n, 1, H, W, 3] in [0, 1]."""
        grid = self.info.family.token_grid(self.info, height, width)
        return self.image.decode(unpack(latents, grid))
