"""The built-in FLUX.1 text-to-image models: :class:`TinyFluxSpec` (one configuration plus the request it
serves), the table of named specs, :data:`SPECS`, and their pipeline's :func:`components`: the layout of a real
FLUX.1 checkpoint (CLIP-L in ``text_encoder/``, T5 in ``text_encoder_2/``, each with its tokenizer)."""

from __future__ import annotations

from typing import ClassVar
from dataclasses import dataclass

from common.builtin.build import seeded
from common.builtin.spec import (BuiltinSpec, ClipLSizes, KLVaeSizes, T5Sizes, check_clip, check_kl_vae, check_t5,
                                 check_weights_dtype)

# The VAE is an AutoencoderKL of the spec's levels (four: 8x, as FLUX's; KLVaeSizes.vae_spatial_stride).
# FluxPipeline packs the latents into 2x2 patches.
PACK_SIZE = 2
# FLUX.1's VAE latent normalisation.
VAE_SCALING_FACTOR = 0.3611
VAE_SHIFT_FACTOR = 0.1159
LATENT_CHANNELS = 16
# FluxPipeline.default_sample_size: its default image side is this many latent pixels.
DEFAULT_SAMPLE_SIZE = 128
# FluxPipeline.check_inputs refuses longer T5 prompts.
MAX_T5_SEQUENCE_LENGTH = 512
# The rotary embedding's axes: the (unused) text axis, then latent rows and columns.
ROPE_AXES = 3


