"""Tiny random-weight Qwen-Image text-to-image models in diffusers format.

The directories produced here have exactly the layout of a real Qwen-Image diffusers checkpoint
(``model_index.json`` naming ``QwenImagePipeline``, ``transformer/``, ``vae/``, ``scheduler/``,
``text_encoder/`` holding a Qwen2.5-VL model and ``tokenizer/`` a Qwen2 tokenizer), plus
``serving_defaults.json``, so that ``QwenImagePipeline`` and the engine load them with their real
``from_pretrained`` code and no downloads.

Generation is deterministic: the same spec and library versions give byte-identical files.

The specs live in :mod:`common.families.qwen_image.tiny_specs` and the tokenizer in
:mod:`common.families.qwen_image.tiny_tokenizer`; the weight re-initialisation is the Wan builder's.

Usage::

    python -m common.families.qwen_image.tiny_model --name tiny-qwen-image --out DIR [--dtype D]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from common.families.qwen_image.tiny_specs import (
    LATENT_CHANNELS,
    LATENTS_MEAN,
    LATENTS_STD,
    PATCH_SIZE,
    SCHEDULER_CONFIG,
    SPECS,
    VAE_TEMPORAL_DOWNSAMPLE,
    TinyQwenImageSpec,
)
from common.families.qwen_image.tiny_tokenizer import (
    ENDOFTEXT_TOKEN,
    IMAGE_PAD_TOKEN,
    IM_END_TOKEN,
    VIDEO_PAD_TOKEN,
    VISION_START_TOKEN,
    VISION_END_TOKEN,
    build_tokenizer,
)
from common.families.tiny_cache import save_built
from common.families.wan.tiny_model import _seeded
from common.families.wan.tiny_specs import WEIGHT_DTYPES

if TYPE_CHECKING:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

__all__ = ["SPECS", "TinyQwenImageSpec", "build_tiny_qwen_image"]

# Spec fields written to the model's serving-defaults file.
SERVING_DEFAULT_KEYS = ("height", "width", "num_inference_steps", "true_cfg_scale", "max_sequence_length")
# Qwen2.5-VL's language-model constants (rotary base, norm epsilon, context length).
TEXT_ROPE_THETA = 1000000.0
TEXT_RMS_NORM_EPS = 1e-6
TEXT_MAX_POSITION_EMBEDDINGS = 128000
# Qwen2.5-VL's vision tower layout: 14 px patches, 2 frames per patch, 2x2 merge, 112 px attention windows.
VISION_PATCH_SIZE = 14
VISION_TEMPORAL_PATCH_SIZE = 2
VISION_SPATIAL_MERGE_SIZE = 2
VISION_WINDOW_SIZE = 112
VISION_TOKENS_PER_SECOND = 2


def transformer_config(spec: TinyQwenImageSpec) -> dict:
    """``QwenImageTransformer2DModel`` arguments for ``spec`` (Qwen-Image's, with the spec's sizes)."""
    return dict(
        patch_size=PATCH_SIZE,
        in_channels=LATENT_CHANNELS * PATCH_SIZE * PATCH_SIZE,
        out_channels=LATENT_CHANNELS,
        num_layers=spec.num_layers,
        attention_head_dim=spec.attention_head_dim,
        num_attention_heads=spec.num_attention_heads,
        joint_attention_dim=spec.joint_attention_dim,
        guidance_embeds=False,
        axes_dims_rope=spec.axes_dims_rope,
    )


def vae_config(spec: TinyQwenImageSpec) -> dict:
    """``AutoencoderKLQwenImage`` arguments for ``spec``: Qwen-Image's VAE (16 channels, 8x, its latent
    statistics), narrower."""
    return dict(
        base_dim=spec.vae_base_dim,
        z_dim=LATENT_CHANNELS,
        dim_mult=list(spec.vae_dim_mult),
        num_res_blocks=spec.vae_num_res_blocks,
        attn_scales=[],
        temperal_downsample=list(VAE_TEMPORAL_DOWNSAMPLE),
        dropout=0.0,
        latents_mean=list(LATENTS_MEAN),
        latents_std=list(LATENTS_STD),
    )


def text_encoder_config(spec: TinyQwenImageSpec, tokenizer: Qwen2Tokenizer) -> dict:
    """``Qwen2_5_VLConfig`` arguments for ``spec``: Qwen2.5-VL-7B-Instruct's structure (GQA, multimodal RoPE,
    untied head, windowed vision tower) with the spec's sizes and the tokenizer's ids."""
    ids = tokenizer.convert_tokens_to_ids
    return dict(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=spec.text_hidden_size,
            intermediate_size=spec.text_intermediate_size,
            num_hidden_layers=spec.text_num_layers,
            num_attention_heads=spec.text_num_heads,
            num_key_value_heads=spec.text_num_kv_heads,
            hidden_act="silu",
            max_position_embeddings=TEXT_MAX_POSITION_EMBEDDINGS,
            rms_norm_eps=TEXT_RMS_NORM_EPS,
            use_sliding_window=False,
            max_window_layers=spec.text_num_layers,
            attention_dropout=0.0,
            rope_parameters=dict(rope_type="default", rope_theta=TEXT_ROPE_THETA,
                                 mrope_section=list(spec.mrope_section)),
            bos_token_id=ids(ENDOFTEXT_TOKEN),
            eos_token_id=ids(IM_END_TOKEN),
        ),
        vision_config=dict(
            depth=spec.vision_depth,
            hidden_size=spec.vision_hidden_size,
            intermediate_size=spec.vision_intermediate_size,
            num_heads=spec.vision_num_heads,
            hidden_act="silu",
            in_channels=3,
            patch_size=VISION_PATCH_SIZE,
            spatial_merge_size=VISION_SPATIAL_MERGE_SIZE,
            temporal_patch_size=VISION_TEMPORAL_PATCH_SIZE,
            tokens_per_second=VISION_TOKENS_PER_SECOND,
            window_size=VISION_WINDOW_SIZE,
            out_hidden_size=spec.text_hidden_size,
            # As the 7B tower's (7, 15, 23, 31) of 32: full attention in the last block of each quarter.
            fullatt_block_indexes=sorted({max(0, (spec.vision_depth * q) // 4 - 1) for q in (1, 2, 3, 4)}),
        ),
        image_token_id=ids(IMAGE_PAD_TOKEN),
        video_token_id=ids(VIDEO_PAD_TOKEN),
        vision_start_token_id=ids(VISION_START_TOKEN),
        vision_end_token_id=ids(VISION_END_TOKEN),
        tie_word_embeddings=False,
    )


def _build_transformer(spec: TinyQwenImageSpec) -> QwenImageTransformer2DModel:
    from diffusers import QwenImageTransformer2DModel

    return _seeded(spec, "transformer", lambda: QwenImageTransformer2DModel(**transformer_config(spec)))


def _build_vae(spec: TinyQwenImageSpec) -> AutoencoderKLQwenImage:
    from diffusers import AutoencoderKLQwenImage

    return _seeded(spec, "vae", lambda: AutoencoderKLQwenImage(**vae_config(spec)))


def _build_text_encoder(spec: TinyQwenImageSpec, tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(**text_encoder_config(spec, tokenizer))
    return _seeded(spec, "text_encoder", lambda: Qwen2_5_VLForConditionalGeneration(config))


def _build_scheduler() -> FlowMatchEulerDiscreteScheduler:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


def build_tiny_qwen_image(spec: TinyQwenImageSpec, out_dir: str | Path, dtype: str | None = None) -> Path:
    """Write the diffusers directory for ``spec`` into ``out_dir`` and return it; ``dtype`` (one of
    ``WEIGHT_DTYPES``) overrides the spec's ``weights_dtype``."""
    from diffusers import QwenImagePipeline

    if dtype is not None:
        spec = dataclasses.replace(spec, weights_dtype=dtype)
    tokenizer = build_tokenizer()
    return save_built(spec, lambda: QwenImagePipeline(
        transformer=_build_transformer(spec),
        vae=_build_vae(spec),
        scheduler=_build_scheduler(),
        text_encoder=_build_text_encoder(spec, tokenizer),
        tokenizer=tokenizer,
    ), out_dir, SERVING_DEFAULT_KEYS)


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="tiny-qwen-image", choices=sorted(SPECS))
    parser.add_argument("--out", type=Path, required=True, help="directory to write the model into")
    parser.add_argument("--dtype", choices=WEIGHT_DTYPES, default=None,
                        help="dtype the weights are stored in (default: the spec's)")
    args = parser.parse_args(argv)
    print(build_tiny_qwen_image(SPECS[args.name], args.out, args.dtype).resolve())


if __name__ == "__main__":
    _main()
