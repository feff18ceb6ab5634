"""The built-in Stable Diffusion 3 / 3.5 text-to-image models: :class:`TinySD3Spec` (one configuration plus the
request it serves), the table of named specs, :data:`SPECS`, and their pipeline's :func:`components`: the layout
of a real SD3 checkpoint (CLIP-L in ``text_encoder/``, CLIP-G in ``text_encoder_2/``, T5 in ``text_encoder_3/``,
each with its tokenizer)."""

from __future__ import annotations

from typing import ClassVar
from dataclasses import dataclass

from common.builtin.build import seeded
from common.builtin.spec import (BuiltinSpec, ClipLSizes, KLVaeSizes, T5Sizes, check_clip, check_kl_vae, check_t5,
                                 check_weights_dtype)

# The VAE is an AutoencoderKL of the spec's levels (four: 8x, as SD3's; KLVaeSizes.vae_spatial_stride).
# SD3.5's VAE latent normalisation (SD3.0 has the same scaling factor and shift).
VAE_SCALING_FACTOR = 1.5305
VAE_SHIFT_FACTOR = 0.0609
LATENT_CHANNELS = 16
# StableDiffusion3Pipeline.check_inputs refuses longer T5 prompts.
MAX_T5_SEQUENCE_LENGTH = 512
# The query/key norms SD3 (None) and SD3.5 ("rms_norm") use, and the plain layer norm.
QK_NORMS = (None, "rms_norm", "layer_norm")


