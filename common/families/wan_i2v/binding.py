"""Wan image-to-video (``WanImageToVideoPipeline``): Wan2.1 I2V (with a CLIP image encoder) and Wan2.2
I2V-A14B (without one, two experts).

- encoder: Wan's text side (:class:`~common.families.wan.binding.WanBinding`), plus the image side
  (:mod:`common.families.wan_i2v.image`): ``image_condition`` [4 + 16, F', H', W'] (the first-frame mask and
  the VAE latents of the image followed by empty frames, or of image ... last image) and, with CLIP,
  ``image_embeds`` [k, 257, D];
- denoise: the noise latents [16, F', H', W'] with the condition concatenated on the channel axis (36
  input channels), and the image embeds as the transformer's ``encoder_hidden_states_image`` beside each
  prompt's embeddings (the same for the conditional and the unconditional pass, as the pipeline runs them).
  The concatenated condition is a constant of the request, so a rollout's step is the same Gaussian step as
  text-to-video's, and trajectories carry the noise latents only;
- decode: Wan's VAE; schedule: the directory's (UniPC), rollouts flow-match Euler, as text-to-video.

A model whose transformer has ``image_dim`` takes a CLIP image encoder; with ``pos_embed_seq_len`` (the
first-last-frame model) it embeds a last image too. Models without CLIP take a last image through the
mask alone. ``expand_timesteps`` models (Wan2.2 TI2V-5B) are ``WanPipeline`` directories: see the Wan binding.
"""

from __future__ import annotations

import torch

from common.diffusion.binding import HIDDEN, TextCond
from common.families.wan.binding import WanBinding
from common.families.wan.text import MAX_SEQUENCE_LENGTH, pad_embeddings
from common.protocol.messages import IMAGE_CONDITION, IMAGE_EMBEDS, PROMPT_EMBEDS

IMAGE_HIDDEN = "encoder_hidden_states_image"  # the transformer's keyword for the image embeds


class WanImageToVideoBinding(WanBinding):
    family = "wan-i2v"
    pipeline = "WanImageToVideoPipeline"
    image_fields = (IMAGE_EMBEDS, IMAGE_CONDITION)
    image_text_fields = frozenset({IMAGE_EMBEDS.name})
    # TeaCache4Wan2.1's published polynomial for Wan2.1-I2V-14B-480P ("ret steps" mode, as Wan's).
    teacache_coefficients = (2.57151496e05, -3.54229917e04, 1.40286849e03, -1.35890334e01, 1.32517977e-01)
    teacache_source = "published: TeaCache4Wan2.1, fitted on Wan2.1-I2V-14B-480P"

    def image_input(self, info) -> str | None:
        return "required"

    def last_image_input(self, info) -> str | None:
        if info.expand_timesteps:  # the pipeline encodes frame 0 alone there
            return None
        if not _clip(info):  # the mask and the VAE latents alone say it (Wan2.2 I2V-A14B)
            return "optional"
        # Wan2.1 FLF2V's image embedder takes both images' CLIP tokens (pos_embed_seq_len); Wan2.1 I2V's one.
        return "required" if info.transformer_config.get("pos_embed_seq_len") else None

    def fixed_max_sequence_length(self, info) -> int | None:
        # diffusers' Wan attention with image keys takes the text as the last 512 tokens of its context.
        return MAX_SEQUENCE_LENGTH if _clip(info) else None

    def shares_text_for(self, info) -> bool:
        # The text-only cross-attention processors (shared_text.py) do not cover CLIP's image keys and values.
        return not _clip(info)

    def conditioning(self, wire: dict[str, torch.Tensor], max_sequence_length: int):
        text = pad_embeddings(wire[PROMPT_EMBEDS.name], max_sequence_length)
        embeds = wire.get(IMAGE_EMBEDS.name)
        if embeds is None:
            return text
        # One row's image tokens: [k, 257, D] -> [1, k * 257, D] (k = 2 with a last image).
        return TextCond({HIDDEN: text, IMAGE_HIDDEN: embeds.reshape(1, -1, embeds.shape[-1])})

    def model_latents(self, info, latents: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
        if info.expand_timesteps:
            return super().model_latents(info, latents, image)
        return torch.cat([latents, image.to(latents.dtype).expand(latents.shape[0], *image.shape[1:])], dim=1)

    def example_image(self, info, latent_shape, generator, device, dtype):
        if info.expand_timesteps:
            return super().example_image(info, latent_shape, generator, device, dtype)
        channels = info.transformer_config["in_channels"] - latent_shape[0]  # the mask's and the image's
        return torch.randn(1, channels, *latent_shape[1:], generator=generator, device=device, dtype=dtype)

    def forward(self, model, hidden_states, timestep, text, grid, guidance) -> torch.Tensor:
        text = dict(text)
        image = text.get(IMAGE_HIDDEN)
        tokens = model.config.pos_embed_seq_len
        if image is not None and tokens:  # the first-last-frame embedder takes [2B, 257, D] (its rows' pairs)
            text[IMAGE_HIDDEN] = image.reshape(-1, tokens // 2, image.shape[-1])
        return model(hidden_states=hidden_states, timestep=timestep, return_dict=False, **text)[0]

    def example_text(self, info, model, max_sequence_length: int, generator, device, dtype):
        text = super().example_text(info, model, max_sequence_length, generator, device, dtype)
        dim = model.config.image_dim
        if dim is None:
            return text
        image = torch.randn(1, _image_tokens(info), dim, generator=generator, device=device, dtype=dtype)
        return TextCond({HIDDEN: text, IMAGE_HIDDEN: image})


def _image_tokens(info) -> int:
    """CLIP's hidden states per image: its patches and the class token (ViT-H/14 at 224: 257)."""
    import json

    cfg = json.loads((info.path / "image_encoder" / "config.json").read_text())
    return (cfg["image_size"] // cfg["patch_size"]) ** 2 + 1


def _clip(info) -> bool:
    """The model embeds its image with a CLIP vision encoder (Wan2.1 I2V: the transformer has image_dim)."""
    return info.transformer_config.get("image_dim") is not None
