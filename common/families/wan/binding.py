"""Wan text-to-video (``WanPipeline``): Wan2.1, and Wan2.2 with two experts.

- encoder: the tokenizer and UMT5 (:mod:`common.families.wan.text`); a prompt travels as its trimmed
  embeddings ``prompt_embeds`` [L, D], zero-padded back to ``max_sequence_length`` on the denoise worker;
- denoise: ``WanTransformer3DModel`` (``transformer``, and ``transformer_2`` with ``boundary_ratio``: the
  :class:`~common.diffusion.parts.experts.BoundarySplit` experts),
  called with ``encoder_hidden_states``; guidance as two forwards, as ``WanPipeline`` runs it; the
  cross-attention's text side is shared by the rows of one text; diffusers' context-parallel plan;
- decode: ``AutoencoderKLWan`` with ``latents_mean`` / ``latents_std``;
- latents ``(1, 16, (F - 1) // 4 + 1, H / 8, W / 8)``; serving UniPC (flow prediction), rollout Euler;
- Wan2.2 TI2V-5B (``expand_timesteps`` in ``model_index.json``): a 48-channel VAE with 16x spatial
  compression, a timestep per latent token, and an optional ``image``: frame 0 from the image's latent
  (:class:`~common.diffusion.parts.condition.FirstFrame`), as ``WanImageToVideoPipeline`` does on such a model.

Image to video (``WanImageToVideoPipeline``) is the same parts with an image condition: :mod:`.i2v`.
"""

from __future__ import annotations

import json

import torch

from common.diffusion.binding import Binding
from common.diffusion.parts.condition import FirstFrame
from common.diffusion.parts.experts import GUIDANCE_SCALE_2, BoundarySplit
from common.diffusion.parts.latents import Geometry, LatentsPart, vae_config
from common.diffusion.parts.text import PaddedText
from common.diffusion.vae_tiling import VaeTiling
from common.diffusion.request_fields import NUM_FRAMES, max_sequence_length
from common.families.wan.text import MAX_SEQUENCE_LENGTH, WanTextEncoder
from common.families.wan.transformer import WanTransformer
from common.families.wan.vae import WanDecoder
from common.protocol.messages import PROMPT_EMBEDS

# WanPipeline's own defaults (480p).
DEFAULTS = {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50, "guidance_scale": 5.0,
            "max_sequence_length": MAX_SEQUENCE_LENGTH}
FIELDS = (NUM_FRAMES, GUIDANCE_SCALE_2, max_sequence_length())


def geometry(path, transformer_config: dict) -> Geometry:
    vcfg = vae_config(path)
    # AutoencoderKLWan stores its strides in the config; Wan2.1's VAE uses 8 and 4.
    # The noise's channels: the transformer's output (image-to-video inputs add condition channels).
    channels = transformer_config.get("out_channels") or transformer_config.get("in_channels", 16)
    return Geometry(latent_channels=int(channels), vae_scale_spatial=int(vcfg.get("scale_factor_spatial", 8)),
                    vae_scale_temporal=int(vcfg.get("scale_factor_temporal", 4)),
                    patch_size=tuple(transformer_config.get("patch_size", (1, 2, 2))))


def load_text_encoder(info, dtype: torch.dtype, device) -> WanTextEncoder:
    return WanTextEncoder.load(info.path, dtype, device)


def example_text(info, model, max_sequence_length: int, generator, device, dtype) -> torch.Tensor:
    return torch.randn(1, max_sequence_length, model.config.text_dim, generator=generator, device=device,
                       dtype=dtype)


def load_image_conditioner(info, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()):
    from common.families.wan.image import WanImageConditioner

    return WanImageConditioner.load(info.path, dtype, device, expand_timesteps=info.expand_timesteps,
                                    image_encoder=info.has_component("image_encoder"), tiling=tiling)


def image_tokens(info) -> int:
    """CLIP's hidden states per image: its patches and the class token (ViT-H/14 at 224: 257)."""
    cfg = json.loads((info.path / "image_encoder" / "config.json").read_text())
    return (cfg["image_size"] // cfg["patch_size"]) ** 2 + 1


TEXT = PaddedText(fields=(PROMPT_EMBEDS,), load_encoder=load_text_encoder, example=example_text)
LATENTS = LatentsPart(geometry=geometry, video=True)

WAN = Binding(
    family="wan", pipeline="WanPipeline", words=("wan",), text=TEXT, latents=LATENTS, decoder=WanDecoder, experts=BoundarySplit(),
    # TeaCache4Wan2.1's published polynomial for Wan2.1-T2V-1.3B on the 6 x D timestep projection (its
    # "ret steps" mode: the first 5 steps always computed).
    transformer=WanTransformer(
        teacache_coefficients=(-5.21862437e04, 9.23041404e03, -5.28275948e02, 1.36987616e01, -4.99875664e-02),
        teacache_source="published: TeaCache4Wan2.1, fitted on Wan2.1-T2V-1.3B", teacache_warmup=5),
    condition=FirstFrame(loader=load_image_conditioner),  # expand_timesteps models (TI2V) only
    fps=16,  # Wan2.1 / Wan2.2 text-to-video models make 16 frames per second (diffusers' examples export at 16)
    size_multiple=16,  # WanPipeline.check_inputs, whatever the VAE (then floored to its scale times the patches)
    defaults=DEFAULTS, request_fields=FIELDS)
