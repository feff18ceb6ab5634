"""Tiny random-weight Wan text-to-video models in diffusers format.

The directories produced here have exactly the layout of a real Wan2.1 T2V
diffusers checkpoint (``model_index.json``, ``tokenizer/``, ``text_encoder/``,
``transformer/``, ``vae/``, ``scheduler/``), optionally with a Wan2.2-style
second expert (``transformer_2/`` plus ``boundary_ratio``), so the engine and
the tests exercise the real ``from_pretrained`` loading code without any
downloadable weights.

Generation is deterministic: the same spec and library versions give
byte-identical files.

Besides the tiny specs there is ``wan2.1-1.3b``: a transformer and VAE of
exactly Wan2.1-T2V-1.3B's shape (random weights, stored in bfloat16) for
benchmarking on a GPU; see its comment in ``SPECS``.

The specs live in :mod:`common.families.wan.tiny_specs` and the tokenizer in
:mod:`common.families.wan.tiny_tokenizer`; this module caches and builds the models.

Usage::

    python -m common.families.wan.tiny_model [--name tiny] [--out DIR] [--cache-dir DIR] [--dtype D]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from common.families.wan.tiny_specs import SPECS, WEIGHT_DTYPES, TinyWanSpec
from common.families.wan.tiny_tokenizer import build_tokenizer

if TYPE_CHECKING:
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5EncoderModel

from common.families.tiny_cache import CACHE_ENV, DEFAULT_CACHE_DIR, _cache_key, _keyed_fields, save_built  # noqa: F401

__all__ = ["SPECS", "TinyWanSpec", "build_tiny_model", "ensure_tiny_model"]

# Spec fields written to the model's serving-defaults file.
SERVING_DEFAULT_KEYS = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")


def ensure_tiny_model(name="tiny", cache_dir: str | Path | None = None) -> Path:
    """The directory of built-in model ``name`` (any family's, or a spec), generated on first use:
    :func:`common.families.builtin.ensure_builtin`."""
    from common.families.builtin import ensure_builtin

    return ensure_builtin(name, cache_dir)


# --------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------


def _component_seed(spec: TinyWanSpec, component: str) -> int:
    digest = hashlib.sha256(f"{spec.seed}/{component}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _reinit_(module: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded normal noise.

    This makes the weights independent of the libraries' own init schemes
    (which change between versions and leave norm gains at exactly 1) and
    keeps activations O(1) through the stacks: matrices/kernels use
    std = 1/sqrt(fan_in), norm gains 1 + N(0, 0.1), other vectors
    N(0, 0.02). With a fixed std of 0.02 everywhere the decoded video is
    nearly flat and the prompt has no visible effect on it.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "gamma" or (param.ndim == 1 and leaf == "weight" and "norm" in name):
                param.copy_(1.0 + 0.1 * noise)
            elif param.ndim == 1:
                param.copy_(0.02 * noise)
            else:
                param.copy_(noise / math.sqrt(param[0].numel()))


def transformer_config(spec: TinyWanSpec) -> dict:
    """``WanTransformer3DModel`` arguments for ``spec`` (Wan2.1 T2V's, with the spec's sizes)."""
    return dict(
        patch_size=(1, 2, 2),
        num_attention_heads=spec.num_attention_heads,
        attention_head_dim=spec.attention_head_dim,
        in_channels=16,
        out_channels=16,
        text_dim=spec.text_dim,
        freq_dim=spec.freq_dim,
        ffn_dim=spec.ffn_dim,
        num_layers=spec.num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        image_dim=None,
        added_kv_proj_dim=None,
        rope_max_seq_len=spec.rope_max_seq_len,
    )


def vae_config(spec: TinyWanSpec) -> dict:
    """``AutoencoderKLWan`` arguments for ``spec``.

    Same strides as the real Wan VAE (8x spatial, 4x temporal, z_dim 16) and
    its default latents_mean/std; the tiny specs only shrink the widths.
    """
    return dict(
        base_dim=spec.vae_base_dim,
        z_dim=16,
        dim_mult=list(spec.vae_dim_mult),
        num_res_blocks=spec.vae_num_res_blocks,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        dropout=0.0,
    )


def _seeded(spec, component: str, make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``make()`` under the component's seed, then its weights overwritten from that seed (``_reinit_``); every
    family's tiny builder makes its components with it."""
    import torch

    seed = _component_seed(spec, component)
    torch.manual_seed(seed)
    model = make()
    _reinit_(model, seed)
    return model.eval()


def _build_transformer(spec: TinyWanSpec, component: str, config: dict | None = None) -> WanTransformer3DModel:
    """The ``component`` transformer of ``spec`` with ``config`` (default: ``transformer_config(spec)``)."""
    from diffusers import WanTransformer3DModel

    config = transformer_config(spec) if config is None else config
    return _seeded(spec, component, lambda: WanTransformer3DModel(**config))


def _build_vae(spec: TinyWanSpec, config: dict | None = None) -> AutoencoderKLWan:
    """The VAE of ``spec`` with ``config`` (default: ``vae_config(spec)``)."""
    from diffusers import AutoencoderKLWan

    config = vae_config(spec) if config is None else config
    return _seeded(spec, "vae", lambda: AutoencoderKLWan(**config))


def _text_encoder_config(spec: TinyWanSpec) -> dict:
    """``UMT5Config`` arguments for ``spec``: mirrors umt5-xxl as used by Wan (gated-gelu, 32 buckets / 128
    distance), with the spec's sizes."""
    return dict(
        vocab_size=spec.vocab_size,
        d_model=spec.text_dim,
        d_kv=spec.text_d_kv,
        d_ff=spec.text_d_ff,
        num_layers=spec.text_layers,
        num_heads=spec.text_heads,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        layer_norm_epsilon=1e-6,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


def _build_text_encoder(spec: TinyWanSpec) -> UMT5EncoderModel:
    from transformers import UMT5Config, UMT5EncoderModel

    return _seeded(spec, "text_encoder", lambda: UMT5EncoderModel(UMT5Config(**_text_encoder_config(spec))))


def _build_scheduler(spec: TinyWanSpec) -> UniPCMultistepScheduler:
    from diffusers import UniPCMultistepScheduler

    # The scheduler Wan2.1/2.2 diffusers checkpoints ship with.
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        num_train_timesteps=1000,
        flow_shift=spec.flow_shift,
    )


def build_tiny_model(spec: TinyWanSpec, out_dir: str | Path) -> Path:
    """Write the diffusers directory for ``spec`` into ``out_dir`` and return it."""
    from diffusers import WanPipeline

    return save_built(spec, lambda: WanPipeline(
        tokenizer=build_tokenizer(spec.vocab_size),
        text_encoder=_build_text_encoder(spec),
        vae=_build_vae(spec),
        scheduler=_build_scheduler(spec),
        transformer=_build_transformer(spec, "transformer"),
        transformer_2=_build_transformer(spec, "transformer_2") if spec.two_experts else None,
        boundary_ratio=spec.boundary_ratio,
    ), out_dir, SERVING_DEFAULT_KEYS)


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="tiny", choices=sorted(SPECS))
    parser.add_argument("--out", type=Path, default=None,
                        help="write the model into this directory instead of the cache")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"cache root (default: ${CACHE_ENV} or {DEFAULT_CACHE_DIR})")
    parser.add_argument("--dtype", choices=WEIGHT_DTYPES, default=None,
                        help="dtype the weights are stored in (default: the spec's; "
                             "a different one is cached separately)")
    args = parser.parse_args(argv)
    spec = SPECS[args.name]
    if args.dtype is not None:
        spec = dataclasses.replace(spec, weights_dtype=args.dtype)
    if args.out is not None:
        path = build_tiny_model(spec, args.out)
    else:
        path = ensure_tiny_model(spec, args.cache_dir)
    print(path.resolve())


if __name__ == "__main__":
    _main()