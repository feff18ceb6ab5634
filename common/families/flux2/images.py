"""FLUX.2 [klein]'s reference images, run by the encoder worker (and by a trainer's recompute).

Each of a request's images becomes reference tokens as ``Flux2KleinPipeline.__call__`` makes them:

- checked by ``Flux2ImageProcessor.check_image_input`` (sides of at least 64 pixels, aspect at most 8);
- above a 1024x1024 area, resized (Lanczos) to that area at its aspect (``_resize_to_target_area``); its
  size rounded down to whole 16-pixel cells (the VAE's scale times the 2x2 pack), resized and centre-cropped
  to it and normalised to [-1, 1] (``preprocess(..., resize_mode="crop")``);
- VAE-encoded and normalised (:func:`common.families.flux2.vae.encode`), each position one token:
  ``reference_latents`` [T, C * 4] (every image's tokens in order) and ``reference_grids`` [k, 2].

The output size does not change them. A request without height and width gets the first image's size
(:func:`size_from_images`), as the pipeline's ``height = height or image_height``.
"""

from __future__ import annotations

import math

import torch

from common.diffusion.vae_tiling import VaeTiling
from common.families.flux2.vae import encode, load_vae
from common.diffusion.parts.reference import REFERENCE_GRIDS, REFERENCE_LATENTS

PIPELINE_AREA = 1024 * 1024  # the pipeline resizes a larger reference down to this area
MIN_SIDE, MAX_ASPECT = 64, 8  # Flux2ImageProcessor.check_image_input's defaults, which the pipeline runs


def reference_size(width: int, height: int, multiple: int) -> tuple[int, int]:
    """The (width, height) an image of this size is encoded at (its own, or the target area's, rounded down)."""
    if width * height > PIPELINE_AREA:
        scale = math.sqrt(PIPELINE_AREA / (width * height))  # as Flux2ImageProcessor._resize_to_target_area
        width, height = int(width * scale), int(height * scale)
    return width // multiple * multiple, height // multiple * multiple


def size_from_images(info, sizes: list[tuple[int, int]], fields: dict) -> tuple[int, int]:
    """The output (height, width) of a request that gives none: its first image's encoded size. An image the
    pipeline refuses (``check_image_input``) is a 400 naming it, before any worker sees it."""
    from common.diffusion.params import FieldError

    for i, (width, height) in enumerate(sizes):
        name = "image" if len(sizes) == 1 else f"image[{i}]"
        if min(width, height) < MIN_SIDE:
            raise FieldError(name, f"{width}x{height}: both sides must be at least {MIN_SIDE} pixels")
        if max(width / height, height / width) > MAX_ASPECT:
            raise FieldError(name, f"{width}x{height}: the aspect ratio must be at most {MAX_ASPECT}")
    width, height = reference_size(*sizes[0], info.vae_scale_spatial * 2)
    return height, width


class Flux2Conditioner:
    """The VAE (its encoder half) and the pipeline's image processor."""

    def __init__(self, vae, tiling: VaeTiling = VaeTiling()):
        from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

        self.vae, self.tiling = vae, tiling
        self.multiple = 2 ** (len(vae.config.block_out_channels) - 1) * 2
        self.processor = Flux2ImageProcessor(vae_scale_factor=self.multiple)

    @classmethod
    def load(cls, info, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()) -> "Flux2Conditioner":
        vae = load_vae(info, dtype, device)
        vae.decoder = None  # this worker only encodes: the decode worker holds the decoder
        return cls(vae, tiling)

    @torch.no_grad()
    def latents(self, image) -> torch.Tensor:
        """[1, C * 4, rows, cols]: one PIL image's normalised reference latents."""
        self.processor.check_image_input(image)
        if image.width * image.height > PIPELINE_AREA:
            image = self.processor._resize_to_target_area(image, PIPELINE_AREA)
        width, height = reference_size(image.width, image.height, self.multiple)
        pixels = self.processor.preprocess(image, height=height, width=width, resize_mode="crop")
        self.tiling.apply(self.vae, 1, height, width)
        return encode(self.vae, pixels)

    def wire_tensors(self, images: list, height: int, width: int, fields: dict) -> dict[str, torch.Tensor]:
        tokens, grids = [], []
        for image in images:
            latents = self.latents(image)[0]
            tokens.append(latents.flatten(1).T.float())  # [rows * cols, C * 4], row-major positions
            grids.append(list(latents.shape[1:]))
        return {REFERENCE_LATENTS.name: torch.cat(tokens), REFERENCE_GRIDS.name: torch.tensor(grids, dtype=torch.int64)}


def load_conditioner(info, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()) -> Flux2Conditioner:
    """The condition part's loader."""
    return Flux2Conditioner.load(info, dtype, device, tiling)
