"""The tiny FLUX.1 models' specs: :class:`TinyFluxSpec` (one configuration plus the request it serves) and
the table of named specs, :data:`SPECS` (see :mod:`common.families.flux.tiny_model`)."""

from __future__ import annotations

from typing import ClassVar
from dataclasses import dataclass
from pathlib import Path

from common.families.wan.tiny_specs import WEIGHT_DTYPES
from common.families.wan.tiny_tokenizer import FIXED_TOKENS

# AutoencoderKL with four levels downsamples 8x, as FLUX's VAE does.
VAE_LEVELS = 4
VAE_SPATIAL_STRIDE = 2 ** (VAE_LEVELS - 1)
# FluxPipeline packs the latents into 2x2 patches.
PACK_SIZE = 2
# FluxPipeline.check_inputs refuses longer T5 prompts.
MAX_T5_SEQUENCE_LENGTH = 512
# The rotary embedding's axes: the (unused) text axis, then latent rows and columns.
ROPE_AXES = 3


@dataclass(frozen=True)
class TinyFluxSpec:
    """One tiny FLUX.1 text-to-image configuration plus the request it is meant to serve."""

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
    # CLIP-L (CLIPTextModel, quick_gelu as openai/clip-vit-large-patch14); FLUX uses its pooled output.
    clip_l_hidden_size: int = 32
    clip_l_num_layers: int = 2
    clip_l_num_heads: int = 2
    clip_l_intermediate_size: int = 64
    # T5 (T5EncoderModel, gated-gelu as t5-v1_1-xxl); t5_d_model is the transformer's joint_attention_dim.
    t5_d_model: int = 32
    t5_d_kv: int = 16
    t5_d_ff: int = 64
    t5_num_layers: int = 2
    t5_num_heads: int = 2
    t5_vocab_size: int = 256
    # VAE (AutoencoderKL with 16 latent channels, FLUX's scaling and shift factors).
    vae_block_out_channels: tuple[int, ...] = (4, 4, 8, 8)
    vae_layers_per_block: int = 1
    vae_norm_num_groups: int = 4
    # Scheduler (FlowMatchEulerDiscreteScheduler) as FLUX.1-dev ships it: the shift follows the image
    # sequence length, from base_shift at base_image_seq_len to max_shift at max_image_seq_len.
    shift: float = 3.0
    use_dynamic_shifting: bool = True
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    seed: int = 0
    # How the safetensors files store the weights (they are generated in float32 either way).
    weights_dtype: str = "float32"
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

    def __post_init__(self) -> None:
        # Lists would leave the spec unhashable.
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        object.__setattr__(self, "vae_block_out_channels", tuple(self.vae_block_out_channels))
        self._check_transformer()
        self._check_text_encoders()
        self._check_vae()
        self._check_scheduler()
        self._check_request()
        if self.weights_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weights_dtype must be one of {WEIGHT_DTYPES}")

    def _check_transformer(self) -> None:
        if min(self.num_layers, self.num_attention_heads, self.attention_head_dim) < 1 or self.num_single_layers < 0:
            raise ValueError("transformer sizes must be positive")
        if len(self.axes_dims_rope) != ROPE_AXES or any(d < 2 or d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope must be {ROPE_AXES} positive even dimensions")
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError("axes_dims_rope must sum to attention_head_dim")

    def _check_text_encoders(self) -> None:
        hidden, heads = self.clip_l_hidden_size, self.clip_l_num_heads
        if min(hidden, heads, self.clip_l_num_layers, self.clip_l_intermediate_size) < 1 or hidden % heads:
            raise ValueError("clip_l_hidden_size must be a positive multiple of clip_l_num_heads")
        if min(self.t5_d_model, self.t5_d_kv, self.t5_d_ff, self.t5_num_layers, self.t5_num_heads) < 1:
            raise ValueError("T5 sizes must be positive")
        if self.t5_vocab_size <= FIXED_TOKENS:
            raise ValueError("t5_vocab_size too small for the T5 tokenizer's alphabet")

    def _check_vae(self) -> None:
        if len(self.vae_block_out_channels) != VAE_LEVELS:
            raise ValueError(f"vae_block_out_channels must have {VAE_LEVELS} entries (8x downsampling)")
        if self.vae_norm_num_groups < 1 or any(c % self.vae_norm_num_groups for c in self.vae_block_out_channels):
            raise ValueError("every VAE width must be a multiple of vae_norm_num_groups")
        if self.vae_layers_per_block < 1:
            raise ValueError("vae_layers_per_block must be >= 1")

    def _check_scheduler(self) -> None:
        if self.shift <= 0:
            raise ValueError("shift must be > 0")
        # calculate_shift interpolates between the two sequence lengths.
        if not 0 < self.base_image_seq_len < self.max_image_seq_len:
            raise ValueError("base_image_seq_len must be positive and below max_image_seq_len")

    def _check_request(self) -> None:
        # The pipeline needs whole 2x2 packs of whole latent pixels (16 px).
        multiple = VAE_SPATIAL_STRIDE * PACK_SIZE
        if self.height % multiple or self.width % multiple or min(self.height, self.width) < multiple:
            raise ValueError(f"height and width must be positive multiples of {multiple}")
        if not 1 <= self.max_sequence_length <= MAX_T5_SEQUENCE_LENGTH:
            raise ValueError(f"max_sequence_length must be in [1, {MAX_T5_SEQUENCE_LENGTH}]")
        if self.num_inference_steps < 1:
            raise ValueError("num_inference_steps must be >= 1")
        if self.guidance_scale < 0 or self.true_cfg_scale < 1:
            raise ValueError("guidance_scale must be >= 0 and true_cfg_scale >= 1 (1: no true CFG)")

    def build(self, out_dir: str | Path) -> Path:
        """Write this model's diffusers directory into ``out_dir`` and return it."""
        from common.families.flux.tiny_model import build_tiny_flux

        return build_tiny_flux(self, out_dir)


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
