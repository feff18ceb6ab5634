"""Tiny random-weight Stable Diffusion 3 / 3.5 text-to-image models in diffusers format.

The directories produced here have exactly the layout of a real SD3 diffusers checkpoint
(``model_index.json``, ``transformer/``, ``vae/``, ``scheduler/``, ``text_encoder/`` and
``tokenizer/`` for CLIP-L, ``text_encoder_2/`` and ``tokenizer_2/`` for CLIP-G, ``text_encoder_3/``
and ``tokenizer_3/`` for T5), plus ``serving_defaults.json``, so that ``StableDiffusion3Pipeline``
and the engine load them with their real ``from_pretrained`` code and no downloads.

Generation is deterministic: the same spec and library versions give byte-identical files.

The specs live in :mod:`common.families.sd3.tiny_specs` and the CLIP tokenizers in
:mod:`common.families.sd3.tiny_tokenizer`; the weight re-initialisation is the Wan builder's.

Usage::

    python -m common.families.sd3.tiny_model --name tiny-sd3 --out DIR [--dtype D]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from common.families.tiny_cache import save_built
from common.families.sd3.tiny_specs import SPECS, VAE_LEVELS, VAE_SPATIAL_STRIDE, TinySD3Spec
from common.families.sd3.tiny_tokenizer import CLIP_G_PAD_TOKEN, CLIP_L_PAD_TOKEN, build_clip_tokenizer
from common.families.wan.tiny_model import _seeded
from common.families.wan.tiny_specs import WEIGHT_DTYPES
from common.families.wan.tiny_tokenizer import build_tokenizer as build_t5_tokenizer

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel

__all__ = ["SPECS", "TinySD3Spec", "build_tiny_sd3"]

# Spec fields written to the model's serving-defaults file.
SERVING_DEFAULT_KEYS = ("height", "width", "num_inference_steps", "guidance_scale", "max_sequence_length")
# SD3.5's VAE latent normalisation (SD3.0 has the same scaling factor and shift).
VAE_SCALING_FACTOR = 1.5305
VAE_SHIFT_FACTOR = 0.0609
LATENT_CHANNELS = 16


def transformer_config(spec: TinySD3Spec) -> dict:
    """``SD3Transformer2DModel`` arguments for ``spec`` (SD3's, with the spec's sizes)."""
    return dict(
        sample_size=spec.sample_size,
        patch_size=spec.patch_size,
        in_channels=LATENT_CHANNELS,
        num_layers=spec.num_layers,
        attention_head_dim=spec.attention_head_dim,
        num_attention_heads=spec.num_attention_heads,
        joint_attention_dim=spec.joint_attention_dim,
        caption_projection_dim=spec.caption_projection_dim,
        pooled_projection_dim=spec.pooled_projection_dim,
        out_channels=LATENT_CHANNELS,
        pos_embed_max_size=spec.pos_embed_max_size,
        dual_attention_layers=spec.dual_attention_layers,
        qk_norm=spec.qk_norm,
    )


def vae_config(spec: TinySD3Spec) -> dict:
    """``AutoencoderKL`` arguments for ``spec``: SD3's VAE (16 channels, 8x, no quant convs), narrower."""
    return dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * VAE_LEVELS,
        up_block_types=("UpDecoderBlock2D",) * VAE_LEVELS,
        block_out_channels=spec.vae_block_out_channels,
        layers_per_block=spec.vae_layers_per_block,
        act_fn="silu",
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=spec.vae_norm_num_groups,
        sample_size=spec.sample_size * VAE_SPATIAL_STRIDE,  # in pixels
        scaling_factor=VAE_SCALING_FACTOR,
        shift_factor=VAE_SHIFT_FACTOR,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def clip_config(spec: TinySD3Spec, prefix: str, tokenizer: CLIPTokenizer) -> dict:
    """``CLIPTextConfig`` arguments of CLIP-L (``prefix`` "clip_l") or CLIP-G ("clip_g")."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=getattr(spec, f"{prefix}_hidden_size"),
        intermediate_size=getattr(spec, f"{prefix}_intermediate_size"),
        projection_dim=getattr(spec, f"{prefix}_projection_dim"),
        num_hidden_layers=getattr(spec, f"{prefix}_num_layers"),
        num_attention_heads=getattr(spec, f"{prefix}_num_heads"),
        max_position_embeddings=tokenizer.model_max_length,
        # As the real encoders: openai's CLIP-L uses quick_gelu, laion's bigG plain gelu.
        hidden_act="quick_gelu" if prefix == "clip_l" else "gelu",
        layer_norm_eps=1e-5,
        # The tokenizer's real ids; an eos id other than 2 makes the pooled output the first eos
        # position's (CLIP-L pads with eos, so the legacy argmax would also work, CLIP-G pads with "!").
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def t5_config(spec: TinySD3Spec) -> dict:
    """``T5Config`` arguments for ``spec``: t5-v1_1-xxl's structure (gated-gelu, 32 buckets / 128
    distance) with the spec's sizes."""
    return dict(
        vocab_size=spec.t5_vocab_size,
        d_model=spec.t5_d_model,
        d_kv=spec.t5_d_kv,
        d_ff=spec.t5_d_ff,
        num_layers=spec.t5_num_layers,
        num_heads=spec.t5_num_heads,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        layer_norm_epsilon=1e-6,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


def _build_transformer(spec: TinySD3Spec) -> SD3Transformer2DModel:
    from diffusers import SD3Transformer2DModel

    return _seeded(spec, "transformer", lambda: SD3Transformer2DModel(**transformer_config(spec)))


def _build_vae(spec: TinySD3Spec) -> AutoencoderKL:
    from diffusers import AutoencoderKL

    return _seeded(spec, "vae", lambda: AutoencoderKL(**vae_config(spec)))


def _build_clip(spec: TinySD3Spec, component: str, prefix: str,
                tokenizer: CLIPTokenizer) -> CLIPTextModelWithProjection:
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(**clip_config(spec, prefix, tokenizer))
    return _seeded(spec, component, lambda: CLIPTextModelWithProjection(config))


def _build_t5(spec: TinySD3Spec) -> T5EncoderModel:
    from transformers import T5Config, T5EncoderModel

    return _seeded(spec, "text_encoder_3", lambda: T5EncoderModel(T5Config(**t5_config(spec))))


def _build_scheduler(spec: TinySD3Spec) -> FlowMatchEulerDiscreteScheduler:
    from diffusers import FlowMatchEulerDiscreteScheduler

    # The scheduler SD3 / SD3.5 checkpoints ship with (static shift, no dynamic shifting).
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=spec.shift)


