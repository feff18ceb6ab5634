"""What every built-in spec is: a frozen dataclass of sizes plus the request it serves, with the pipeline
class it builds and the fields written as its serving defaults; the checks several families share."""

from __future__ import annotations

from dataclasses import field
from pathlib import Path

# How the safetensors files store the weights (they are generated in float32 either way; loaders cast to the
# dtype they ask for).
WEIGHT_DTYPES = ("float32", "bfloat16")


def later_field(default):
    """A spec field added after cached models existed: part of the cache key only when it differs from
    ``default`` (see :func:`common.builtin.cache.keyed_fields`)."""
    return field(default=default, metadata={"keyed_if_set": True})


class BuiltinSpec:
    """Mixed into each family's spec dataclass. A subclass sets ``PIPELINE`` (the diffusers pipeline class
    name; or overrides :attr:`pipeline`) and ``SERVING_DEFAULT_KEYS`` (its fields written to
    ``serving_defaults.json``); its module defines ``components(spec)``, the pipeline's components."""

    PIPELINE = ""
    SERVING_DEFAULT_KEYS: tuple[str, ...] = ()

    @property
    def pipeline(self) -> str:
        return self.PIPELINE

    def build(self, out_dir: str | Path) -> Path:
        """Write this model's diffusers directory into ``out_dir`` and return it (the cache calls it)."""
        from common.builtin.build import build

        return build(self, out_dir)


def check_weights_dtype(spec) -> None:
    if spec.weights_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weights_dtype must be one of {WEIGHT_DTYPES}")


def check_kl_vae(spec, levels: int) -> None:
    """An ``AutoencoderKL`` of ``levels`` levels (``vae_block_out_channels``, ``vae_norm_num_groups``,
    ``vae_layers_per_block``)."""
    if len(spec.vae_block_out_channels) != levels:
        raise ValueError(f"vae_block_out_channels must have {levels} entries (8x downsampling)")
    if spec.vae_norm_num_groups < 1 or any(c % spec.vae_norm_num_groups for c in spec.vae_block_out_channels):
        raise ValueError("every VAE width must be a multiple of vae_norm_num_groups")
    if spec.vae_layers_per_block < 1:
        raise ValueError("vae_layers_per_block must be >= 1")


def check_t5(spec) -> None:
    """A T5 encoder (``t5_d_model``, ``t5_d_kv``, ``t5_d_ff``, ``t5_num_layers``, ``t5_num_heads``) and its
    unigram tokenizer's ``t5_vocab_size``."""
    from common.builtin.tokenizer.unigram import FIXED_TOKENS

    if min(spec.t5_d_model, spec.t5_d_kv, spec.t5_d_ff, spec.t5_num_layers, spec.t5_num_heads) < 1:
        raise ValueError("T5 sizes must be positive")
    if spec.t5_vocab_size <= FIXED_TOKENS:
        raise ValueError("t5_vocab_size too small for the T5 tokenizer's alphabet")
