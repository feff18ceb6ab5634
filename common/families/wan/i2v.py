"""Wan image-to-video (``WanImageToVideoPipeline``): Wan2.1 I2V (with a CLIP image encoder) and Wan2.2
I2V-A14B (without one, two experts): Wan's parts (:mod:`.binding`) with an image condition.

- encoder: Wan's text side, plus the image side (:mod:`common.families.wan.image`): ``image_condition``
  [4 + 16, F', H', W'] (the first-frame mask and the VAE latents of the image followed by empty frames, or of
  image ... last image) and, with CLIP, ``image_embeds`` [k, 257, D];
- denoise: the noise latents [16, F', H', W'] with the condition concatenated on the channel axis (36
  input channels: :class:`~common.diffusion.parts.condition.ChannelConcat`), and the image embeds as the
  transformer's ``encoder_hidden_states_image`` beside each prompt's embeddings (the same for the conditional
  and the unconditional pass, as the pipeline runs them);
- decode: Wan's VAE; schedule: the directory's (UniPC), rollouts flow-match Euler, as text-to-video.

A model whose transformer has ``image_dim`` takes a CLIP image encoder; with ``pos_embed_seq_len`` (the
first-last-frame model) it embeds a last image too. Models without CLIP take a last image through the
mask alone. ``expand_timesteps`` models (Wan2.2 TI2V-5B) are ``WanPipeline`` directories; one saved under
this class serves text to video too (its image optional), as ``WanPipeline`` loads and runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from common.diffusion.parts.condition import IMAGE_CONDITION, IMAGE_EMBEDS, ChannelConcat
from common.diffusion.parts.text import HIDDEN, PaddedText, TextCond, pad_embeddings
from common.families.wan.binding import TEXT, WAN, image_tokens, load_image_conditioner
from common.families.wan.text import MAX_SEQUENCE_LENGTH
from common.families.wan.transformer import IMAGE_HIDDEN, WanTransformer, clip


@dataclass(frozen=True, kw_only=True)
class ImageEmbedsText(PaddedText):
    """Wan's padded text, with CLIP's image embeds beside it (``encoder_hidden_states_image``)."""

    def conditioning(self, wire: dict[str, torch.Tensor], max_sequence_length: int):
        text = pad_embeddings(wire[self.fields[0].name], max_sequence_length)
        embeds = wire.get(IMAGE_EMBEDS.name)
        if embeds is None:
            return text
        # One row's image tokens: [k, 257, D] -> [1, k * 257, D] (k = 2 with a last image).
        return TextCond({HIDDEN: text, IMAGE_HIDDEN: embeds.reshape(1, -1, embeds.shape[-1])})

    def fixed_length(self, info) -> int | None:
        # diffusers' Wan attention with image keys takes the text as the last 512 tokens of its context.
        return MAX_SEQUENCE_LENGTH if clip(info) else None


def last_image_input(info) -> str | None:
    if not clip(info):  # the mask and the VAE latents alone say it (Wan2.2 I2V-A14B)
        return "optional"
    # Wan2.1 FLF2V's image embedder takes both images' CLIP tokens (pos_embed_seq_len); Wan2.1 I2V's one.
    return "required" if info.transformer_config.get("pos_embed_seq_len") else None


def example_text(info, model, max_sequence_length: int, generator, device, dtype):
    """Wan's example text, with random image embeds on a CLIP model."""
    text = TEXT.example(info, model, max_sequence_length, generator, device, dtype)
    dim = model.config.image_dim
    if dim is None:
        return text
    image = torch.randn(1, image_tokens(info), dim, generator=generator, device=device, dtype=dtype)
    return TextCond({HIDDEN: text, IMAGE_HIDDEN: image})


WAN_I2V = replace(
    WAN, family="wan-i2v", pipeline="WanImageToVideoPipeline",
    text=ImageEmbedsText(fields=TEXT.fields, load_encoder=TEXT.load_encoder, example=example_text),
    # TeaCache4Wan2.1's published polynomial for Wan2.1-I2V-14B-480P ("ret steps" mode, as Wan's).
    transformer=WanTransformer(
        teacache_coefficients=(2.57151496e05, -3.54229917e04, 1.40286849e03, -1.35890334e01, 1.32517977e-01),
        teacache_source="published: TeaCache4Wan2.1, fitted on Wan2.1-I2V-14B-480P", teacache_warmup=5),
    condition=ChannelConcat(loader=load_image_conditioner, fields=(IMAGE_EMBEDS, IMAGE_CONDITION),
                            text_fields=frozenset({IMAGE_EMBEDS.name}), last_image=last_image_input))
