"""Qwen-Image-Edit's text conditioning: the pipeline's own ``encode_prompt`` with the request's images.

Qwen2.5-VL reads the prompt in the edit template with the images' vision tokens in it; its last hidden state
of the real tokens, the template's prefix dropped, travels as ``prompt_embeds`` [L, D] (no padding). The VL
sees each image as the pipeline resizes it first: Qwen-Image-Edit the one image at a 1024x1024 area,
Qwen-Image-Edit-Plus each image at a 384x384 area, named "Picture k:" in the prompt (diffusers'
``calculate_dimensions``, then the pipeline's ``VaeImageProcessor.resize``). As the pipelines, the edit encoders
do not cut the prompt at ``max_sequence_length``.

Each text is encoded alone, as the pipeline encodes a prompt and its negative prompt in two calls: texts with
different images never share a padded batch.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.diffusion.parts.pipeline_text import NOT_TEXT, PipelineTextEncoder
from common.families.qwen_image.edit_images import REFERENCE_AREA, area_size
from common.protocol.messages import PROMPT_EMBEDS
from common.diffusion.loading import load_component

# QwenImageEditPlusPipeline's CONDITION_IMAGE_SIZE (an area in pixels).
CONDITION_AREA = 384 * 384


def resized(pipe, image, area: int):
    """``image`` (PIL) as the pipeline resizes it to ``area`` at its own aspect ratio."""
    return pipe.image_processor.resize(image, *area_size(image.size, area))


class QwenImageEditTextEncoder(PipelineTextEncoder):
    PIPELINE = "QwenImageEditPipeline"
    ENCODERS = {"text_encoder": "Qwen2_5_VLForConditionalGeneration"}
    # The VL's images of a text: the pipeline's resize of them, and how many it takes.
    AREA = REFERENCE_AREA

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype, device):
        import diffusers
        import transformers

        from common.families.qwen_image.processor import load_processor

        path = Path(model_dir)
        model = load_component(transformers.Qwen2_5_VLForConditionalGeneration, path / "text_encoder", dtype)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path / "tokenizer")
        pipe = getattr(diffusers, cls.PIPELINE)(text_encoder=model.to(device).eval().requires_grad_(False),
                                                tokenizer=tokenizer, processor=load_processor(path),
                                                **dict.fromkeys(NOT_TEXT))
        return cls(pipe)

    def prompt_images(self, images: list):
        """What ``encode_prompt`` is given of one request's images. Qwen-Image-Edit: its one image at the
        pipeline's size."""
        return resized(self.pipe, images[0], self.AREA)

    @torch.no_grad()
    def wire_tensors(self, texts: list[str], max_sequence_length: int,
                     images: list[list]) -> list[dict[str, torch.Tensor]]:
        out = []
        for text, own in zip(texts, images, strict=True):
            embeds, mask = self.pipe.encode_prompt(prompt=[text], image=self.prompt_images(own),
                                                   device=self.device)
            length = embeds.shape[1] if mask is None else int(mask[0].sum())
            out.append({PROMPT_EMBEDS.name: embeds[0, :length]})
        return out


class QwenImageEditPlusTextEncoder(QwenImageEditTextEncoder):
    PIPELINE = "QwenImageEditPlusPipeline"
    AREA = CONDITION_AREA

    def prompt_images(self, images: list) -> list:
        """Every image, each at a 384x384 area at its own aspect ratio (the prompt names them in order)."""
        return [resized(self.pipe, image, self.AREA) for image in images]
