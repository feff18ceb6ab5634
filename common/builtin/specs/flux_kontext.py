"""The built-in FLUX.1 Kontext image-editing models: :class:`TinyFluxKontextSpec` and the table of named specs,
:data:`SPECS`. A ``FluxKontextPipeline`` directory laid out as black-forest-labs/FLUX.1-Kontext-dev: FLUX.1-dev's
components (:func:`common.builtin.specs.flux.components`: CLIP-L and T5, the guidance-embedded transformer, the
dynamic-shift scheduler, the 16-channel ``AutoencoderKL``) and no IP-adapter image encoder.

A Kontext reference is auto-resized to about one megapixel whatever the output size (4096 tokens on top of
the noise tokens, and a 1024x1024 VAE encode), so the tiny model's transformer and VAE stay as small as
tiny-flux's: measured on this CPU (2 cores) in docs/operations.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.builtin.specs import flux
from common.builtin.specs.flux import TinyFluxSpec

@dataclass(frozen=True, kw_only=True)
class TinyFluxKontextSpec(TinyFluxSpec):
    """One tiny FLUX.1 Kontext configuration: :class:`~common.builtin.specs.flux.TinyFluxSpec`'s sizes plus the
    output area its requests default to (the pipeline's 1024x1024 would make a tiny model's output large)."""

    PIPELINE = "FluxKontextPipeline"
    SERVING_DEFAULT_KEYS = TinyFluxSpec.SERVING_DEFAULT_KEYS + ("max_area",)

    max_area: int = 64 * 64

    def __post_init__(self) -> None:
        super().__post_init__()
        multiple = self.vae_spatial_stride * flux.PACK_SIZE
        if self.max_area < multiple * multiple:
            raise ValueError(f"max_area must be at least {multiple * multiple} (one {multiple}x{multiple} cell)")


def sizes_of(spec: TinyFluxSpec) -> dict:
    """A FLUX.1 spec's fields, to make the Kontext twin of it."""
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}


SPECS: dict[str, TinyFluxKontextSpec] = {
    spec.name: spec
    for spec in (
        TinyFluxKontextSpec(name="tiny-flux-kontext"),
        # small-flux's compute-bound transformer for benches, 256x256 outputs.
        TinyFluxKontextSpec(**{**sizes_of(flux.SPECS["small-flux"]), "name": "small-flux-kontext",
                               "max_area": 256 * 256}),
    )
}


def components(spec: TinyFluxKontextSpec) -> dict:
    """``FluxKontextPipeline``'s components: FLUX.1's (the optional IP-adapter image encoder left out, as
    FLUX.1-Kontext-dev ships it)."""
    return flux.components(spec)


# The parity sweep's choices (common/builtin/sweep.py): FLUX.1's, and the reference image's area.
SWEEP_KNOBS = {
    "num_layers": (0, 1, 2), "num_single_layers": (1, 2), "num_attention_heads": (1, 2),
    "attention_head_dim": (16, 24), "axes_dims_rope": ((4, 6, 6), (4, 4, 8), (8, 8, 8)),
    "guidance_embeds": (True, False), "t5_d_model": (16, 32), "vae_block_out_channels": ((4, 4, 8, 8), (8, 8, 16, 16), (4, 8, 8)),
    "base_shift": (0.3, 0.5), "max_shift": (0.9, 1.15), "max_area": (1024, 4096),
    "height": (32, 64), "width": (32, 48, 64), "num_inference_steps": (2, 3), "guidance_scale": (0.0, 2.5),
}
