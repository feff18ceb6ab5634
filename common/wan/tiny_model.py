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

Usage::

    python -m common.wan.tiny_model [--name tiny] [--out DIR] [--cache-dir DIR] [--dtype D]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import string
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from common.wan.model_info import SERVING_DEFAULTS_FILE

if TYPE_CHECKING:
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import T5Tokenizer, UMT5EncoderModel

__all__ = ["SPECS", "TinyWanSpec", "build_tiny_model", "ensure_tiny_model"]

CACHE_ENV = "DISAGG_DIFFUSION_CACHE"
DEFAULT_CACHE_DIR = Path("~/.cache/disagg-diffusion")
# Spec fields written to the model's serving-defaults file.
SERVING_DEFAULT_KEYS = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")

# Bump when the builder changes in a way that changes its output, so that
# cached directories from an older builder are not reused.
_FORMAT_VERSION = 1
# Generation output depends on these packages (weights init, serialisation).
_VERSIONED_PACKAGES = ("torch", "diffusers", "transformers", "tokenizers")

# 64 rotary positions per axis allows latent grids up to 128x128 (1024 px),
# far beyond what tests use, at negligible cost.
_ROPE_MAX_SEQ_LEN = 64
_WEIGHT_DTYPES = ("float32", "bfloat16")
_SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2 as in T5
_MAX_PIECE_LEN = 8
# Every printable ASCII character is a piece, so English prompts never
# collapse to <unk> and different prompts give different ids.
_ALPHABET = sorted(set("\u2581" + string.ascii_letters + string.digits + string.punctuation))


def _later_field(default):
    """A spec field added after cached models existed: part of the cache key
    only when it differs from ``default`` (see ``_keyed_fields``)."""
    return field(default=default, metadata={"keyed_if_set": True})


@dataclass(frozen=True)
class TinyWanSpec:
    """One tiny Wan T2V configuration plus the request it is meant to serve."""

    name: str
    # Transformer (WanTransformer3DModel).
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 12
    ffn_dim: int = 32
    freq_dim: int = 16
    rope_max_seq_len: int = _later_field(_ROPE_MAX_SEQ_LEN)
    # Text encoder (UMT5EncoderModel); text_dim is both its d_model and the
    # transformer's text_dim.
    text_dim: int = 32
    text_layers: int = 2
    text_heads: int = 2
    text_d_ff: int = 64
    text_d_kv: int = 16
    vocab_size: int = 256
    # VAE (AutoencoderKLWan).
    vae_base_dim: int = 4
    vae_dim_mult: tuple[int, ...] = _later_field((1, 1, 1, 1))
    vae_num_res_blocks: int = _later_field(1)
    # Scheduler (UniPCMultistepScheduler with flow sigmas).
    flow_shift: float = 3.0
    # Wan2.2-style mixture of two experts.
    two_experts: bool = False
    boundary_ratio: float | None = None
    seed: int = 0
    # How the safetensors files store the weights (they are generated in
    # float32 either way; loaders cast to the dtype they ask for).
    weights_dtype: str = _later_field("float32")
    # Default request for this model.
    height: int = 32
    width: int = 32
    num_frames: int = 5
    num_inference_steps: int = 4
    guidance_scale: float = 5.0

    def __post_init__(self) -> None:
        # A list would leave the spec unhashable and its cache key different.
        object.__setattr__(self, "vae_dim_mult", tuple(self.vae_dim_mult))
        if self.two_experts != (self.boundary_ratio is not None):
            raise ValueError("boundary_ratio must be set exactly when two_experts is True")
        if self.boundary_ratio is not None and not 0.0 < self.boundary_ratio < 1.0:
            raise ValueError("boundary_ratio must be in (0, 1)")
        # Wan's 3-axis RoPE splits the head dim into even t/h/w parts.
        if self.attention_head_dim % 2 or self.attention_head_dim < 6:
            raise ValueError("attention_head_dim must be even and >= 6")
        if self.freq_dim % 2:
            raise ValueError("freq_dim must be even")
        # WanPipeline requires multiples of 16 (VAE stride 8 x patch 2) and
        # 4k+1 frames (VAE temporal stride 4).
        if self.height % 16 or self.width % 16:
            raise ValueError("height and width must be multiples of 16")
        if self.num_frames % 4 != 1:
            raise ValueError("num_frames must be of the form 4k+1")
        if self.vocab_size <= len(_SPECIAL_TOKENS) + len(_ALPHABET):
            raise ValueError("vocab_size too small for the tokenizer alphabet")
        # Four VAE levels: three spatial downsamplings (stride 8) as in Wan.
        if len(self.vae_dim_mult) != 4 or self.vae_num_res_blocks < 1:
            raise ValueError("vae_dim_mult must have 4 entries and vae_num_res_blocks be >= 1")
        if self.weights_dtype not in _WEIGHT_DTYPES:
            raise ValueError(f"weights_dtype must be one of {_WEIGHT_DTYPES}")


