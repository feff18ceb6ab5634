"""Tiny random-weight Wan image-to-video models in diffusers format.

The directories produced here have the layouts of the real diffusers checkpoints (see
:mod:`common.families.wan_i2v.tiny_specs`), written by the pipelines' own ``save_pretrained``:

- Wan2.1 I2V: ``WanImageToVideoPipeline`` with ``tokenizer/``, ``text_encoder/``, ``image_encoder/``
  (``CLIPVisionModel``), ``image_processor/`` (``CLIPImageProcessor``), ``transformer/``, ``vae/`` and
  ``scheduler/``;
- Wan2.2 I2V-A14B: ``WanImageToVideoPipeline`` with ``transformer_2/`` and ``boundary_ratio``, the image
  encoder and processor saved as null components;
- Wan2.2 TI2V-5B: ``WanPipeline`` with ``expand_timesteps`` and the Wan2.2 VAE;

plus ``serving_defaults.json``. The text encoder, tokenizer, scheduler, transformer and the weights'
re-initialisation are the Wan text-to-video builder's (:mod:`common.families.wan.tiny_model`).

Generation is deterministic: the same spec and library versions give byte-identical files.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from common.families.tiny_cache import save_built
from common.families.wan.tiny_model import (
    SERVING_DEFAULT_KEYS,
    _build_scheduler,
    _build_text_encoder,
    _build_transformer,
    _build_vae,
    _seeded,
    transformer_config as wan_transformer_config,
    vae_config as wan_vae_config,
)
from common.families.wan.tiny_tokenizer import build_tokenizer
from common.families.wan_i2v.tiny_specs import (
    SPECS,
    VAE_CONV_STRIDE,
    VAE_PATCH_SIZE,
    VAE_TEMPORAL_STRIDE,
    TinyWanI2VSpec,
)

if TYPE_CHECKING:
    from transformers import CLIPImageProcessor, CLIPVisionModel

__all__ = ["SPECS", "TinyWanI2VSpec", "build_tiny_wan_i2v", "transformer_config", "vae_config"]

# The Wan2.2 VAE's latent normalisation (Wan2.2-TI2V-5B-Diffusers' vae/config.json).
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)
# How model_index.json names the image processor, as the real checkpoint does. The processor is built as
# transformers' PIL implementation of it (CLIPImageProcessor itself is the torchvision one when torchvision
# is installed), so the saved files do not depend on whether it is; loading CLIPImageProcessor reads them.
IMAGE_PROCESSOR_ENTRY = ("transformers", "CLIPImageProcessor")


def transformer_config(spec: TinyWanI2VSpec) -> dict:
    """``WanTransformer3DModel`` arguments for ``spec``: Wan's, with the image-to-video channels and, with an
    image encoder, its states projected into the cross-attention's added key/value (``added_kv_proj_dim``, the
    inner width, as Wan2.1 I2V)."""
    inner_dim = spec.num_attention_heads * spec.attention_head_dim
    return wan_transformer_config(spec) | dict(
        in_channels=spec.transformer_in_channels,
        out_channels=spec.vae_z_dim,
        image_dim=spec.vision_hidden_size if spec.image_encoder else None,
        added_kv_proj_dim=inner_dim if spec.image_encoder else None,
    ) | ({"pos_embed_seq_len": 2 * spec.image_tokens} if spec.first_last_frame else {})


def vae_config(spec: TinyWanI2VSpec) -> dict:
    """``AutoencoderKLWan`` arguments for ``spec``: Wan2.1's (the Wan builder's) or Wan2.2's (48 latent
    channels, residual blocks, a 2x2 patchify of the 3 colour channels in front: 12 in and out, 16x spatial,
    and its latent statistics), with the spec's widths."""
    config = wan_vae_config(spec)
    if spec.vae_decoder_base_dim is not None:
        config["decoder_base_dim"] = spec.vae_decoder_base_dim
    patch = VAE_PATCH_SIZE[spec.vae_layout]
    if patch is None:
        return config
    return config | dict(
        z_dim=spec.vae_z_dim,
        is_residual=True,
        in_channels=3 * patch * patch,
        out_channels=3 * patch * patch,
        patch_size=patch,
        scale_factor_temporal=VAE_TEMPORAL_STRIDE,
        scale_factor_spatial=VAE_CONV_STRIDE * patch,
        latents_mean=list(WAN22_LATENTS_MEAN),
        latents_std=list(WAN22_LATENTS_STD),
    )


def vision_config(spec: TinyWanI2VSpec) -> dict:
    """``CLIPVisionConfig`` arguments for ``spec``: open-clip ViT-H/14's kind (gelu, eps 1e-5), the spec's sizes."""
    return dict(
        hidden_size=spec.vision_hidden_size,
        intermediate_size=spec.vision_intermediate_size,
        projection_dim=spec.vision_hidden_size,  # unused by CLIPVisionModel
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.vision_image_size,
        patch_size=spec.vision_patch_size,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
    )


def _build_image_encoder(spec: TinyWanI2VSpec) -> CLIPVisionModel:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    return _seeded(spec, "image_encoder", lambda: CLIPVisionModel(CLIPVisionConfig(**vision_config(spec))))


def _build_image_processor(spec: TinyWanI2VSpec) -> CLIPImageProcessor:
    from transformers import CLIPImageProcessorPil

    # CLIP's own preprocessing (bicubic resize of the shorter side, center crop, OpenAI mean/std) at the
    # encoder's image size.
    side = spec.vision_image_size
    return CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})


def build_tiny_wan_i2v(spec: TinyWanI2VSpec, out_dir: str | Path) -> Path:
    """Write the diffusers directory for ``spec`` into ``out_dir`` and return it."""

    def make_pipeline():
        from diffusers import WanImageToVideoPipeline, WanPipeline

        config = transformer_config(spec)
        components = dict(
            tokenizer=build_tokenizer(spec.vocab_size),
            text_encoder=_build_text_encoder(spec),
            vae=_build_vae(spec, vae_config(spec)),
            scheduler=_build_scheduler(spec),
            transformer=_build_transformer(spec, "transformer", config),
            transformer_2=_build_transformer(spec, "transformer_2", config) if spec.two_experts else None,
            boundary_ratio=spec.boundary_ratio,
            expand_timesteps=spec.expand_timesteps,
        )
        if spec.expand_timesteps:
            return WanPipeline(**components)
        if not spec.image_encoder:
            return WanImageToVideoPipeline(**components)
        pipe = WanImageToVideoPipeline(**components, image_encoder=_build_image_encoder(spec),
                                       image_processor=_build_image_processor(spec))
        pipe.register_to_config(image_processor=IMAGE_PROCESSOR_ENTRY)
        return pipe

    return save_built(spec, make_pipeline, out_dir, SERVING_DEFAULT_KEYS)