@dataclass(frozen=True, kw_only=True)
class TinyFluxSpec(BuiltinSpec, ClipLSizes, T5Sizes, KLVaeSizes):
    """One tiny FLUX.1 text-to-image configuration plus the request it is meant to serve: CLIP-L (FLUX uses its
    pooled output) and T5 (its hidden states are the prompt embeddings), the VAE (``AutoencoderKL`` with 16
    latent channels, FLUX's scaling and shift factors), the transformer and scheduler below."""

    PIPELINE = "FluxPipeline"
    SERVING_DEFAULT_KEYS = ("height", "width", "num_inference_steps", "guidance_scale", "true_cfg_scale",
                            "max_sequence_length")

    name: str
    # TeaCache's polynomial the built directory carries in step_cache.json (the family has no published one):
    # a line fitted on small-flux-smooth by bench/fit_teacache.py --degree 1 (R^2 0.96; a line, not a quartic, so that
    # other schedules' changes extrapolate sanely).
    teacache_coefficients: tuple[float, ...] = (9.44586980e-01, 1.04665274e-02)
    TEACACHE_FITTED_ON: ClassVar[str] = "small-flux-smooth"
    # Transformer (FluxTransformer2DModel). Its joint_attention_dim and pooled_projection_dim follow from
    # the text encoders' sizes (see the properties below).
    num_layers: int = 1
    num_single_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    # Rotary dimensions per axis (text, rows, columns); each even, together attention_head_dim.
    axes_dims_rope: tuple[int, ...] = (4, 6, 6)
    # FLUX.1-dev's distilled guidance: the guidance scale goes into the transformer as an embedding.
    guidance_embeds: bool = True
    # Scheduler (FlowMatchEulerDiscreteScheduler) as FLUX.1-dev ships it: the shift follows the image
    # sequence length, from base_shift at base_image_seq_len to max_shift at max_image_seq_len.
    shift: float = 3.0
    use_dynamic_shifting: bool = True
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    # Default request for this model: guidance_scale is the embedded guidance, true_cfg_scale > 1 (with
    # a negative prompt) runs true classifier-free guidance on top.
    height: int = 64
    width: int = 64
    num_inference_steps: int = 4
    guidance_scale: float = 3.5
    true_cfg_scale: float = 1.0
    max_sequence_length: int = 32

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def joint_attention_dim(self) -> int:
        # The prompt embeddings are T5's hidden states.
        return self.t5_d_model

    @property
    def pooled_projection_dim(self) -> int:
        # The pooled embedding is CLIPTextModel's pooler_output, hidden_size wide.
        return self.clip_l_hidden_size

    @property
    def clip_l_projection_dim(self) -> int:
        # FLUX's CLIPTextModel has no projection, but its config carries one as CLIP-L's does: the hidden size.
        return self.clip_l_hidden_size

    def __post_init__(self) -> None:
        # Lists would leave the spec unhashable.
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        object.__setattr__(self, "vae_block_out_channels", tuple(self.vae_block_out_channels))
        self._check_transformer()
        check_clip(self, "clip_l")
        check_t5(self)
        check_kl_vae(self)
        self._check_scheduler()
        self._check_request()
        check_weights_dtype(self)

    def _check_transformer(self) -> None:
        if min(self.num_layers, self.num_attention_heads, self.attention_head_dim) < 1 or self.num_single_layers < 0:
            raise ValueError("transformer sizes must be positive")
        if len(self.axes_dims_rope) != ROPE_AXES or any(d < 2 or d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope must be {ROPE_AXES} positive even dimensions")
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError("axes_dims_rope must sum to attention_head_dim")

    def _check_scheduler(self) -> None:
        if self.shift <= 0:
            raise ValueError("shift must be > 0")
        # calculate_shift interpolates between the two sequence lengths.
        if not 0 < self.base_image_seq_len < self.max_image_seq_len:
            raise ValueError("base_image_seq_len must be positive and below max_image_seq_len")

    def _check_request(self) -> None:
        # The pipeline needs whole 2x2 packs of whole latent pixels (16 px on an 8x VAE).
        multiple = self.vae_spatial_stride * PACK_SIZE
        if self.height % multiple or self.width % multiple or min(self.height, self.width) < multiple:
            raise ValueError(f"height and width must be positive multiples of {multiple}")
        if not 1 <= self.max_sequence_length <= MAX_T5_SEQUENCE_LENGTH:
            raise ValueError(f"max_sequence_length must be in [1, {MAX_T5_SEQUENCE_LENGTH}]")
        if self.num_inference_steps < 1:
            raise ValueError("num_inference_steps must be >= 1")
        if self.guidance_scale < 0 or self.true_cfg_scale < 1:
            raise ValueError("guidance_scale must be >= 0 and true_cfg_scale >= 1 (1: no true CFG)")


SPECS: dict[str, TinyFluxSpec] = {
    spec.name: spec
    for spec in (
        # Tiny everything; a 64x64, 4-step generation takes well under a second on a CPU.
        TinyFluxSpec(name="tiny-flux"),
        # A compute-bound transformer for CPU benchmarks (about 18M parameters): FLUX.1's head dim
        # split as its rotary axes are (16, 56, 56) of 128, double-stream then twice as many
        # single-stream blocks; text encoders and VAE stay small.
        TinyFluxSpec(
            name="small-flux",
            num_layers=4,
            num_single_layers=8,
            num_attention_heads=4,
            attention_head_dim=64,
            axes_dims_rope=(8, 28, 28),
            clip_l_hidden_size=64,
            clip_l_num_heads=2,
            clip_l_intermediate_size=128,
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
            guidance_scale=3.5,
            max_sequence_length=64,
        ),
    )
}


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


def components(spec: TinyFluxSpec) -> dict:
    """``FluxPipeline``'s components of ``spec``: the scheduler, the VAE, CLIP-L (``CLIPTextModel``) and T5 with
    their tokenizers, the transformer."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    from common.builtin.text_encoders import clip_sizes, clip_text_encoder, t5_encoder, t5_sizes
    from common.builtin.tokenizer.clip import CLIP_L_PAD_TOKEN, clip_tokenizer
    from common.builtin.tokenizer.unigram import t5_tokenizer
    from common.builtin.vaes import autoencoder_kl

    tokenizer = clip_tokenizer(CLIP_L_PAD_TOKEN)
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_config(spec)),
        # sample_size in pixels, as FLUX.1's 1024
        vae=autoencoder_kl(spec, sample_size=DEFAULT_SAMPLE_SIZE * spec.vae_spatial_stride,
                           scaling_factor=VAE_SCALING_FACTOR, shift_factor=VAE_SHIFT_FACTOR),
        text_encoder=clip_text_encoder(spec, "text_encoder", False, **clip_sizes(spec, "clip_l", tokenizer)),
        tokenizer=tokenizer,
        text_encoder_2=t5_encoder(spec, "text_encoder_2", **t5_sizes(spec)),
        tokenizer_2=t5_tokenizer(spec.t5_vocab_size),
        transformer=seeded(spec, "transformer", lambda: FluxTransformer2DModel(**transformer_config(spec))),
    )


# The parity sweep's choices (common/builtin/sweep.py): the two block kinds, heads and rope axes, guidance
# embeddings, T5 and CLIP sizes, the VAE's widths, static or dynamic shifting and its bounds, and the request.
SWEEP_KNOBS = {
    "num_layers": (0, 1, 2), "num_single_layers": (1, 2), "num_attention_heads": (1, 2, 3),
    "attention_head_dim": (16, 24), "axes_dims_rope": ((4, 6, 6), (4, 4, 8), (8, 8, 8), (2, 10, 12)),
    "guidance_embeds": (True, False), "t5_d_model": (16, 32, 48), "t5_num_layers": (1, 2),
    "clip_l_hidden_size": (16, 32), "vae_block_out_channels": ((4, 4, 8, 8), (8, 8, 16, 16), (4, 8, 8)),
    "use_dynamic_shifting": (True, False), "shift": (1.0, 3.0), "base_shift": (0.3, 0.5), "max_shift": (0.9, 1.15),
    "base_image_seq_len": (16, 256), "max_image_seq_len": (1024, 4096),
    "height": (32, 48, 64), "width": (32, 64, 80), "num_inference_steps": (2, 3, 4), "guidance_scale": (0.0, 3.5),
    "true_cfg_scale": (1.0, 1.0, 2.5), "max_sequence_length": (16, 32),
}