SPECS: dict[str, TinyWanSpec] = {
    spec.name: spec
    for spec in (
        TinyWanSpec(name="tiny"),
        TinyWanSpec(
            name="tiny-alt",
            num_layers=3,
            num_attention_heads=3,
            attention_head_dim=8,
            ffn_dim=48,
            freq_dim=8,
            text_dim=24,
            text_layers=3,
            text_heads=3,
            text_d_ff=40,
            text_d_kv=8,
            vocab_size=320,
            vae_base_dim=6,
            flow_shift=5.0,
            seed=1,
            height=32,
            width=48,
            num_frames=9,
            num_inference_steps=3,
            guidance_scale=4.0,
        ),
        # Like Wan2.2 A14B: two experts switching at t = 0.875 * 1000. With
        # flow_shift 3 and 4 steps, timesteps 999/900 use the high-noise
        # expert and 750/500 the low-noise one.
        TinyWanSpec(name="tiny-moe", two_experts=True, boundary_ratio=0.875, seed=2),
        # A ~17M-parameter transformer (8 blocks, 6 heads x 64 = 384 wide,
        # Wan's own freq_dim 256): large enough that weight updates, their
        # transfer and checksums are measurable, still quick on a CPU. The
        # text encoder and VAE stay tiny.
        TinyWanSpec(
            name="small",
            num_layers=8,
            num_attention_heads=6,
            attention_head_dim=64,
            ffn_dim=1024,
            freq_dim=256,
            text_dim=64,
            text_layers=2,
            text_heads=2,
            text_d_ff=128,
            text_d_kv=32,
            seed=3,
            height=128,
            width=128,
            num_frames=9,
            num_inference_steps=10,
            guidance_scale=5.0,
        ),
        # Exactly the shape of Wan2.1-T2V-1.3B's transformer (1.42e9
        # parameters) and VAE (1.27e8), with random weights: its denoise and
        # decode timings are the real model's. The text encoder has the real
        # width (d_model 4096 = text_dim, 64 heads x 64, d_ff 10240) but 2
        # layers instead of umt5-xxl's 24 and a tiny vocabulary: the full
        # encoder would be ~5.7e9 parameters (23 GB in float32) to generate,
        # and its cost is once per prompt, not per step. Stored in bfloat16
        # (3.9 GB instead of 7.8) since it is only ever served in bfloat16 on
        # a GPU; its default request is the real model's.
        TinyWanSpec(
            name="wan2.1-1.3b",
            num_layers=30,
            num_attention_heads=12,
            attention_head_dim=128,
            ffn_dim=8960,
            freq_dim=256,
            text_dim=4096,
            text_layers=2,
            text_heads=64,
            text_d_ff=10240,
            text_d_kv=64,
            vae_base_dim=96,
            vae_dim_mult=(1, 2, 4, 4),
            vae_num_res_blocks=2,
            rope_max_seq_len=1024,
            weights_dtype="bfloat16",
            flow_shift=3.0,
            seed=4,
            height=480,
            width=832,
            num_frames=81,
            num_inference_steps=50,
            guidance_scale=5.0,
        ),
    )
}


# --------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------


def _keyed_fields(spec: TinyWanSpec) -> dict:
    """The spec fields that go into its cache key.

    Fields added after the first cached models existed (``_later_field``)
    count only when they differ from their default, so the keys (directory
    names) of specs that leave them alone stay what they were.
    """
    out = dataclasses.asdict(spec)
    for f in dataclasses.fields(spec):
        if f.metadata.get("keyed_if_set") and getattr(spec, f.name) == f.default:
            del out[f.name]
    return out


