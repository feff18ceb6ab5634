"""What every built-in spec is: a frozen dataclass of sizes plus the request it serves, with the pipeline
class it builds and the fields written as its serving defaults; the sizes of the components several families
share (CLIP text, T5, ``AutoencoderKL``), each a dataclass mixed into their specs, and their checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

# How the safetensors files store the weights (they are generated in float32 either way; loaders cast to the
# dtype they ask for).
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")


def later_field(default):
    """A spec field added after cached models existed: part of the cache key only when it differs from
    ``default`` (see :func:`common.builtin.cache.keyed_fields`)."""
    return field(default=default, metadata={"keyed_if_set": True}, kw_only=True)


# The fields of the dataclasses below are keyword-only, so that a spec's own fields (its name first) may follow
# them and a spec may give them other defaults.
@dataclass(frozen=True, kw_only=True)
class BuiltinSpec:
    """The base of each family's spec dataclass. A subclass sets ``PIPELINE`` (the diffusers pipeline class
    name; or overrides :attr:`pipeline`) and ``SERVING_DEFAULT_KEYS`` (its fields written to
    ``serving_defaults.json``); its module defines ``components(spec)``, the pipeline's components."""

    PIPELINE: ClassVar[str] = ""
    SERVING_DEFAULT_KEYS: ClassVar[tuple[str, ...]] = ()

    # Every component's weights are drawn from this seed (common.builtin.build.seeded).
    seed: int = 0
    # How the safetensors files store the weights (they are generated in float32 either way; loaders cast to
    # the dtype they ask for); checked by check_weights_dtype.
    weights_dtype: str = "float32"
    # How the files are laid out, as downloaded checkpoints are (common/diffusion/loading.py): each component's
    # weights in shards of at most this size with an index ("64KB"; None: one file), and in files of this variant
    # only (``save_pretrained(variant="fp16")``'s ``*.fp16.safetensors``; None: plain names).
    max_shard_size: str | None = later_field(None)
    variant: str | None = later_field(None)

    @property
    def pipeline(self) -> str:
        return self.PIPELINE

    def build(self, out_dir: str | Path) -> Path:
        """Write this model's diffusers directory into ``out_dir`` and return it (the cache calls it)."""
        from common.builtin.build import build

        return build(self, out_dir)


def with_layout(spec, **layout):
    """``spec`` with other file-layout fields (``weights_dtype``, ``max_shard_size``, ``variant``), named after
    them; a ``-smooth`` built-in's base takes them (it stores its base's files)."""
    if hasattr(spec, "base"):
        return dataclasses.replace(spec, base=with_layout(spec.base, **layout))
    tags = [str(v).lower() for v in layout.values() if v is not None]
    return dataclasses.replace(spec, name="-".join([spec.name, *tags]), **layout)


def check_weights_dtype(spec) -> None:
    if spec.weights_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weights_dtype must be one of {WEIGHT_DTYPES}")


@dataclass(frozen=True, kw_only=True)
class ClipLSizes:
    """CLIP-L's sizes (``CLIPTextModel`` / ``CLIPTextModelWithProjection``, quick_gelu as
    openai/clip-vit-large-patch14); :func:`common.builtin.text_encoders.clip_sizes` reads them by prefix."""

    clip_l_hidden_size: int = 32
    clip_l_num_layers: int = 2
    clip_l_num_heads: int = 2
    clip_l_intermediate_size: int = 64


@dataclass(frozen=True, kw_only=True)
class T5Sizes:
    """A T5 encoder's sizes (``T5EncoderModel``, gated-gelu as t5-v1_1-xxl) and its unigram tokenizer's
    vocabulary; ``t5_d_model`` is the width the transformer reads; :func:`common.builtin.text_encoders.t5_sizes`
    reads them."""

    t5_d_model: int = 32
    t5_d_kv: int = 16
    t5_d_ff: int = 64
    t5_num_layers: int = 2
    t5_num_heads: int = 2
    t5_vocab_size: int = 256


@dataclass(frozen=True, kw_only=True)
class KLVaeSizes:
    """An ``AutoencoderKL``'s widths (:func:`common.builtin.vaes.autoencoder_kl`): one level per entry of
    ``vae_block_out_channels``."""

    vae_block_out_channels: tuple[int, ...] = (4, 4, 8, 8)
    vae_layers_per_block: int = 1
    vae_norm_num_groups: int = 4

    @property
    def vae_spatial_stride(self) -> int:
        """Pixels per latent pixel on a side: one halving per level after the first (four levels: 8x, as the
        real checkpoints'; the pipelines' ``vae_scale_factor``)."""
        return 2 ** (len(self.vae_block_out_channels) - 1)


def check_kl_vae(spec: KLVaeSizes) -> None:
    """An ``AutoencoderKL`` that downsamples (at least two levels)."""
    if len(spec.vae_block_out_channels) < 2:
        raise ValueError("vae_block_out_channels must have at least 2 entries (4: 8x downsampling, 3: 4x)")
    if spec.vae_norm_num_groups < 1 or any(c % spec.vae_norm_num_groups for c in spec.vae_block_out_channels):
        raise ValueError("every VAE width must be a multiple of vae_norm_num_groups")
    if spec.vae_layers_per_block < 1:
        raise ValueError("vae_layers_per_block must be >= 1")


def check_clip(spec, prefix: str) -> None:
    """The CLIP text encoder of ``spec``'s ``{prefix}_*`` sizes (as :class:`ClipLSizes`'s, and a projection)."""
    hidden, heads = getattr(spec, f"{prefix}_hidden_size"), getattr(spec, f"{prefix}_num_heads")
    others = (getattr(spec, f"{prefix}_{n}") for n in ("num_layers", "intermediate_size", "projection_dim"))
    if min(hidden, heads, *others) < 1 or hidden % heads:
        raise ValueError(f"{prefix}_hidden_size must be a positive multiple of {prefix}_num_heads")


def check_t5(spec: T5Sizes) -> None:
    """A T5 encoder and its unigram tokenizer's vocabulary."""
    from common.builtin.tokenizer.unigram import FIXED_TOKENS

    if min(spec.t5_d_model, spec.t5_d_kv, spec.t5_d_ff, spec.t5_num_layers, spec.t5_num_heads) < 1:
        raise ValueError("T5 sizes must be positive")
    if spec.t5_vocab_size <= FIXED_TOKENS:
        raise ValueError("t5_vocab_size too small for the T5 tokenizer's alphabet")
