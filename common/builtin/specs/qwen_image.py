"""The built-in Qwen-Image text-to-image models: :class:`TinyQwenImageSpec` (one configuration plus the request
it serves), the table of named specs, :data:`SPECS`, and their pipeline's :func:`components`: the layout of a
real Qwen-Image checkpoint (a Qwen2.5-VL model in ``text_encoder/``, a Qwen2 tokenizer in ``tokenizer/``)."""

from __future__ import annotations

from typing import ClassVar
from dataclasses import dataclass

from common.builtin.build import seeded
from common.builtin.spec import BuiltinSpec, check_weights_dtype

# AutoencoderKLQwenImage: one level per entry of vae_dim_mult, a 2x spatial downsampling between levels (four:
# 8x, as Qwen-Image's VAE), 16 latent channels.
LATENT_CHANNELS = 16
# QwenImagePipeline packs the latents into 2x2 patches, so images come in whole cells of the VAE's scale times 2
# pixels (16 on an 8x VAE).
PATCH_SIZE = 2
# Qwen-Image's VAE latent statistics (those of Wan 2.1's VAE, which it shares).
LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
               3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)
# The FlowMatchEulerDiscreteScheduler config Qwen/Qwen-Image ships (resolution-dependent shift).
SCHEDULER_CONFIG = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    invert_sigmas=False,
    max_image_seq_len=8192,
    max_shift=0.9,
    num_train_timesteps=1000,
    shift=1.0,
    shift_terminal=0.02,
    stochastic_sampling=False,
    time_shift_type="exponential",
    use_beta_sigmas=False,
    use_dynamic_shifting=True,
    use_exponential_sigmas=False,
    use_karras_sigmas=False,
)
# QwenImagePipeline.check_inputs refuses longer prompts.
MAX_SEQUENCE_LENGTH = 1024
# Qwen2.5-VL's multimodal RoPE splits each text head's rotary half into temporal / height / width sections
# of 16 / 24 / 24 (of 64, head dim 128); the tiny encoders keep those proportions.
MROPE_PROPORTIONS = (2, 3, 3)
TEXT_HEAD_DIM_MULTIPLE = 2 * sum(MROPE_PROPORTIONS)


