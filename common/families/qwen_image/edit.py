"""Qwen-Image-Edit (``QwenImageEditPipeline``) and Qwen-Image-Edit-Plus (``QwenImageEditPlusPipeline``):
Qwen-Image's parts with reference-image tokens.

- encoder: the text side sees the request's images (:mod:`common.families.qwen_image.edit_text`) and the
  image side VAE-encodes them into packed reference tokens (:mod:`common.families.qwen_image.edit_images`);
- denoise: ``QwenImageTransformer2DModel`` on ``[noise tokens, reference tokens]`` with ``img_shapes`` of the
  noise grid then each reference's (the rotary positions give each image its own frame index); a
  ``zero_cond_t`` transformer (Qwen-Image-Edit-2511) modulates the reference tokens at timestep 0 from those
  same ``img_shapes``; the output is the noise tokens' alone;
- the output size defaults to the 1024x1024 area at the first image's aspect (Edit) or the last's (Plus).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.diffusion.parts.reference import ReferenceTokens, TokenLayout
from common.families.qwen_image.binding import HIDDEN, MASK, QWEN_IMAGE, QwenImageTransformer
from common.families.qwen_image.edit_images import (edit_output_size, edit_plus_output_size,
                                                    load_edit_conditioner, load_edit_plus_conditioner)


@dataclass(frozen=True, kw_only=True)
class QwenImageEditTransformer(QwenImageTransformer):
    def forward(self, model, hidden_states, timestep, text, grid, guidance):
        layout = grid if isinstance(grid, TokenLayout) else TokenLayout(tuple(grid))
        # One img_shapes entry for every row (every row of a forward has the same layout: the part's
        # batch_key); the rotary embedding reads the first entry, zero_cond_t's modulation index broadcasts it.
        shapes = [[(1, *layout.noise), *((1, *ref) for ref in layout.references)]]
        out = model(hidden_states=hidden_states, timestep=timestep.to(hidden_states.dtype) / 1000,
                    guidance=guidance, encoder_hidden_states=text[HIDDEN], encoder_hidden_states_mask=text.get(MASK),
                    img_shapes=shapes, return_dict=False)[0]
        return out[:, : layout.noise_tokens]


def load_edit_text(info, dtype, device):
    from common.families.qwen_image.edit_text import QwenImageEditTextEncoder

    return QwenImageEditTextEncoder.load(info.path, dtype, device)


def load_edit_plus_text(info, dtype, device):
    from common.families.qwen_image.edit_text import QwenImageEditPlusTextEncoder

    return QwenImageEditPlusTextEncoder.load(info.path, dtype, device)


QWEN_IMAGE_EDIT = dataclasses.replace(
    QWEN_IMAGE, family="qwen-image-edit", pipeline="QwenImageEditPipeline",
    text=dataclasses.replace(QWEN_IMAGE.text, load_encoder=load_edit_text),
    transformer=QwenImageEditTransformer(),
    condition=ReferenceTokens(loader=load_edit_conditioner, max_images=1, images_in_text=True,
                              size_from_images=edit_output_size))

QWEN_IMAGE_EDIT_PLUS = dataclasses.replace(
    QWEN_IMAGE_EDIT, family="qwen-image-edit-plus", pipeline="QwenImageEditPlusPipeline",
    text=dataclasses.replace(QWEN_IMAGE.text, load_encoder=load_edit_plus_text),
    condition=ReferenceTokens(loader=load_edit_plus_conditioner, max_images=3, images_in_text=True,
                              size_from_images=edit_plus_output_size))