def build_tiny_sd3(spec: TinySD3Spec, out_dir: str | Path) -> Path:
    """Write the diffusers directory for ``spec`` into ``out_dir`` and return it."""
    from diffusers import StableDiffusion3Pipeline

    tokenizer = build_clip_tokenizer(CLIP_L_PAD_TOKEN)
    tokenizer_2 = build_clip_tokenizer(CLIP_G_PAD_TOKEN)
    return save_built(spec, lambda: StableDiffusion3Pipeline(
        transformer=_build_transformer(spec),
        scheduler=_build_scheduler(spec),
        vae=_build_vae(spec),
        text_encoder=_build_clip(spec, "text_encoder", "clip_l", tokenizer),
        tokenizer=tokenizer,
        text_encoder_2=_build_clip(spec, "text_encoder_2", "clip_g", tokenizer_2),
        tokenizer_2=tokenizer_2,
        text_encoder_3=_build_t5(spec),
        tokenizer_3=build_t5_tokenizer(spec.t5_vocab_size),
    ), out_dir, SERVING_DEFAULT_KEYS)


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="tiny-sd3", choices=sorted(SPECS))
    parser.add_argument("--out", type=Path, required=True, help="directory to write the model into")
    parser.add_argument("--dtype", choices=WEIGHT_DTYPES, default=None,
                        help="dtype the weights are stored in (default: the spec's)")
    args = parser.parse_args(argv)
    spec = SPECS[args.name]
    if args.dtype is not None:
        spec = dataclasses.replace(spec, weights_dtype=args.dtype)
    print(build_tiny_sd3(spec, args.out).resolve())


if __name__ == "__main__":
    _main()
