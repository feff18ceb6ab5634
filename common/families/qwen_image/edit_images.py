"""Qwen-Image-Edit's image side, run by the encoder worker: each reference image's packed latent tokens, as
the edit pipelines' ``prepare_latents`` makes ``image_latents``.

Every reference is encoded at a 1024x1024 area at its own aspect ratio, whatever the output size (diffusers'
``calculate_dimensions``, rounded to 32 pixels), by the VAE (``argmax``: the posterior's mode),
normalised by ``latents_mean`` / ``latents_std`` and packed 2x2 into tokens: a token is the VAE's scale
factor times 2 pixels on a side (16 on Qwen-Image's 8x VAE), read from the directory as the pipelines'
``vae_scale_factor = 2 ** len(temperal_downsample)``. Qwen-Image-Edit takes one image
(resized, then preprocessed, by the pipeline's ``VaeImageProcessor``), Qwen-Image-Edit-Plus up to three
(each preprocessed at its own size); the tokens of all of them travel concatenated as ``reference_latents``
[T, C * 4] with each one's token grid in ``reference_grids`` [k, 2].
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.diffusion.parts.latents import pack
from common.diffusion.vae_tiling import VaeTiling
from common.diffusion.parts.reference import REFERENCE_GRIDS, REFERENCE_LATENTS
from common.diffusion.loading import load_component

REFERENCE_AREA = 1024 * 1024


def vae_scale_factor(vae_config) -> int:
    """The pipelines' ``vae_scale_factor`` of an ``AutoencoderKLQwenImage`` config: one halving per entry of
    its ``temperal_downsample``."""
    return 2 ** len(vae_config["temperal_downsample"])


def area_size(size: tuple[int, int], area: int = REFERENCE_AREA) -> tuple[int, int]:
    """(height, width) at ``area`` pixels with the aspect of ``size`` (width, height), as the pipelines size an
    image (diffusers' ``calculate_dimensions``): the references at 1024x1024, the VL's images (Plus) at 384x384."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    width, height, _ = calculate_dimensions(area, size[0] / size[1])
    return height, width


def edit_output_size(info, sizes: list[tuple[int, int]], fields: dict) -> tuple[int, int]:
    """QwenImageEditPipeline's default (height, width): the first image's reference size."""
    return _output_size(sizes[0], info.vae_scale_spatial * 2)


def edit_plus_output_size(info, sizes: list[tuple[int, int]], fields: dict) -> tuple[int, int]:
    """QwenImageEditPlusPipeline's default (height, width): the last image's reference size."""
    return _output_size(sizes[-1], info.vae_scale_spatial * 2)


def _output_size(size: tuple[int, int], pixels_per_token: int) -> tuple[int, int]:
    height, width = area_size(size)
    # The pipelines floor the size to whole tokens (``multiple_of = vae_scale_factor * 2``): a no-op on
    # calculate_dimensions' multiples of 32 unless the VAE downsamples more than 16x.
    return height // pixels_per_token * pixels_per_token, width // pixels_per_token * pixels_per_token


class QwenImageEditConditioner:
    """The VAE and the pipeline's image processor."""

    RESIZE_FIRST = True  # QwenImageEditPipeline resizes the image, then preprocesses it at the same size

    def __init__(self, vae, device, tiling: VaeTiling = VaeTiling()):
        from diffusers.image_processor import VaeImageProcessor

        self.vae, self.device, self.tiling = vae, device, tiling
        # Pixels per packed token on a side: the VAE's scale times the 2x2 packing (the pipelines' processor's).
        self.pixels_per_token = vae_scale_factor(vae.config) * 2
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.pixels_per_token)
        z = vae.config.z_dim
        self.latents_mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
        self.latents_std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)

    @classmethod
    def load(cls, info, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()) -> "QwenImageEditConditioner":
        from diffusers import AutoencoderKLQwenImage

        path = Path(getattr(info, "path", info))
        vae = load_component(AutoencoderKLQwenImage, path / "vae", dtype)
        # The decoder stays: AutoencoderKLQwenImage's encode counts the decoder's convolutions (clear_cache).
        return cls(vae.to(device).eval().requires_grad_(False), device, tiling)

    @torch.no_grad()
    def tokens(self, image) -> tuple[torch.Tensor, tuple[int, int]]:
        """One PIL image's normalised packed latent tokens [rows * cols, C * 4] (float32) and (rows, cols)."""
        height, width = area_size(image.size)
        if self.RESIZE_FIRST:
            image = self.image_processor.resize(image, height, width)
        pixels = self.image_processor.preprocess(image, height, width).unsqueeze(2)  # [1, 3, 1, H, W]
        self.tiling.apply(self.vae, 1, height, width)
        latents = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist.mode()
        mean, std = (t.to(latents.device, latents.dtype) for t in (self.latents_mean, self.latents_std))
        latents = ((latents - mean) / std)[:, :, 0]  # [1, C, H', W']
        # The preprocessed pixels are floored to whole tokens: so is the grid.
        step = self.pixels_per_token
        return pack(latents)[0].float(), (height // step, width // step)

    def wire_tensors(self, images: list, height: int, width: int, fields: dict) -> dict[str, torch.Tensor]:
        """The request's reference tensors (the output size does not change them)."""
        encoded = [self.tokens(image) for image in images]
        return {REFERENCE_LATENTS.name: torch.cat([t for t, _ in encoded]),
                REFERENCE_GRIDS.name: torch.tensor([g for _, g in encoded], dtype=torch.int64)}


class QwenImageEditPlusConditioner(QwenImageEditConditioner):
    RESIZE_FIRST = False  # QwenImageEditPlusPipeline preprocesses each image straight to its size


def load_edit_conditioner(info, dtype, device, tiling: VaeTiling = VaeTiling()):
    return QwenImageEditConditioner.load(info, dtype, device, tiling)


def load_edit_plus_conditioner(info, dtype, device, tiling: VaeTiling = VaeTiling()):
    return QwenImageEditPlusConditioner.load(info, dtype, device, tiling)
