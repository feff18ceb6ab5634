"""FLUX.1 Kontext's image side, run by the encoder worker (and by a trainer's recompute).

From a request's reference image it makes what the denoise worker appends to the noise tokens, as
``FluxKontextPipeline`` makes its ``image_latents``:

- the size: the image's own, rounded down to whole 2x2 packs of latent pixels (the pipeline's
  ``VaeImageProcessor.get_default_height_width``); with ``auto_resize`` (the pipeline's ``_auto_resize``, on by
  default) the preferred Kontext resolution (diffusers' ``PREFERRED_KONTEXT_RESOLUTIONS``) nearest that size's
  aspect; rounded down to the same multiple;
- the image resized (Lanczos) and normalised to [-1, 1] by diffusers' ``VaeImageProcessor``, VAE-encoded (the
  posterior's mode), ``(latents - shift_factor) * scaling_factor``, packed 2x2 into tokens:
  ``reference_latents`` [T, C * 4] and its token grid ``reference_grids`` [[rows, cols]].

The output size does not enter: the reference keeps its own size. Only the VAE's encoder half is kept here.
"""

from __future__ import annotations

import torch

from common.diffusion.parts.latents import pack
from common.diffusion.vae_tiling import VaeTiling
from common.diffusion.parts.reference import REFERENCE_GRIDS, REFERENCE_LATENTS
from common.diffusion.loading import load_component

AUTO_RESIZE = "auto_resize"


def reference_size(processor, image, auto_resize: bool) -> tuple[int, int]:
    """The (height, width) ``FluxKontextPipeline.__call__`` encodes ``image`` (PIL) at; ``processor``: its
    ``VaeImageProcessor`` (whose scale factor is the pack multiple)."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    height, width = processor.get_default_height_width(image)
    if auto_resize:
        aspect = width / height
        # The pipeline's min over (distance, w, h) tuples: ties go to the smaller width.
        _, width, height = min((abs(aspect - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
    multiple = processor.config.vae_scale_factor
    return height // multiple * multiple, width // multiple * multiple


class KontextConditioner:
    """The VAE's encoder half and the pipeline's image processor (see the module docstring)."""

    def __init__(self, vae, device, tiling: VaeTiling = VaeTiling()):
        from diffusers.image_processor import VaeImageProcessor

        self.vae, self.device, self.tiling = vae, device, tiling
        scale = 2 ** (len(vae.config.block_out_channels) - 1)
        # As the pipeline's: the VAE's scale times the 2x2 pack, so sizes come in whole tokens.
        self.processor = VaeImageProcessor(vae_scale_factor=scale * 2)

    @classmethod
    def load(cls, info, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()) -> "KontextConditioner":
        from diffusers import AutoencoderKL

        vae = load_component(AutoencoderKL, info.path / "vae", dtype)
        vae.decoder = None  # this worker only encodes: the decode worker holds the decoder
        return cls(vae.to(device).eval().requires_grad_(False), device, tiling)

    @torch.no_grad()
    def latents(self, image, auto_resize: bool = True) -> torch.Tensor:
        """[1, C, H', W']: one PIL image's normalised VAE latents, in the VAE's dtype."""
        height, width = reference_size(self.processor, image, auto_resize)
        pixels = self.processor.preprocess(self.processor.resize(image, height, width), height, width)
        self.tiling.apply(self.vae, 1, height, width)
        posterior = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist
        cfg = self.vae.config
        return (posterior.mode() - cfg.shift_factor) * cfg.scaling_factor

    def wire_tensors(self, images: list, height: int, width: int, fields: dict) -> dict[str, torch.Tensor]:
        """One request's reference tensors as they travel to the denoise worker (PIL images in; the output
        ``height`` and ``width`` do not change them)."""
        if len(images) != 1:
            raise ValueError(f"FLUX.1 Kontext takes one reference image, got {len(images)}")
        latents = self.latents(images[0], bool(fields.get(AUTO_RESIZE, True)))
        rows, cols = latents.shape[2] // 2, latents.shape[3] // 2
        return {REFERENCE_LATENTS.name: pack(latents)[0].float(),
                REFERENCE_GRIDS.name: torch.tensor([[rows, cols]], dtype=torch.int64)}


def load_conditioner(info, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()) -> KontextConditioner:
    """The condition part's loader: ``(info, dtype, device, tiling) -> conditioner``."""
    return KontextConditioner.load(info, dtype, device, tiling)
