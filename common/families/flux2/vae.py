"""FLUX.2's VAE (``AutoencoderKLFlux2``) as the pipeline uses it on both sides of the latents.

The pipeline's latents are 2x2 patches of the VAE latent folded into channels (``[C * 4, H' / 2, W' / 2]``,
"patchified"), normalised by the VAE's batch-norm running statistics (``bn``), each position one token:

- encode (a reference image): the posterior's mode, patchified, ``(x - mean) / sqrt(var + eps)``;
- decode: ``x * sqrt(var + eps) + mean``, unpatchified, decoded.
"""

from __future__ import annotations

import torch

from common.diffusion.parts.decoder import image_frames
from common.diffusion.vae_tiling import VaeTiling
from common.diffusion.loading import load_component


def load_vae(info, dtype: torch.dtype, device):
    from diffusers import AutoencoderKLFlux2

    vae = load_component(AutoencoderKLFlux2, info.path / "vae", dtype)
    return vae.to(device).eval().requires_grad_(False)


def bn_stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch-norm mean and std [1, C * 4, 1, 1] in ``like``'s dtype and device, as the pipeline reads them."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
    return mean, std


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[n, C, H', W'] -> [n, C * 4, H' / 2, W' / 2], channel-major within each 2x2 patch (the pipeline's order)."""
    n, c, h, w = latents.shape
    x = latents.view(n, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(n, c * 4, h // 2, w // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """:func:`patchify`'s inverse."""
    n, c4, h, w = latents.shape
    x = latents.reshape(n, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(n, c4 // 4, h * 2, w * 2)


class Flux2Decoder:
    """The decoder part: patchified latents [n, C * 4, rows, cols] (the latents part's unpack) to frames."""

    def __init__(self, vae, device, tiling: VaeTiling = VaeTiling()):
        self.vae, self.device, self.tiling = vae, device, tiling
        self.scale = 2 ** (len(vae.config.block_out_channels) - 1)

    @classmethod
    def load(cls, info, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()) -> "Flux2Decoder":
        return cls(load_vae(info, dtype, device), device, tiling)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int = 0, width: int = 0) -> torch.Tensor:
        latents = latents.to(self.device)
        mean, std = bn_stats(self.vae, latents)
        latents = unpatchify(latents * std + mean).to(self.vae.dtype)  # the pipeline's order, then the VAE's dtype
        self.tiling.apply(self.vae, 1, latents.shape[-2] * self.scale, latents.shape[-1] * self.scale)
        return image_frames(self.vae.decode(latents, return_dict=False)[0])


def encode(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Normalised pixels [1, 3, H, W] -> the pipeline's reference latents [1, C * 4, H / 16, W / 16]."""
    latents = patchify(vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode())
    mean, std = bn_stats(vae, latents)
    return (latents - mean) / std