@dataclass(frozen=True, kw_only=True)
class TinySD3Spec(BuiltinSpec, ClipLSizes, T5Sizes, KLVaeSizes):
    """One tiny SD3 / SD3.5 text-to-image configuration plus the request it is meant to serve: CLIP-L and CLIP-G
    (``CLIPTextModelWithProjection`` both), T5, the VAE (``AutoencoderKL`` with 16 latent channels, SD3.5's
    scaling and shift factors), the transformer and scheduler below."""

    PIPELINE = "StableDiffusion3Pipeline"
    SERVING_DEFAULT_KEYS = ("height", "width", "num_inference_steps", "guidance_scale", "max_sequence_length")

    name: str
    # TeaCache's polynomial the built directory carries in step_cache.json (the family has no published one):
    # a line fitted on small-sd3-smooth by bench/fit_teacache.py --degree 1 (R^2 0.35; a line, not a quartic, so that
    # other schedules' changes extrapolate sanely).
    teacache_coefficients: tuple[float, ...] = (4.17453858e-01, 2.38088636e-02)
    TEACACHE_FITTED_ON: ClassVar[str] = "small-sd3-smooth"
    # Transformer (SD3Transformer2DModel). Its caption_projection_dim, joint_attention_dim and
    # pooled_projection_dim follow from the other sizes (see the properties below).
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    patch_size: int = 2
    # Latent side of the pipeline's own default size (pixels / 8) when a request gives none.
    sample_size: int = 8
    # Side of the learned-position grid, in patches: the largest latent is this times patch_size.
    pos_embed_max_size: int = 32
    # SD3.5-style blocks with a second image self-attention (MMDiT-X); () is SD3.0.
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: str | None = None
    # CLIP-L's projection (its other sizes: ClipLSizes).
    clip_l_projection_dim: int = 32
    # CLIP-G (CLIPTextModelWithProjection, gelu as laion's CLIP-ViT-bigG-14).
    clip_g_hidden_size: int = 48
    clip_g_num_layers: int = 2
    clip_g_num_heads: int = 2
    clip_g_intermediate_size: int = 96
    clip_g_projection_dim: int = 48
    # T5 wider than the two CLIPs side by side (its other sizes: T5Sizes).
    t5_d_model: int = 96
    t5_d_ff: int = 128
    # Scheduler (FlowMatchEulerDiscreteScheduler); SD3 and SD3.5 ship shift 3.0.
    shift: float = 3.0
    # Default request for this model.
    height: int = 64
    width: int = 64
    num_inference_steps: int = 4
    guidance_scale: float = 4.5
    max_sequence_length: int = 32

    @property
    def caption_projection_dim(self) -> int:
        # The text tokens join the image tokens in one attention, so both streams share the width.
        return self.num_attention_heads * self.attention_head_dim

    @property
    def joint_attention_dim(self) -> int:
        # The prompt embeddings are the T5 states with the CLIP states padded to T5's width.
        return self.t5_d_model

    @property
    def pooled_projection_dim(self) -> int:
        # The pooled embedding is the two CLIP projections concatenated.
        return self.clip_l_projection_dim + self.clip_g_projection_dim

    def __post_init__(self) -> None:
        # Lists would leave the spec unhashable.
        object.__setattr__(self, "dual_attention_layers", tuple(self.dual_attention_layers))
        object.__setattr__(self, "vae_block_out_channels", tuple(self.vae_block_out_channels))
        self._check_transformer()
        self._check_text_encoders()
        check_t5(self)
        check_kl_vae(self)
        self._check_request()
        check_weights_dtype(self)

    def _check_transformer(self) -> None:
        if min(self.num_layers, self.num_attention_heads, self.attention_head_dim, self.patch_size) < 1:
            raise ValueError("transformer sizes must be positive")
        if sorted(set(self.dual_attention_layers)) != list(self.dual_attention_layers):
            raise ValueError("dual_attention_layers must be distinct and increasing")
        if any(not 0 <= i < self.num_layers for i in self.dual_attention_layers):
            raise ValueError("dual_attention_layers must index layers below num_layers")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}")
        default_grid = self.sample_size // self.patch_size
        if self.sample_size % self.patch_size or not 0 < default_grid <= self.pos_embed_max_size:
            raise ValueError("sample_size must be a multiple of patch_size within pos_embed_max_size patches")

    def _check_text_encoders(self) -> None:
        check_clip(self, "clip_l")
        check_clip(self, "clip_g")
        # SD3 zero-pads the two CLIP hidden states, side by side, to the T5 width before joining them.
        if self.clip_l_hidden_size + self.clip_g_hidden_size > self.t5_d_model:
            raise ValueError("clip_l_hidden_size + clip_g_hidden_size must not exceed t5_d_model")

    def _check_request(self) -> None:
        # The pipeline needs whole patches of whole latent pixels (16 px for patch 2 on an 8x VAE).
        multiple = self.vae_spatial_stride * self.patch_size
        if self.height % multiple or self.width % multiple or min(self.height, self.width) < multiple:
            raise ValueError(f"height and width must be positive multiples of {multiple}")
        if max(self.height, self.width) > multiple * self.pos_embed_max_size:
            raise ValueError(f"height and width must not exceed {multiple * self.pos_embed_max_size} "
                             "(pos_embed_max_size patches)")
        if not 1 <= self.max_sequence_length <= MAX_T5_SEQUENCE_LENGTH:
            raise ValueError(f"max_sequence_length must be in [1, {MAX_T5_SEQUENCE_LENGTH}]")
        if self.num_inference_steps < 1 or self.shift <= 0:
            raise ValueError("num_inference_steps must be >= 1 and shift > 0")


