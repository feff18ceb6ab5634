"""Packed latents: FLUX's and Qwen-Image's 2x2 patches of the VAE latent as tokens ``[seq, C * 4]``.

Their pipelines draw the noise as a VAE latent ``[C, H', W']`` (``H' = 2 * (H // (vae * 2))``), then pack
each 2x2 patch into one token of ``C * 4`` channels, row-major over the ``(H' / 2) x (W' / 2)`` grid;
the transformer and the scheduler only ever see the tokens, and the decoder unpacks them. Latents on the
wire (``output_type: "latent"``, trajectories) are these tokens, as the pipelines return them.
"""

from __future__ import annotations

import torch

from common.diffusion.binding import Binding


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[n, C, H', W'] (or [n, 1, C, H', W']) -> [n, (H'/2) * (W'/2), C * 4]."""
    if latents.dim() == 5:  # Qwen-Image draws a frame axis of one
        latents = latents[:, 0]
    n, c, h, w = latents.shape
    x = latents.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """[n, rows * cols, C * 4] -> [n, C, 2 * rows, 2 * cols], the inverse of :func:`pack`."""
    n, _, channels = tokens.shape
    rows, cols = grid
    x = tokens.view(n, rows, cols, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(n, channels // 4, 2 * rows, 2 * cols)


class PackedBinding(Binding):
    """A family whose pipeline steps on packed latents (see the module docstring)."""

    video = False
    cfg_field = "true_cfg_scale"
    default_sigmas = True

    def token_grid(self, info, height: int, width: int) -> tuple[int, int]:
        step = info.vae_scale_spatial * 2
        return height // step, width // step

    def noise_shape(self, info, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        rows, cols = self.token_grid(info, height, width)
        return (1, info.latent_channels, 2 * rows, 2 * cols)

    def latent_shape(self, info, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        rows, cols = self.token_grid(info, height, width)
        return (1, rows * cols, info.latent_channels * 4)

    def pack(self, noise: torch.Tensor, info, height: int, width: int) -> torch.Tensor:
        return pack(noise)

    def image_seq_len(self, info, height: int, width: int, num_frames: int = 1) -> int:
        rows, cols = self.token_grid(info, height, width)
        return rows * cols

    def embedded_guidance(self, info, guidance_scale: float) -> float | None:
        return float(guidance_scale) if info.transformer_config.get("guidance_embeds") else None
