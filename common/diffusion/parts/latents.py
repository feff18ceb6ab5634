"""The latents part: what a model directory says about its latents, and the latents its pipeline steps on.

Plain video latents ``[C, F', H', W']``, plain image latents ``[C, H', W']``, or packed tokens ``[seq, C * 4]``:
each 2x2 patch of the VAE latent one token, row-major over the ``(H' / 2) x (W' / 2)`` grid (the transformer
and the scheduler only ever see the tokens; latents on the wire are these tokens, as the pipelines return
them, and the decode side unpacks them). The noise is drawn as :meth:`LatentsPart.noise_shape` says and
packed by :meth:`LatentsPart.pack`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from common.diffusion.model_facts import ModelFacts


@dataclass(frozen=True)
class Geometry:
    """What a model directory says about its latents: read once (:attr:`LatentsPart.geometry`)."""

    latent_channels: int
    vae_scale_spatial: int
    vae_scale_temporal: int = 1  # 1: an image model
    patch_size: tuple[int, ...] = (1, 2, 2)


# (model directory, transformer config) -> its Geometry
GeometryReader = Callable[[Path, dict], Geometry]


def vae_config(path: Path) -> dict:
    return json.loads((path / "vae" / "config.json").read_text())


def autoencoder_kl_scale(path: Path) -> int:
    """Pixels per latent of an ``AutoencoderKL``: one halving per block after the first."""
    return 2 ** (len(vae_config(path).get("block_out_channels", [0] * 4)) - 1)


@dataclass(frozen=True, kw_only=True)
class LatentsPart:
    """Plain latents ``[C, (F',) H', W']``: the noise is what the pipeline steps on."""

    geometry: GeometryReader
    video: bool = False  # a frame axis: [C, F', H', W']
    # The pipeline snaps a requested size (:meth:`size`, e.g. to resolution bins), so any size within the
    # bounds is a valid request; the multiple rule holds for the snapped one.
    snaps_sizes: bool = False
    # Several latent streams in one tensor (LTX-2's video and audio): their names (:meth:`stream_masks`).
    streams: tuple[str, ...] = ()

    def size(self, info: "ModelFacts", height: int, width: int, fields: dict) -> tuple[int, int]:
        """The (height, width) a request's latents are made at, which every other method here takes, for its
        requested size and family fields (``GenerationParams.fields``): the requested size, unless the
        pipeline snaps sizes (e.g. to resolution bins); its decoder then gives the requested size back."""
        return height, width

    def shape(self, info: "ModelFacts", height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """One sample's latents as the pipeline steps on them (leading 1)."""
        h, w = height // info.vae_scale_spatial, width // info.vae_scale_spatial
        if self.video:
            return (1, info.latent_channels, (num_frames - 1) // info.vae_scale_temporal + 1, h, w)
        return (1, info.latent_channels, h, w)

    def noise_shape(self, info: "ModelFacts", height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """One sample's initial noise as the pipeline draws it, before :meth:`pack` (leading 1)."""
        return self.shape(info, height, width, num_frames)

    def pack(self, noise: torch.Tensor, info: "ModelFacts", height: int, width: int) -> torch.Tensor:
        """Drawn noise [n, *noise_shape] as the latents the pipeline steps on (identity: not packed)."""
        return noise

    def unpack(self, latents: torch.Tensor, info: "ModelFacts", height: int, width: int) -> torch.Tensor:
        """Stepped latents as the VAE takes them (the inverse of :meth:`pack`)."""
        return latents

    def token_grid(self, info: "ModelFacts", height: int, width: int) -> tuple[int, int]:
        """Packed latents: the (rows, columns) of a size's image tokens, which their position ids need."""
        return (0, 0)

    def image_seq_len(self, info: "ModelFacts", height: int, width: int, num_frames: int = 1) -> int:
        """The transformer's image tokens for a size (the dynamic shift's ``mu`` depends on it)."""
        shape = self.shape(info, height, width, num_frames)
        return math.prod(n // p for n, p in zip(shape[2:], info.patch_size))

    def request_shape(self, info: "ModelFacts", params) -> tuple[int, ...]:
        """One sample's latents for a request (``GenerationParams``), leading 1: :meth:`shape` of its size."""
        return self.shape(info, *self.size(info, params.height, params.width, params.fields), params.num_frames)

    def draw(self, info: "ModelFacts", params, generator: torch.Generator) -> torch.Tensor:
        """One sample's initial latents [1, ...] from its generator, as the pipeline draws and packs them."""
        height, width = self.size(info, params.height, params.width, params.fields)
        noise = torch.randn(self.noise_shape(info, height, width, params.num_frames), generator=generator,
                            dtype=torch.float32)
        return self.pack(noise, info, height, width)

    def seq_len(self, info: "ModelFacts", params) -> int:
        """:meth:`image_seq_len` of a request (the dynamic shift's ``mu``)."""
        height, width = self.size(info, params.height, params.width, params.fields)
        return self.image_seq_len(info, height, width, params.num_frames)

    def mu(self, info: "ModelFacts", params) -> float | None:
        """The dynamic shift's ``mu`` a pipeline computes its own way for a request without one (None: the
        scheduler config's ``calculate_shift`` of :meth:`seq_len`)."""
        return None

    def stream_masks(self, info: "ModelFacts", params) -> dict[str, torch.Tensor]:
        """Per stream (:attr:`streams`), 1 on its elements of a sample's latents [1, ...] (none: one stream)."""
        return {}

    def layout(self, info: "ModelFacts", params) -> object:
        """What a forward's transformer call needs to know of a request's latents beyond their tensor (its
        ``grid``; hashable, equal for requests that can share a forward): the token grid of its size."""
        return self.token_grid(info, *self.size(info, params.height, params.width, params.fields))

    def layout_to_wire(self, grid) -> list | dict:
        """:meth:`layout`'s value (with a condition's :class:`~common.diffusion.parts.reference.TokenLayout`) as
        plain data for a message header: a multi-device worker's followers get it with every forward."""
        from common.diffusion.parts.reference import grid_to_wire

        return grid_to_wire(grid)

    def layout_from_wire(self, value: list | dict):
        """:meth:`layout_to_wire`'s inverse."""
        from common.diffusion.parts.reference import grid_from_wire

        return grid_from_wire(value)


@dataclass(frozen=True, kw_only=True)
class PackedLatents(LatentsPart):
    """2x2 patches of an image latent as tokens (see the module docstring)."""

    def token_grid(self, info: "ModelFacts", height: int, width: int) -> tuple[int, int]:
        step = info.vae_scale_spatial * 2
        return height // step, width // step

    def noise_shape(self, info: "ModelFacts", height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        rows, cols = self.token_grid(info, height, width)
        return (1, info.latent_channels, 2 * rows, 2 * cols)

    def shape(self, info: "ModelFacts", height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        rows, cols = self.token_grid(info, height, width)
        return (1, rows * cols, info.latent_channels * 4)

    def pack(self, noise: torch.Tensor, info: "ModelFacts", height: int, width: int) -> torch.Tensor:
        return pack(noise)

    def unpack(self, latents: torch.Tensor, info: "ModelFacts", height: int, width: int) -> torch.Tensor:
        return unpack(latents, self.token_grid(info, height, width))

    def image_seq_len(self, info: "ModelFacts", height: int, width: int, num_frames: int = 1) -> int:
        rows, cols = self.token_grid(info, height, width)
        return rows * cols


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[n, C, H', W'] (or [n, 1, C, H', W']) -> [n, (H'/2) * (W'/2), C * 4]."""
    if latents.dim() == 5:  # a pipeline that draws a frame axis of one
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
