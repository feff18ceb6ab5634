"""FLUX.1 Kontext's output size and its own request fields.

``FluxKontextPipeline`` makes its output at ``max_area`` (1024x1024 by default) whatever size is asked: the
asked size only gives the aspect, ``width = round(sqrt(max_area * aspect))``, ``height = round(sqrt(max_area /
aspect))``, each rounded down to whole 2x2 packs of latent pixels. :class:`KontextLatents` makes the latents at
that size (and the decoder gives it back: the pipeline returns that size too).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.diffusion.parts.latents import PackedLatents
from common.diffusion.request_fields import FROM_MODEL, RequestField
from common.families.flux.kontext_images import AUTO_RESIZE

MAX_AREA = "max_area"
PIPELINE_MAX_AREA = 1024 ** 2  # FluxKontextPipeline.__call__'s default


def kontext_size(height: int, width: int, max_area: int, multiple: int) -> tuple[int, int]:
    """The (height, width) ``FluxKontextPipeline.__call__`` generates at for an asked size."""
    aspect = width / height
    w, h = round((max_area * aspect) ** 0.5), round((max_area / aspect) ** 0.5)
    return h // multiple * multiple, w // multiple * multiple


@dataclass(frozen=True, kw_only=True)
class KontextLatents(PackedLatents):
    """Packed latents made at the request's ``max_area`` (else the model's) at the asked aspect."""

    snaps_sizes: bool = True

    def size(self, info, height: int, width: int, fields: dict) -> tuple[int, int]:
        area = fields.get(MAX_AREA) or info.defaults.get(MAX_AREA, PIPELINE_MAX_AREA)
        return kontext_size(height, width, int(area), info.vae_scale_spatial * 2)


MAX_AREA_FIELD = RequestField(
    MAX_AREA, int, "the output's area in pixels: the output is made at this area with the aspect of height / "
    "width, each rounded down to whole 2x2 packs of latent pixels (16 pixels on an 8x VAE; the pipeline's "
    "max_area)", default=FROM_MODEL, minimum=256, maximum=4096 ** 2)
AUTO_RESIZE_FIELD = RequestField(
    AUTO_RESIZE, bool, "resize the reference image to the preferred Kontext resolution nearest its aspect (the "
    "pipeline's default); false: its own size, rounded down to whole 2x2 packs of latent pixels (16 pixels on an "
    "8x VAE)", default=True)
