"""HunyuanVideo 1.5's text side: Qwen2.5-VL's language model behind the pipeline's chat template, and the ByT5
glyph encoder for the quoted text of a prompt.

A prompt travels as four tensors, each the pipeline's fixed length: Qwen2.5-VL's ``hidden_states[-3]`` with the
template's 108 prefix tokens cropped ``prompt_embeds`` [1000, D] and its mask ``prompt_mask`` [1000]; ByT5's
encoding of the prompt's quoted text ``glyph_embeds`` [256, D2] and ``glyph_mask`` [256] (zeros, all masked, for
a prompt without quotes). They are made by the pipeline's own static encoders
(``HunyuanVideo15Pipeline._get_mllm_prompt_embeds`` / ``_get_byt5_prompt_embeds``), so that template, crop and
glyph extraction are diffusers'. Every row is padded to the same length, so a prompt's tensors do not depend on
which prompts share its encoder call.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from common.diffusion.parts.text import HIDDEN, TextCond, TextPart
from common.diffusion.parts.condition import IMAGE_EMBEDS
from common.protocol.messages import PROMPT_EMBEDS, PROMPT_MASK
from common.protocol.tensor_field import FLOAT_DTYPES, INT_DTYPES, prompt_tensor
from common.diffusion.loading import load_component

# HunyuanVideo15Pipeline.__init__'s constants: the Qwen budget after the crop, the template's prefix, ByT5's budget.
TOKENIZER_MAX_LENGTH = 1000
PROMPT_TEMPLATE_CROP = 108
GLYPH_MAX_LENGTH = 256
MASK = "encoder_attention_mask"
HIDDEN_2, MASK_2 = "encoder_hidden_states_2", "encoder_attention_mask_2"
IMAGE = "image_embeds"  # the transformer's keyword (and the wire's name) for SigLIP's embeds
# ByT5's sequence of the quoted text [L2, D2] and the mask over its L2 tokens [L2] (1: attended).
GLYPH_EMBEDS = prompt_tensor("glyph_embeds", FLOAT_DTYPES, 2)
GLYPH_MASK = prompt_tensor("glyph_mask", INT_DTYPES, 1)


class HunyuanVideo15TextEncoder:
    """Qwen2.5-VL's language model and its tokenizer, ByT5 and its tokenizer, of one model directory."""

    def __init__(self, tokenizer, text_encoder, tokenizer_2, text_encoder_2):
        self.tokenizer, self.text_encoder = tokenizer, text_encoder
        self.tokenizer_2, self.text_encoder_2 = tokenizer_2, text_encoder_2
        self.device = text_encoder.device

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype, device) -> "HunyuanVideo15TextEncoder":
        import transformers

        path = Path(model_dir)

        def ready(m):
            return m.to(device).eval().requires_grad_(False)

        return cls(transformers.AutoTokenizer.from_pretrained(path / "tokenizer"),
                   ready(load_component(transformers.Qwen2_5_VLTextModel, path / "text_encoder", dtype)),
                   transformers.AutoTokenizer.from_pretrained(path / "tokenizer_2"),
                   ready(load_component(transformers.T5EncoderModel, path / "text_encoder_2", dtype)))

    @torch.no_grad()
    def wire_tensors(self, prompts: list[str], max_sequence_length: int) -> list[dict[str, torch.Tensor]]:
        """Each prompt's four tensors (the budget is the pipeline's fixed one: ``max_sequence_length`` is it)."""
        from diffusers import HunyuanVideo15Pipeline as Pipe

        embeds, mask = Pipe._get_mllm_prompt_embeds(
            text_encoder=self.text_encoder, tokenizer=self.tokenizer, prompt=prompts, device=self.device,
            tokenizer_max_length=TOKENIZER_MAX_LENGTH, crop_start=PROMPT_TEMPLATE_CROP)
        glyph, glyph_mask = Pipe._get_byt5_prompt_embeds(
            tokenizer=self.tokenizer_2, text_encoder=self.text_encoder_2, prompt=prompts, device=self.device,
            tokenizer_max_length=GLYPH_MAX_LENGTH)
        return [{PROMPT_EMBEDS.name: embeds[i], PROMPT_MASK.name: mask[i], GLYPH_EMBEDS.name: glyph[i],
                 GLYPH_MASK.name: glyph_mask[i]} for i in range(len(prompts))]


def load_text_encoder(info, dtype: torch.dtype, device) -> HunyuanVideo15TextEncoder:
    return HunyuanVideo15TextEncoder.load(info.path, dtype, device)


def example_text(info, model, max_sequence_length: int, generator, device, dtype) -> TextCond:
    """Random texts of the widths ``model`` (the transformer) reads, with full masks (compile warm-ups)."""
    cfg = model.config

    def rand(*shape):
        return torch.randn(1, *shape, generator=generator, device=device, dtype=dtype)

    ones = torch.ones
    return TextCond({HIDDEN: rand(TOKENIZER_MAX_LENGTH, cfg.text_embed_dim),
                     MASK: ones(1, TOKENIZER_MAX_LENGTH, device=device, dtype=dtype),
                     HIDDEN_2: rand(GLYPH_MAX_LENGTH, cfg.text_embed_2_dim),
                     MASK_2: ones(1, GLYPH_MAX_LENGTH, device=device, dtype=dtype)})


@dataclass(frozen=True, kw_only=True)
class HunyuanVideo15Text(TextPart):
    """The four wire tensors as the transformer's keywords, SigLIP's embeds beside them on image-to-video (the
    same for the conditional and the unconditional pass, as the pipeline runs them). Every text has the same
    shapes, so any texts share a forward."""

    fields: tuple = (PROMPT_EMBEDS, PROMPT_MASK, GLYPH_EMBEDS, GLYPH_MASK)
    keywords: tuple[str, ...] = (HIDDEN, MASK, HIDDEN_2, MASK_2)
    load_encoder: object = load_text_encoder
    example: object = example_text

    def conditioning(self, wire: dict[str, torch.Tensor], max_sequence_length: int) -> TextCond:
        tensors = {k: wire[f.name][None] for f, k in zip(self.fields, self.keywords)}
        embeds = wire.get(IMAGE_EMBEDS.name)
        if embeds is not None:  # [1, tokens, D]: one image
            tensors[IMAGE] = embeds.reshape(1, -1, embeds.shape[-1])
        return TextCond(tensors)

    def fixed_length(self, info) -> int | None:
        return TOKENIZER_MAX_LENGTH


TEXT = HunyuanVideo15Text()
