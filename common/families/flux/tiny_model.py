"""Tiny random-weight FLUX.1 text-to-image models in diffusers format.

The directories produced here have exactly the layout of a real FLUX.1 diffusers checkpoint
(``model_index.json``, ``transformer/``, ``vae/``, ``scheduler/``, ``text_encoder/`` and ``tokenizer/``
for CLIP-L, ``text_encoder_2/`` and ``tokenizer_2/`` for T5), plus ``serving_defaults.json``, so that
``FluxPipeline`` and the engine load them with their real ``from_pretrained`` code and no downloads.

Generation is deterministic: the same spec and library versions give byte-identical files.

The specs live in :mod:`common.families.flux.tiny_specs`; the CLIP tokenizer is SD3's CLIP-L one
(:mod:`common.families.sd3.tiny_tokenizer`), the T5 tokenizer and the weight re-initialisation are the
Wan builder's.

Usage::

    python -m common.families.flux.tiny_model --name tiny-flux --out DIR [--dtype D]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from common.families.flux.tiny_specs import PACK_SIZE, SPECS, VAE_LEVELS, VAE_SPATIAL_STRIDE, TinyFluxSpec
from common.families.sd3.tiny_tokenizer import CLIP_L_PAD_TOKEN, build_clip_tokenizer
from common.families.tiny_cache import save_built
from common.families.wan.tiny_model import _seeded
from common.families.wan.tiny_specs import WEIGHT_DTYPES
from common.families.wan.tiny_tokenizer import build_tokenizer as build_t5_tokenizer

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel

__all__ = ["SPECS", "TinyFluxSpec", "build_tiny_flux"]

# Spec fields written to the model's serving-defaults file.
SERVING_DEFAULT_KEYS = ("height", "width", "num_inference_steps", "guidance_scale", "true_cfg_scale",
                        "max_sequence_length")
# FLUX.1's VAE latent normalisation.
VAE_SCALING_FACTOR = 0.3611
VAE_SHIFT_FACTOR = 0.1159
LATENT_CHANNELS = 16
# FluxPipeline.default_sample_size: its default image side is this many latent pixels.
DEFAULT_SAMPLE_SIZE = 128


def transformer_config(spec: TinyFluxSpec) -> dict:
    """``FluxTransformer2DModel`` arguments for ``spec`` (FLUX.1-dev's, with the spec's sizes)."""
    return dict(
        # The pipeline packs 2x2 latent patches into channels, so the transformer's own patch is 1.
        patch_size=1,
        in_channels=LATENT_CHANNELS * PACK_SIZE * PACK_SIZE,
        out_channels=None,
        num_layers=spec.num_layers,
        num_single_layers=spec.num_single_layers,
        attention_head_dim=spec.attention_head_dim,
        num_attention_heads=spec.num_attention_heads,
        joint_attention_dim=spec.joint_attention_dim,
        pooled_projection_dim=spec.pooled_projection_dim,
        guidance_embeds=spec.guidance_embeds,
        axes_dims_rope=spec.axes_dims_rope,
    )


def vae_config(spec: TinyFluxSpec) -> dict:
    """``AutoencoderKL`` arguments for ``spec``: FLUX's VAE (16 channels, 8x, no quant convs), narrower."""
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
        sample_size=DEFAULT_SAMPLE_SIZE * VAE_SPATIAL_STRIDE,  # in pixels, as FLUX.1's 1024
        scaling_factor=VAE_SCALING_FACTOR,
        shift_factor=VAE_SHIFT_FACTOR,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def clip_config(spec: TinyFluxSpec, tokenizer: CLIPTokenizer) -> dict:
    """``CLIPTextConfig`` arguments of CLIP-L."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.clip_l_hidden_size,
        intermediate_size=spec.clip_l_intermediate_size,
        # CLIPTextModel has no projection; the config carries one anyway, as CLIP-L's does (= hidden size).
        projection_dim=spec.clip_l_hidden_size,
        num_hidden_layers=spec.clip_l_num_layers,
        num_attention_heads=spec.clip_l_num_heads,
        max_position_embeddings=tokenizer.model_max_length,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
        # The tokenizer's real ids; an eos id other than 2 makes the pooled output the first eos position's.
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def t5_config(spec: TinyFluxSpec) -> dict:
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


def scheduler_config(spec: TinyFluxSpec) -> dict:
    """``FlowMatchEulerDiscreteScheduler`` arguments: FLUX.1-dev's (dynamic shifting by image size)."""
    return dict(
        num_train_timesteps=1000,
        shift=spec.shift,
        use_dynamic_shifting=spec.use_dynamic_shifting,
        base_shift=spec.base_shift,
        max_shift=spec.max_shift,
        base_image_seq_len=spec.base_image_seq_len,
        max_image_seq_len=spec.max_image_seq_len,
    )


def _build_transformer(spec: TinyFluxSpec) -> FluxTransformer2DModel:
    from diffusers import FluxTransformer2DModel

    return _seeded(spec, "transformer", lambda: FluxTransformer2DModel(**transformer_config(spec)))


def _build_vae(spec: TinyFluxSpec) -> AutoencoderKL:
    from diffusers import AutoencoderKL

    return _seeded(spec, "vae", lambda: AutoencoderKL(**vae_config(spec)))


def _build_clip(spec: TinyFluxSpec, tokenizer: CLIPTokenizer) -> CLIPTextModel:
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(**clip_config(spec, tokenizer))
    return _seeded(spec, "text_encoder", lambda: CLIPTextModel(config))


def _build_t5(spec: TinyFluxSpec) -> T5EncoderModel:
    from transformers import T5Config, T5EncoderModel

    return _seeded(spec, "text_encoder_2", lambda: T5EncoderModel(T5Config(**t5_config(spec))))


def _build_scheduler(spec: TinyFluxSpec) -> FlowMatchEulerDiscreteScheduler:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**scheduler_config(spec))


def build_tiny_flux(spec: TinyFluxSpec, out_dir: str | Path, dtype: str | None = None) -> Path:
    """Write the diffusers directory for ``spec`` into ``out_dir`` and return it; ``dtype`` (one of
    ``WEIGHT_DTYPES``) overrides the spec's ``weights_dtype``."""
    from diffusers import FluxPipeline

    if dtype is not None:
        spec = dataclasses.replace(spec, weights_dtype=dtype)
    tokenizer = build_clip_tokenizer(CLIP_L_PAD_TOKEN)
    return save_built(spec, lambda: FluxPipeline(
        scheduler=_build_scheduler(spec),
        vae=_build_vae(spec),
        text_encoder=_build_clip(spec, tokenizer),
        tokenizer=tokenizer,
        text_encoder_2=_build_t5(spec),
        tokenizer_2=build_t5_tokenizer(spec.t5_vocab_size),
        transformer=_build_transformer(spec),
    ), out_dir, SERVING_DEFAULT_KEYS)


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="tiny-flux", choices=sorted(SPECS))
    parser.add_argument("--out", type=Path, required=True, help="directory to write the model into")
    parser.add_argument("--dtype", choices=WEIGHT_DTYPES, default=None,
                        help="dtype the weights are stored in (default: the spec's)")
    args = parser.parse_args(argv)
    print(build_tiny_flux(SPECS[args.name], args.out, args.dtype).resolve())


if __name__ == "__main__":
    _main()
