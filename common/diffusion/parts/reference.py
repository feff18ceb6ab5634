"""Reference-image tokens: the condition part of image-editing models (Qwen-Image-Edit, FLUX.1 Kontext).

An edit request brings one or more images. The encoder worker's image side VAE-encodes each as its pipeline
does and packs it into tokens: ``reference_latents`` [T, C] (every reference's tokens, concatenated) and
``reference_grids`` [k, 2] (each reference's token grid). On the denoise side every row's packed noise
tokens are followed by the request's reference tokens (``hidden_states = [noise, references]``), a constant
of the request; the family's transformer part gets the forward's :class:`TokenLayout` for its positions and
returns the noise tokens' output only, as the pipelines slice ``noise_pred[:, :latents.size(1)]``. So the
latents, the trajectory and a rollout's log-probs are the noise tokens', as in the trainers' edit rollouts.

Rows of different reference layouts cannot share a forward (neither transformer takes a mask for image
tokens): :meth:`ReferenceTokens.batch_key` keeps them apart, so they run in forwards of their own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from common.diffusion.parts.condition import ConditionerLoader, NoCondition
from common.diffusion.vae_tiling import VaeTiling
from common.protocol.tensor_field import FLOAT_DTYPES, INT_DTYPES, TensorField, image_tensor

if TYPE_CHECKING:
    from common.diffusion.model_facts import ModelFacts

Grid = tuple[int, int]
# What the image side sends the denoise worker (see the module docstring): [T, C] and [k, 2].
REFERENCE_LATENTS = image_tensor("reference_latents", FLOAT_DTYPES, 2)
REFERENCE_GRIDS = image_tensor("reference_grids", INT_DTYPES, 2)
# (info, [(width, height) per image], the request's family fields) -> the output's (height, width) when the
# request gives none: e.g. Qwen-Image-Edit's 1024x1024 area at the first image's aspect.
SizeFromImages = Callable[["ModelFacts", list[tuple[int, int]], dict], tuple[int, int]]


@dataclass(frozen=True)
class TokenLayout:
    """The token layout of one forward's rows: the noise tokens' grid, then each reference image's."""

    noise: Grid
    references: tuple[Grid, ...] = ()

    @property
    def noise_tokens(self) -> int:
        return self.noise[0] * self.noise[1]


def grid_to_wire(grid) -> list | dict:
    """A forward's ``grid`` (a token grid, or a :class:`TokenLayout`) as plain lists for a message header (a
    multi-device worker's followers get it with every forward)."""
    if isinstance(grid, TokenLayout):
        return {"noise": list(grid.noise), "references": [list(r) for r in grid.references]}
    return list(grid)


def grid_from_wire(value: list | dict):
    """:func:`grid_to_wire`'s inverse."""
    if isinstance(value, dict):
        return TokenLayout(tuple(value["noise"]), tuple(tuple(r) for r in value["references"]))
    return tuple(value)


@dataclass(frozen=True)
class References:
    """A request's reference tokens on the denoise side: [1, T, C] and the grids they are made of."""

    tokens: torch.Tensor
    grids: tuple[Grid, ...]

    def to(self, device) -> "References":
        return References(self.tokens.to(device), self.grids)


@dataclass(frozen=True, kw_only=True)
class ReferenceTokens(NoCondition):
    """Reference images as tokens after the noise tokens (see the module docstring)."""

    loader: ConditionerLoader | None = None
    required: bool = True  # False: the model also generates from text alone (FLUX.1 Kontext)
    max_images: int = 1  # how many images a request may give (``image`` as a list beyond 1)
    images_in_text: bool = False  # the text encoder sees the request's images too (a vision-language model)
    size_from_images: SizeFromImages | None = None
    fields: tuple[TensorField, ...] = (REFERENCE_LATENTS, REFERENCE_GRIDS)

    def image_input(self, info):
        return "required" if self.required else "optional"

    def images_allowed(self, info) -> int:
        return self.max_images

    def text_sees_images(self) -> bool:
        return self.images_in_text

    def load(self, info, dtype, device, tiling=VaeTiling()):
        return self.loader(info, dtype, device, tiling)

    def wire_tensors(self, conditioner, images: list, last_image, params) -> dict[str, torch.Tensor]:
        return conditioner.wire_tensors(images, params.height, params.width, dict(params.fields))

    def cache_key(self, params) -> tuple:
        # The family's fields (e.g. Kontext's auto_resize) may change how an image is resized.
        return params.height, params.width, json.dumps(params.fields, sort_keys=True, default=str)

    def default_size(self, info, sizes: list[tuple[int, int]], fields: dict) -> tuple[int, int] | None:
        return None if self.size_from_images is None or not sizes else self.size_from_images(info, sizes, fields)

    def from_wire(self, wire):
        tokens, grids = wire.get(REFERENCE_LATENTS.name), wire.get(REFERENCE_GRIDS.name)
        if tokens is None:
            return None
        layout = tuple((int(r), int(c)) for r, c in grids.tolist())
        if sum(r * c for r, c in layout) != tokens.shape[0]:
            raise ValueError(f"reference_grids {list(layout)} do not hold the {tokens.shape[0]} reference tokens")
        return References(tokens[None], layout)

    def example(self, info, latent_shape, generator, device, dtype):
        # A compile warm-up's reference: one image the size of the output (packed latents [seq, C]), its token
        # grid the packed latents' at the model's default size (PackedLatents.token_grid).
        seq, channels = latent_shape
        step = info.vae_scale_spatial * 2
        rows, cols = info.defaults["height"] // step, info.defaults["width"] // step
        return References(torch.randn(1, seq, channels, generator=generator, device=device, dtype=dtype),
                          ((rows, cols),))

    def model_latents(self, info, latents, image):
        if image is None:
            return latents
        refs = image.tokens.to(latents.dtype)
        return torch.cat([latents, refs.expand(latents.shape[0], *refs.shape[1:])], dim=1)

    def token_layout(self, grid, image):
        return grid if image is None else TokenLayout(tuple(grid), image.grids)

    def batch_key(self, image):
        return None if image is None else image.grids

    def extra_tokens(self, image):
        return 0 if image is None else image.tokens.shape[1]