def _cache_key(spec: TinyWanSpec) -> str:
    payload = {
        "format": _FORMAT_VERSION,
        "spec": _keyed_fields(spec),
        "versions": {pkg: importlib.metadata.version(pkg) for pkg in _VERSIONED_PACKAGES},
    }
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    return f"{spec.name}-{digest[:12]}"


def _is_complete(model_dir: Path) -> bool:
    # Directories only ever appear via an atomic rename of a finished build.
    return (model_dir / "model_index.json").is_file()


def ensure_tiny_model(name: str | TinyWanSpec = "tiny", cache_dir: str | Path | None = None) -> Path:
    """Return the directory of tiny model ``name``, generating it on first use.

    Safe under concurrent callers: each builds into a private temporary
    sibling and atomically renames it into place; losers discard theirs.
    """
    if isinstance(name, TinyWanSpec):
        spec = name
    elif name in SPECS:
        spec = SPECS[name]
    else:
        raise ValueError(f"unknown tiny model {name!r}; known: {sorted(SPECS)}")

    root = Path(cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()
    target = root / _cache_key(spec)
    if _is_complete(target):
        return target

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=root))
    try:
        build_tiny_model(spec, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700; the cache may be shared
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race; its copy is identical to ours.
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return target


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def _corpus() -> list[str]:
    """A few hundred short English scene descriptions, generated in code."""
    subjects = ["fox", "cat", "dog", "horse", "bird", "robot", "dragon", "child", "woman", "man",
                "car", "train", "ship", "tree", "river", "city", "astronaut", "panda", "whale", "owl"]
    adjectives = ["small", "large", "old", "young", "bright", "dark", "red", "blue", "golden",
                  "silver", "happy", "lonely", "curious", "sleepy", "giant", "tiny"]
    actions = ["runs", "walks", "flies", "swims", "sleeps", "dances", "glows", "waits", "jumps",
               "sings", "drifts", "climbs", "turns slowly", "looks around", "moves forward"]
    places = ["in the forest", "on the beach", "under the stars", "in the rain", "through the snow",
              "across the desert", "near a lake", "in a busy street", "on a mountain",
              "inside a kitchen", "over the ocean", "in a quiet garden"]
    times = ["at dawn", "at night", "at sunset", "in the morning", "during a storm", "in winter",
             "in summer", ""]
    styles = ["", "cinematic lighting", "slow motion", "aerial view", "close up shot",
              "watercolor style", "high detail", "soft focus"]
    sentences = []
    # Strided indices give varied combinations without the full product.
    for i in range(480):
        words = [
            "A" if i % 3 == 0 else "The" if i % 3 == 1 else "a",
            adjectives[(i * 7) % len(adjectives)],
            subjects[i % len(subjects)],
            actions[(i * 5) % len(actions)],
            places[(i * 11) % len(places)],
            times[(i * 3) % len(times)],
        ]
        sentence = " ".join(w for w in words if w)
        style = styles[(i * 13) % len(styles)]
        sentences.append(f"{sentence}, {style}." if style else f"{sentence}.")
    return sentences


def _unigram_vocab(corpus: list[str], vocab_size: int) -> list[tuple[str, float]]:
    """Estimate a SentencePiece-style unigram vocabulary from corpus counts.

    The ``tokenizers`` UnigramTrainer is not reproducible across processes
    (hash-map iteration order breaks ties differently), so pieces are chosen
    here deterministically: the alphabet plus the substrings of
    ``\u2581``-prefixed words covering the most text, scored by log frequency.
    """
    words = Counter("\u2581" + w for line in corpus for w in line.split())
    counts: Counter[str] = Counter()
    for word, n in words.items():
        for i in range(len(word)):
            for j in range(i + 1, min(len(word), i + _MAX_PIECE_LEN) + 1):
                counts[word[i:j]] += n

    n_pieces = vocab_size - len(_SPECIAL_TOKENS) - len(_ALPHABET)
    candidates = sorted(
        (p for p in counts if len(p) > 1),
        key=lambda p: (-counts[p] * len(p), p),
    )
    if len(candidates) < n_pieces:
        raise ValueError(f"corpus too small for vocab_size={vocab_size}")
    pieces = _ALPHABET + candidates[:n_pieces]
    total = sum(max(counts[p], 1) for p in pieces)
    # Rounded so the serialised scores do not depend on libm's last ulp.
    scored = sorted(((p, round(math.log(max(counts[p], 1) / total), 6)) for p in pieces),
                    key=lambda ps: (-ps[1], ps[0]))
    return [(tok, 0.0) for tok in _SPECIAL_TOKENS] + scored


def _build_tokenizer(spec: TinyWanSpec) -> T5Tokenizer:
    from transformers import T5Tokenizer

    # In transformers 5 T5Tokenizer is the tokenizers-backed class (there is
    # no separate *Fast class); it is what AutoTokenizer returns for a T5/UMT5
    # directory. Constructing it from a Unigram vocab gives exactly the backend
    # (WhitespaceSplit + Metaspace, "$A </s>" post-processor) that
    # from_pretrained rebuilds from tokenizer.json, so ids round-trip.
    # extra_ids=0: sentinel tokens would grow the vocab past vocab_size.
    tokenizer = T5Tokenizer(vocab=_unigram_vocab(_corpus(), spec.vocab_size), extra_ids=0,
                            model_max_length=512)
    if len(tokenizer) != spec.vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, expected {spec.vocab_size}")
    return tokenizer


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


def _build_transformer(spec: TinyWanSpec, component: str) -> WanTransformer3DModel:
    import torch
    from diffusers import WanTransformer3DModel

    seed = _component_seed(spec, component)
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**transformer_config(spec))
    _reinit_(model, seed)
    return model.eval()


