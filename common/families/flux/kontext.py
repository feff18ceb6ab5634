"""FLUX.1 Kontext (``FluxKontextPipeline``): FLUX.1-dev editing an image.

FLUX.1's parts (:mod:`common.families.flux.binding`) plus:

- image side (:mod:`.kontext_images`): the reference image auto-resized (``auto_resize``), VAE-encoded and
  packed; its tokens follow the noise tokens in every forward
  (:class:`~common.diffusion.parts.reference.ReferenceTokens`); a request without an image is a text-to-image
  one, as the pipeline runs it;
- positions: the reference tokens' ids are a grid of their own with first coordinate 1 (the noise tokens'
  is 0); the output is the noise tokens';
- size (:mod:`.kontext_size`): the output at ``max_area`` with the asked aspect; ``mu`` from the noise tokens
  alone, as the pipeline's ``calculate_shift(latents.shape[1], ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.diffusion.binding import Binding
from common.diffusion.parts.reference import ReferenceTokens, TokenLayout
from common.diffusion.request_fields import TRUE_CFG_SCALE, max_sequence_length
from common.diffusion.parts.text import HIDDEN
from common.families.flux.binding import FLUX, POOLED, FluxTransformer, geometry, image_ids
from common.families.flux.kontext_images import load_conditioner
from common.families.flux.kontext_size import AUTO_RESIZE_FIELD, MAX_AREA, MAX_AREA_FIELD, PIPELINE_MAX_AREA, \
    KontextLatents

# The first position coordinate of a reference image's tokens (the noise tokens': 0).
REFERENCE_INDEX = 1


def layout_ids(layout: TokenLayout, device, dtype: torch.dtype) -> torch.Tensor:
    """[noise + reference tokens, 3]: the noise grid's ids, then each reference grid's with first coordinate 1
    (``FluxKontextPipeline.prepare_latents``' ``image_ids``)."""
    ids = [image_ids(layout.noise, device, dtype)]
    for grid in layout.references:
        ref = image_ids(grid, device, dtype)
        ref[:, 0] = REFERENCE_INDEX
        ids.append(ref)
    return torch.cat(ids)


@dataclass(frozen=True, kw_only=True)
class KontextTransformer(FluxTransformer):
    def forward(self, model, hidden_states, timestep, text, grid, guidance) -> torch.Tensor:
        if not isinstance(grid, TokenLayout):  # no image: FLUX.1's forward
            return super().forward(model, hidden_states, timestep, text, grid, guidance)
        dtype, device = hidden_states.dtype, hidden_states.device
        txt_ids = torch.zeros(text[HIDDEN].shape[1], 3, device=device, dtype=dtype)
        out = model(hidden_states=hidden_states, timestep=timestep.to(dtype) / 1000, guidance=guidance,
                    pooled_projections=text[POOLED], encoder_hidden_states=text[HIDDEN], txt_ids=txt_ids,
                    img_ids=layout_ids(grid, device, dtype), return_dict=False)[0]
        return out[:, :grid.noise_tokens]  # the pipeline's noise_pred[:, :latents.size(1)]


FLUX_KONTEXT = Binding(
    family="flux-kontext", pipeline="FluxKontextPipeline", words=("flux", "kontext"),
    text=FLUX.text, latents=KontextLatents(geometry=geometry), transformer=KontextTransformer(),
    decoder=FLUX.decoder, guidance=FLUX.guidance,
    condition=ReferenceTokens(loader=load_conditioner, required=False, max_images=1),
    # FluxKontextPipeline's own defaults (height and width: 128 x the VAE's scale, before max_area).
    defaults={**FLUX.defaults, MAX_AREA: PIPELINE_MAX_AREA},
    default_size=FLUX.default_size,
    request_fields=(max_sequence_length(), TRUE_CFG_SCALE, MAX_AREA_FIELD, AUTO_RESIZE_FIELD))
