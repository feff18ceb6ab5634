"""The decoder part: VAE latents (the latents part's :meth:`~common.diffusion.parts.latents.LatentsPart.unpack`
of what the pipeline stepped on) to float32 frames ``[n, F, H, W, 3]`` in [0, 1] (F = 1: an image), tiled
above the tiling budget.

A decoder part is anything with ``load(info, dtype, device, tiling)`` returning an object whose
``decode(latents, height, width)`` gives the frames; :class:`AutoencoderKLDecoder` is the ``AutoencoderKL``
one (``latents / scaling_factor + shift_factor``, as the pipelines decode).

A decoder that needs its requests (the frame count, family fields, the seed) or makes sound has, besides or
instead of ``decode``, ``decode_rows(latents, rows, height, width) -> Decoded``: ``latents`` the latents as the
wire carries them (not unpacked), row k sample ``rows[k][1]`` of the request whose ``GenerationParams`` is
``rows[k][0]``, ``height`` x ``width`` the size the latents were made at; and ``batch_key(params)``: requests
whose keys (and sizes) are equal decode in one call. The decode stage prefers ``decode_rows`` where there is one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from common.diffusion.vae_tiling import VaeTiling
from common.diffusion.loading import load_component

if TYPE_CHECKING:
    from common.diffusion.model_facts import ModelFacts


@dataclass(frozen=True)
class Decoded:
    """What a ``decode_rows`` gives: frames [n, F, H, W, 3] float32 in [0, 1] and, for a model with sound, the
    waveform [n, channels, samples] float32 at ``sample_rate`` Hz."""

    frames: torch.Tensor
    audio: torch.Tensor | None = None
    sample_rate: int | None = None

    @staticmethod
    def cat(parts: "list[Decoded]") -> "Decoded":
        audio = None if parts[0].audio is None else torch.cat([p.audio for p in parts])
        return Decoded(torch.cat([p.frames for p in parts]), audio, parts[0].sample_rate)

    def rows(self, start: int, stop: int) -> "Decoded":
        audio = None if self.audio is None else self.audio[start:stop]
        return Decoded(self.frames[start:stop], audio, self.sample_rate)


class Decoder(Protocol):
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor: ...


class DecoderPart(Protocol):
    def load(self, info: "ModelFacts", dtype: torch.dtype, device: Any, tiling: VaeTiling = ...) -> Decoder: ...


def image_frames(image: torch.Tensor) -> torch.Tensor:
    """VAE output [n, 3, H, W] in [-1, 1] -> float32 frames [n, 1, H, W, 3] in [0, 1] (VaeImageProcessor's
    postprocess: denormalise in the VAE's dtype, then widen)."""
    return (image / 2 + 0.5).clamp(0, 1).float().permute(0, 2, 3, 1).unsqueeze(1).contiguous()


class AutoencoderKLDecoder:
    def __init__(self, vae, device, tiling: VaeTiling = VaeTiling()):
        self.vae, self.device, self.tiling = vae, device, tiling
        self.scale = 2 ** (len(vae.config.block_out_channels) - 1)  # pixels per latent, as the pipeline's

    @classmethod
    def load(cls, info: "ModelFacts", dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()) -> "AutoencoderKLDecoder":
        from diffusers import AutoencoderKL

        vae = load_component(AutoencoderKL, info.path / "vae", dtype)
        return cls(vae.to(device).eval().requires_grad_(False), device, tiling)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int = 0, width: int = 0) -> torch.Tensor:
        """Latents [n, C, H', W'] -> float32 frames [n, 1, H, W, 3] in [0, 1]."""
        cfg = self.vae.config
        latents = latents.to(self.device, self.vae.dtype)
        latents = (latents / cfg.scaling_factor) + cfg.shift_factor  # the pipelines' order
        self.tiling.apply(self.vae, 1, latents.shape[-2] * self.scale, latents.shape[-1] * self.scale)
        return image_frames(self.vae.decode(latents, return_dict=False)[0])