SPECS: dict[str, TinySD3Spec] = {
    spec.name: spec
    for spec in (
        # Tiny everything (SD3.0-style blocks); pipeline calls take well under a second on a CPU.
        TinySD3Spec(name="tiny-sd3"),
        # A compute-bound transformer for CPU benchmarks, SD3.5-Medium-style (dual attention in the
        # first blocks, RMS query/key norms, head dim 64); text encoders and VAE stay small. Its
        # position grid (48 patches) covers 768 px, 3x its default grid as SD3's 192 is of 64.
        TinySD3Spec(
            name="small-sd3",
            num_layers=8,
            num_attention_heads=4,
            attention_head_dim=64,
            sample_size=32,
            pos_embed_max_size=48,
            dual_attention_layers=(0, 1),
            qk_norm="rms_norm",
            clip_l_hidden_size=64,
            clip_l_num_heads=2,
            clip_l_intermediate_size=128,
            clip_l_projection_dim=64,
            clip_g_hidden_size=96,
            clip_g_num_heads=2,
            clip_g_intermediate_size=192,
            clip_g_projection_dim=96,
            t5_d_model=256,
            t5_d_kv=32,
            t5_d_ff=512,
            t5_num_heads=4,
            vae_block_out_channels=(8, 16, 32, 32),
            vae_norm_num_groups=8,
            seed=1,
            height=256,
            width=256,
            num_inference_steps=10,
            guidance_scale=4.5,
            max_sequence_length=64,
        ),
    )
}


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


def components(spec: TinySD3Spec) -> dict:
    """``StableDiffusion3Pipeline``'s components of ``spec``: the transformer, the flow-match scheduler SD3 /
    SD3.5 ship (static shift), the VAE, the three text encoders and their tokenizers."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    from common.builtin.text_encoders import clip_sizes, clip_text_encoder, t5_encoder, t5_sizes
    from common.builtin.tokenizer.clip import CLIP_G_PAD_TOKEN, CLIP_L_PAD_TOKEN, clip_tokenizer
    from common.builtin.tokenizer.unigram import t5_tokenizer
    from common.builtin.vaes import autoencoder_kl

    tokenizer, tokenizer_2 = clip_tokenizer(CLIP_L_PAD_TOKEN), clip_tokenizer(CLIP_G_PAD_TOKEN)
    return dict(
        transformer=seeded(spec, "transformer", lambda: SD3Transformer2DModel(**transformer_config(spec))),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=spec.shift),
        vae=autoencoder_kl(spec, sample_size=spec.sample_size * spec.vae_spatial_stride,
                           scaling_factor=VAE_SCALING_FACTOR, shift_factor=VAE_SHIFT_FACTOR),
        text_encoder=clip_text_encoder(spec, "text_encoder", True, **clip_sizes(spec, "clip_l", tokenizer)),
        tokenizer=tokenizer,
        text_encoder_2=clip_text_encoder(spec, "text_encoder_2", True, **clip_sizes(spec, "clip_g", tokenizer_2)),
        tokenizer_2=tokenizer_2,
        text_encoder_3=t5_encoder(spec, "text_encoder_3", **t5_sizes(spec)),
        tokenizer_3=t5_tokenizer(spec.t5_vocab_size),
    )


# The parity sweep's choices (common/builtin/sweep.py): transformer widths, heads, layers, patches and position
# grid, SD3 / SD3.5 blocks, the three text encoders, the VAE's widths, and the request.
SWEEP_KNOBS = {
    "num_layers": (1, 2, 3), "num_attention_heads": (1, 2, 3), "attention_head_dim": (8, 12, 16),
    "patch_size": (1, 2), "sample_size": (4, 8), "pos_embed_max_size": (8, 16, 32),
    "dual_attention_layers": ((), (), (0,), (0, 1)), "qk_norm": QK_NORMS,
    "clip_l_hidden_size": (16, 32), "clip_l_num_layers": (1, 2), "clip_l_projection_dim": (8, 32),
    "clip_g_hidden_size": (32, 48), "clip_g_projection_dim": (16, 48), "t5_d_model": (80, 96, 128),
    "t5_num_layers": (1, 2), "vae_block_out_channels": ((4, 4, 8, 8), (8, 8, 16, 16), (4, 8, 8, 16), (4, 8, 8)),
    "shift": (1.0, 3.0, 6.0), "height": (32, 48, 64), "width": (32, 48, 80), "num_inference_steps": (2, 3, 5),
    "guidance_scale": (1.0, 4.5), "max_sequence_length": (16, 32, 77),
}