@dataclass(frozen=True)
class TinyQwenImageSpec(BuiltinSpec):
    """One tiny Qwen-Image text-to-image configuration plus the request it is meant to serve."""

    PIPELINE = "QwenImagePipeline"
    SERVING_DEFAULT_KEYS = ("height", "width", "num_inference_steps", "true_cfg_scale", "max_sequence_length")

    name: str
    # TeaCache's polynomial the built directory carries in step_cache.json (the family has no published one):
    # a line fitted on small-qwen-image-smooth by bench/fit_teacache.py --degree 1 (R^2 0.96; a line, not a quartic, so that
    # other schedules' changes extrapolate sanely).
    teacache_coefficients: tuple[float, ...] = (2.41230363e-01, 1.06307260e-02)
    TEACACHE_FITTED_ON: ClassVar[str] = "small-qwen-image-smooth"
    # Transformer (QwenImageTransformer2DModel, no guidance embedding); its joint_attention_dim is the text
    # encoder's hidden size.
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    # Rotary dims of the frame / height / width axes (Qwen-Image: 16, 56, 56 of 128).
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)
    # Text encoder: Qwen2_5_VLForConditionalGeneration (the pipeline uses its language model's last hidden
    # states); grouped-query attention as Qwen2.5-VL-7B.
    text_hidden_size: int = 32
    text_num_layers: int = 2
    text_num_heads: int = 2
    text_num_kv_heads: int = 1
    text_intermediate_size: int = 64
    # Its vision tower (part of the checkpoint, unused for text-to-image).
    vision_depth: int = 1
    vision_hidden_size: int = 16
    vision_num_heads: int = 2
    vision_intermediate_size: int = 32
    # VAE (AutoencoderKLQwenImage): widths base_dim * vae_dim_mult per level.
    vae_base_dim: int = 8
    vae_dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    vae_num_res_blocks: int = 1
    # Default request for this model.
    height: int = 64
    width: int = 64
    num_inference_steps: int = 4
    true_cfg_scale: float = 4.0
    max_sequence_length: int = 64

    @property
    def joint_attention_dim(self) -> int:
        # The transformer reads the text encoder's hidden states as they are.
        return self.text_hidden_size

    @property
    def vae_temporal_downsample(self) -> tuple[bool, ...]:
        """One entry per downsampling (the pipelines' ``vae_scale_factor`` is 2 ** its length): Qwen-Image's
        (False, True, True) on four levels, and halving time at every further one."""
        return (False,) + (True,) * (len(self.vae_dim_mult) - 2)

    @property
    def pixel_multiple(self) -> int:
        """Heights and widths are multiples of this: whole 2x2 packs of latent pixels."""
        return 2 ** len(self.vae_temporal_downsample) * PATCH_SIZE

    @property
    def text_head_dim(self) -> int:
        return self.text_hidden_size // self.text_num_heads

    @property
    def mrope_section(self) -> tuple[int, int, int]:
        """The text encoder's multimodal RoPE sections (they sum to half its head dim)."""
        unit = self.text_head_dim // TEXT_HEAD_DIM_MULTIPLE
        return tuple(unit * p for p in MROPE_PROPORTIONS)

    def __post_init__(self) -> None:
        # Lists would leave the spec unhashable.
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        object.__setattr__(self, "vae_dim_mult", tuple(self.vae_dim_mult))
        self._check_transformer()
        self._check_text_encoder()
        self._check_vae()
        self._check_request()
        check_weights_dtype(self)

    def _check_transformer(self) -> None:
        if min(self.num_layers, self.num_attention_heads, self.attention_head_dim) < 1:
            raise ValueError("transformer sizes must be positive")
        if len(self.axes_dims_rope) != 3 or any(d < 2 or d % 2 for d in self.axes_dims_rope):
            raise ValueError("axes_dims_rope must be three positive even sizes (frame, height, width)")
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError("axes_dims_rope must sum to attention_head_dim")

    def _check_text_encoder(self) -> None:
        if min(self.text_num_layers, self.text_num_heads, self.text_num_kv_heads, self.text_intermediate_size) < 1:
            raise ValueError("text encoder sizes must be positive")
        if self.text_hidden_size < 1 or self.text_hidden_size % self.text_num_heads:
            raise ValueError("text_hidden_size must be a positive multiple of text_num_heads")
        if self.text_num_heads % self.text_num_kv_heads:
            raise ValueError("text_num_heads must be a multiple of text_num_kv_heads")
        if self.text_head_dim % TEXT_HEAD_DIM_MULTIPLE:
            raise ValueError(f"text_hidden_size / text_num_heads must be a multiple of {TEXT_HEAD_DIM_MULTIPLE} "
                             "(multimodal RoPE sections)")
        if min(self.vision_depth, self.vision_num_heads, self.vision_intermediate_size) < 1:
            raise ValueError("vision tower sizes must be positive")
        # The vision rotary embedding splits each head's half in two (height, width).
        if self.vision_hidden_size < 1 or self.vision_hidden_size % (4 * self.vision_num_heads):
            raise ValueError("vision_hidden_size must be a positive multiple of 4 * vision_num_heads")

    def _check_vae(self) -> None:
        if len(self.vae_dim_mult) < 2:
            raise ValueError("vae_dim_mult must have at least 2 entries (4: 8x downsampling, 5: 16x)")
        if self.vae_base_dim < 1 or min(self.vae_dim_mult) < 1:
            raise ValueError("vae_base_dim and vae_dim_mult must be positive")
        if self.vae_num_res_blocks < 1:
            raise ValueError("vae_num_res_blocks must be >= 1")

    def _check_request(self) -> None:
        multiple = self.pixel_multiple
        if self.height % multiple or self.width % multiple or min(self.height, self.width) < 1:
            raise ValueError(f"height and width must be positive multiples of {multiple}")
        if not 1 <= self.max_sequence_length <= MAX_SEQUENCE_LENGTH:
            raise ValueError(f"max_sequence_length must be in [1, {MAX_SEQUENCE_LENGTH}]")
        # With Qwen-Image's terminal shift a single step's schedule is 0 / 0 (NaN sigmas).
        if self.num_inference_steps < 2:
            raise ValueError("num_inference_steps must be >= 2")
        if self.true_cfg_scale < 1.0:
            raise ValueError("true_cfg_scale must be >= 1 (1 disables classifier-free guidance)")