def _build_vae(spec: TinyWanSpec) -> AutoencoderKLWan:
    import torch
    from diffusers import AutoencoderKLWan

    seed = _component_seed(spec, "vae")
    torch.manual_seed(seed)
    model = AutoencoderKLWan(**vae_config(spec))
    _reinit_(model, seed)
    return model.eval()


def _build_text_encoder(spec: TinyWanSpec) -> UMT5EncoderModel:
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    seed = _component_seed(spec, "text_encoder")
    torch.manual_seed(seed)
    # Mirrors umt5-xxl as used by Wan (gated-gelu, 32 buckets / 128 distance).
    config = UMT5Config(
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
    model = UMT5EncoderModel(config)
    _reinit_(model, seed)
    return model.eval()


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
    import torch
    from diffusers import WanPipeline

    out = Path(out_dir)
    # Seeding the global RNG and forcing float32 must not leak into the caller.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.random.fork_rng(devices=[]):
            pipe = WanPipeline(
                tokenizer=_build_tokenizer(spec),
                text_encoder=_build_text_encoder(spec),
                vae=_build_vae(spec),
                scheduler=_build_scheduler(spec),
                transformer=_build_transformer(spec, "transformer"),
                transformer_2=_build_transformer(spec, "transformer_2") if spec.two_experts else None,
                boundary_ratio=spec.boundary_ratio,
            )
    finally:
        torch.set_default_dtype(default_dtype)
    if spec.weights_dtype != "float32":
        pipe.to(getattr(torch, spec.weights_dtype))
    # Writes model_index.json exactly as a real WanPipeline checkpoint has it.
    pipe.save_pretrained(out, safe_serialization=True)
    # The request sizes this tiny model is meant to serve (see common.wan.model_info).
    defaults = {k: getattr(spec, k) for k in SERVING_DEFAULT_KEYS}
    (out / SERVING_DEFAULTS_FILE).write_text(json.dumps(defaults, indent=2, sort_keys=True) + "\n")
    return out


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="tiny", choices=sorted(SPECS))
    parser.add_argument("--out", type=Path, default=None,
                        help="write the model into this directory instead of the cache")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"cache root (default: ${CACHE_ENV} or {DEFAULT_CACHE_DIR})")
    parser.add_argument("--dtype", choices=_WEIGHT_DTYPES, default=None,
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
