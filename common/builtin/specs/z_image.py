"""The built-in Z-Image text-to-image models: :class:`TinyZImageSpec` (one configuration plus the request it
serves), the table of named specs, :data:`SPECS`, and their pipeline's :func:`components`: the layout of a real
Z-Image checkpoint (a ``Qwen3Model`` in ``text_encoder/``, a Qwen2 tokenizer with a Qwen3 chat template in
``tokenizer/``, ``ZImageTransformer2DModel``, FLUX.1's ``AutoencoderKL``, a statically shifted flow-match Euler)."""

from __future__ import annotations

from dataclasses import dataclass

from common.builtin.build import seeded
from common.builtin.spec import BuiltinSpec, KLVaeSizes, check_kl_vae, check_weights_dtype
from common.builtin.text_encoders import qwen3

# The VAE is an AutoencoderKL of the spec's levels (four: 8x, as Z-Image's and FLUX.1's).
VAE_SCALING_FACTOR = 0.3611
VAE_SHIFT_FACTOR = 0.1159
LATENT_CHANNELS = 16
# ZImagePipeline: sizes in whole cells of the VAE's scale times 2 (16 pixels on an 8x VAE).
PACK_SIZE = 2
# The FlowMatchEulerDiscreteScheduler config Tongyi-MAI/Z-Image-Turbo ships: a static shift (3.0).
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, use_dynamic_shifting=False)
@dataclass(frozen=True, kw_only=True)
class TinyZImageSpec(BuiltinSpec, KLVaeSizes):
    """One tiny Z-Image configuration plus the request it is meant to serve."""

    PIPELINE = "ZImagePipeline"
    SERVING_DEFAULT_KEYS = ("height", "width", "num_inference_steps", "guidance_scale", "max_sequence_length")

    name: str
    # Transformer (ZImageTransformer2DModel): head dim = dim / n_heads = sum(axes_dims) (frame, rows, columns).
    dim: int = 32
    n_layers: int = 2
    n_refiner_layers: int = 1
    n_heads: int = 2
    n_kv_heads: int = 2
    axes_dims: tuple[int, int, int] = (4, 6, 6)
    # Scheduler: Z-Image-Turbo's static shift.
    shift: float = 3.0
    # Text encoder (Qwen3Model; the pipeline reads its second-to-last hidden state, so at least 2 layers).
    text_hidden_size: int = 32
    text_num_layers: int = 2
    text_num_heads: int = 2
    text_num_kv_heads: int = 1
    text_head_dim: int = 16
    text_intermediate_size: int = 64
    # Default request.
    height: int = 64
    width: int = 64
    num_inference_steps: int = 4
    guidance_scale: float = 5.0
    max_sequence_length: int = 64

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes_dims", tuple(self.axes_dims))
        object.__setattr__(self, "vae_block_out_channels", tuple(self.vae_block_out_channels))
        if min(self.dim, self.n_layers, self.n_heads, self.n_kv_heads) < 1 or self.n_refiner_layers < 0:
            raise ValueError("transformer sizes must be positive")
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError("dim must be a multiple of n_heads, n_heads of n_kv_heads")
        if len(self.axes_dims) != 3 or any(d < 2 or d % 2 for d in self.axes_dims) \
                or sum(self.axes_dims) != self.dim // self.n_heads:
            raise ValueError("axes_dims must be three positive even sizes summing to dim / n_heads")
        if self.text_num_layers < 2:
            raise ValueError("text_num_layers must be >= 2 (the pipeline reads the second-to-last hidden state)")
        if min(self.text_hidden_size, self.text_num_heads, self.text_num_kv_heads, self.text_head_dim,
               self.text_intermediate_size) < 1 or self.text_num_heads % self.text_num_kv_heads:
            raise ValueError("text encoder sizes must be positive, text_num_heads a multiple of text_num_kv_heads")
        check_kl_vae(self)
        multiple = self.vae_spatial_stride * PACK_SIZE
        if self.height % multiple or self.width % multiple or min(self.height, self.width) < 1:
            raise ValueError(f"height and width must be positive multiples of {multiple}")
        if self.shift <= 0:
            raise ValueError("shift must be positive")
        if self.num_inference_steps < 1 or self.guidance_scale < 0 or not 1 <= self.max_sequence_length <= 512:
            raise ValueError("num_inference_steps >= 1, guidance_scale >= 0, max_sequence_length in [1, 512]")
        check_weights_dtype(self)


SPECS: dict[str, TinyZImageSpec] = {
    spec.name: spec
    for spec in (
        # Tiny everything; a pipeline call takes a fraction of a second on a CPU.
        TinyZImageSpec(name="tiny-z-image"),
        # A compute-bound transformer for CPU benchmarks (about 17M parameters, head dim 64 split as Z-Image's
        # 32 / 48 / 48 of 128); text encoder and VAE stay small.
        TinyZImageSpec(name="small-z-image", dim=256, n_layers=12, n_refiner_layers=2, n_heads=4, n_kv_heads=4,
                       axes_dims=(16, 24, 24), text_hidden_size=128, text_num_heads=4, text_num_kv_heads=2,
                       text_head_dim=32, text_intermediate_size=256, vae_block_out_channels=(8, 8, 16, 16),
                       seed=1, height=256, width=256, num_inference_steps=10),
    )
}


def transformer_config(spec: TinyZImageSpec) -> dict:
    """``ZImageTransformer2DModel`` arguments for ``spec`` (Z-Image's structure with the spec's sizes)."""
    return dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=LATENT_CHANNELS, dim=spec.dim,
                n_layers=spec.n_layers, n_refiner_layers=spec.n_refiner_layers, n_heads=spec.n_heads,
                n_kv_heads=spec.n_kv_heads, norm_eps=1e-5, qk_norm=True, cap_feat_dim=spec.text_hidden_size,
                rope_theta=256.0, t_scale=1000.0, axes_dims=list(spec.axes_dims), axes_lens=[1024, 512, 512])


def components(spec: TinyZImageSpec) -> dict:
    """``ZImagePipeline``'s components of ``spec``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel

    from common.builtin.tokenizer.qwen import qwen3_tokenizer
    from common.builtin.vaes import autoencoder_kl

    tokenizer = qwen3_tokenizer()
    return dict(
        transformer=seeded(spec, "transformer", lambda: ZImageTransformer2DModel(**transformer_config(spec))),
        vae=autoencoder_kl(spec, sample_size=1024, scaling_factor=VAE_SCALING_FACTOR, shift_factor=VAE_SHIFT_FACTOR),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG, shift=spec.shift),
        text_encoder=qwen3(spec, "text_encoder", tokenizer),
        tokenizer=tokenizer,
    )


# The parity sweep's choices (common/builtin/sweep.py): width, layers, heads and rope axes, the Qwen3 text
# model, the VAE's widths, the shift, and the request.
SWEEP_KNOBS = {
    "dim": (32, 48, 64), "n_layers": (1, 2), "n_refiner_layers": (1, 2), "n_heads": (1, 2), "n_kv_heads": (1, 2),
    "axes_dims": ((4, 6, 6), (8, 4, 4), (8, 8, 8), (4, 10, 10), (8, 12, 12)), "text_hidden_size": (32, 64),
    "text_num_layers": (2, 3), "vae_block_out_channels": ((4, 4, 8, 8), (8, 8, 16, 16), (4, 8, 8)), "shift": (1.0, 3.0, 6.0),
    "height": (32, 48, 64), "width": (32, 64, 80), "num_inference_steps": (2, 3, 4), "guidance_scale": (0.0, 5.0),
}