SPECS: dict[str, TinyQwenImageSpec] = {
    spec.name: spec
    for spec in (
        # Tiny everything; pipeline calls take well under a second on a CPU.
        TinyQwenImageSpec(name="tiny-qwen-image"),
        # A compute-bound transformer for CPU benchmarks (about 19M parameters, head dim 64 split as
        # Qwen-Image's 16 / 56 / 56 of 128); text encoder and VAE stay small.
        TinyQwenImageSpec(
            name="small-qwen-image",
            num_layers=8,
            num_attention_heads=4,
            attention_head_dim=64,
            axes_dims_rope=(8, 28, 28),
            text_hidden_size=128,
            text_num_layers=2,
            text_num_heads=4,
            text_num_kv_heads=2,
            text_intermediate_size=256,
            vision_depth=1,
            vision_hidden_size=32,
            vision_num_heads=2,
            vision_intermediate_size=64,
            vae_base_dim=16,
            seed=1,
            height=256,
            width=256,
            num_inference_steps=10,
            true_cfg_scale=4.0,
            max_sequence_length=64,
        ),
    )
}


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


def components(spec: TinyQwenImageSpec) -> dict:
    """``QwenImagePipeline``'s components of ``spec``: the transformer, the VAE (Wan's layout with Qwen-Image's
    statistics), the scheduler Qwen/Qwen-Image ships, the Qwen2.5-VL text encoder and its tokenizer."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    from common.builtin.text_encoders import qwen2_5_vl
    from common.builtin.tokenizer.qwen import qwen2_tokenizer
    from common.builtin.vaes import wan_vae, wan_vae_config

    tokenizer = qwen2_tokenizer()
    vae = wan_vae_config(spec.vae_base_dim, spec.vae_dim_mult, spec.vae_num_res_blocks) | dict(
        temperal_downsample=list(spec.vae_temporal_downsample), latents_mean=list(LATENTS_MEAN),
        latents_std=list(LATENTS_STD))
    return dict(
        transformer=seeded(spec, "transformer", lambda: QwenImageTransformer2DModel(**transformer_config(spec))),
        vae=wan_vae(spec, vae, "AutoencoderKLQwenImage"),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        text_encoder=qwen2_5_vl(spec, "text_encoder", tokenizer=tokenizer, hidden_size=spec.text_hidden_size,
                                intermediate_size=spec.text_intermediate_size, num_layers=spec.text_num_layers,
                                num_heads=spec.text_num_heads, num_kv_heads=spec.text_num_kv_heads,
                                mrope_section=spec.mrope_section, vision_depth=spec.vision_depth,
                                vision_hidden_size=spec.vision_hidden_size,
                                vision_intermediate_size=spec.vision_intermediate_size,
                                vision_num_heads=spec.vision_num_heads),
        tokenizer=tokenizer,
    )


# The parity sweep's choices (common/builtin/sweep.py): transformer widths, heads, rope axes, the Qwen2.5-VL
# text model's sizes, the VAE's widths, and the request.
SWEEP_KNOBS = {
    "num_layers": (1, 2, 3), "num_attention_heads": (1, 2, 3), "attention_head_dim": (16, 24),
    "axes_dims_rope": ((4, 6, 6), (8, 4, 4), (4, 8, 12)), "text_hidden_size": (32, 64), "text_num_layers": (1, 2),
    "text_num_heads": (1, 2), "text_num_kv_heads": (1, 2), "text_intermediate_size": (32, 64),
    "vae_base_dim": (4, 8), "vae_dim_mult": ((1, 2, 4, 4), (1, 1, 2, 2), (1, 2, 2), (1, 1, 2, 2, 2)),
    "height": (32, 48, 64), "width": (32, 64, 80), "num_inference_steps": (2, 3, 4),
    "true_cfg_scale": (1.0, 4.0), "max_sequence_length": (32, 64),
}
