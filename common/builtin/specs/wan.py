"""The built-in Wan text-to-video models: :class:`TinyWanSpec` (one configuration plus the request it serves),
the table of named specs, :data:`SPECS`, and their pipeline's :func:`components`: the layout of a real Wan2.1
T2V checkpoint, optionally with a Wan2.2-style second expert (``transformer_2/`` plus ``boundary_ratio``).

Besides the tiny specs there is ``wan2.1-1.3b``: a transformer and VAE of exactly Wan2.1-T2V-1.3B's shape
(random weights, stored in bfloat16) for benchmarking on a GPU; see its comment in ``SPECS``.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.builtin.build import seeded
from common.builtin.spec import BuiltinSpec, check_weights_dtype, later_field
from common.builtin.tokenizer.unigram import FIXED_TOKENS

# 64 rotary positions per axis allows latent grids up to 128x128 (1024 px),
# far beyond what tests use, at negligible cost.
_ROPE_MAX_SEQ_LEN = 64


@dataclass(frozen=True)
class TinyWanSpec(BuiltinSpec):
    """One tiny Wan T2V configuration plus the request it is meant to serve."""

    PIPELINE = "WanPipeline"
    SERVING_DEFAULT_KEYS = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")

    name: str
    # Transformer (WanTransformer3DModel).
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 12
    ffn_dim: int = 32
    freq_dim: int = 16
    rope_max_seq_len: int = later_field(_ROPE_MAX_SEQ_LEN)
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
    vae_dim_mult: tuple[int, ...] = later_field((1, 1, 1, 1))
    vae_num_res_blocks: int = later_field(1)
    # Scheduler (UniPCMultistepScheduler with flow sigmas).
    flow_shift: float = 3.0
    # Wan2.2-style mixture of two experts.
    two_experts: bool = False
    boundary_ratio: float | None = None
    # BuiltinSpec's, added after cached Wan models existed.
    weights_dtype: str = later_field("float32")
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
        if self.vocab_size <= FIXED_TOKENS:
            raise ValueError("vocab_size too small for the tokenizer alphabet")
        # Four VAE levels: three spatial downsamplings (stride 8) as in Wan.
        if len(self.vae_dim_mult) != 4 or self.vae_num_res_blocks < 1:
            raise ValueError("vae_dim_mult must have 4 entries and vae_num_res_blocks be >= 1")
        check_weights_dtype(self)


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
    """``AutoencoderKLWan`` arguments for ``spec``: the real Wan VAE's strides and statistics, the spec's widths."""
    from common.builtin.vaes import wan_vae_config

    return wan_vae_config(spec.vae_base_dim, spec.vae_dim_mult, spec.vae_num_res_blocks)


def components(spec: TinyWanSpec, transformer: dict | None = None, vae: dict | None = None) -> dict:
    """``WanPipeline``'s components of ``spec``: the UMT5 encoder (umt5-xxl's structure) and its tokenizer, the
    VAE, the UniPC scheduler Wan checkpoints ship, the expert(s); ``transformer`` / ``vae``: other configs (Wan
    image-to-video's)."""
    from diffusers import UniPCMultistepScheduler, WanTransformer3DModel

    from common.builtin.text_encoders import t5_encoder
    from common.builtin.tokenizer.unigram import t5_tokenizer
    from common.builtin.vaes import wan_vae

    transformer = transformer_config(spec) if transformer is None else transformer
    return dict(
        tokenizer=t5_tokenizer(spec.vocab_size),
        text_encoder=t5_encoder(spec, "text_encoder", umt5=True, vocab_size=spec.vocab_size, d_model=spec.text_dim,
                                d_kv=spec.text_d_kv, d_ff=spec.text_d_ff, num_layers=spec.text_layers,
                                num_heads=spec.text_heads),
        vae=wan_vae(spec, vae_config(spec) if vae is None else vae),
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                          num_train_timesteps=1000, flow_shift=spec.flow_shift),
        transformer=seeded(spec, "transformer", lambda: WanTransformer3DModel(**transformer)),
        transformer_2=(seeded(spec, "transformer_2", lambda: WanTransformer3DModel(**transformer))
                       if spec.two_experts else None),
        boundary_ratio=spec.boundary_ratio,
    )


# The parity sweep's choices (common/builtin/sweep.py): widths, heads, layers, the text encoder, the VAE's widths,
# the flow shift, experts, and the request's size, frames and steps.
SWEEP_KNOBS = {
    "num_layers": (1, 2, 3), "num_attention_heads": (1, 2, 3), "attention_head_dim": (6, 8, 12, 16),
    "ffn_dim": (16, 32, 48), "freq_dim": (8, 16, 32), "text_dim": (16, 32, 48), "text_layers": (1, 2),
    "text_heads": (1, 2, 4), "text_d_ff": (32, 64), "text_d_kv": (8, 16), "vae_base_dim": (4, 8),
    "vae_dim_mult": ((1, 1, 1, 1), (1, 2, 2, 2), (1, 2, 4, 4)), "flow_shift": (1.0, 3.0, 5.0, 8.0),
    "two_experts": (False, False, True), "boundary_ratio": (None, 0.5, 0.875),
    "height": (16, 32, 48), "width": (16, 32, 48), "num_frames": (1, 5, 9), "num_inference_steps": (2, 3, 4),
    "guidance_scale": (1.0, 3.0, 5.0),
}
