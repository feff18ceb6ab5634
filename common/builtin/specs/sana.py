"""The built-in SANA models: :class:`TinySanaSpec` (one configuration plus the request it serves), the table of
named specs, :data:`SPECS`, and their pipeline's :func:`components`: the layout of a real SANA checkpoint (a
Gemma2 model in ``text_encoder/``, a Gemma tokenizer in ``tokenizer/``, ``AutoencoderDC`` in ``vae/``, the
DPM-Solver the diffusers checkpoints ship)."""

from __future__ import annotations

from dataclasses import dataclass

from common.builtin.build import seeded
from common.builtin.spec import BuiltinSpec, check_weights_dtype

# AutoencoderDC as SANA's DC-AE: six levels (32x), ResBlocks then EfficientViT blocks, batch / RMS norms.
VAE_LEVELS = 6
VAE_BLOCK_TYPES = ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3
VAE_NORM_TYPES = ("batch_norm",) * 3 + ("rms_norm",) * 3
VAE_ACT_FNS = ("relu",) * 3 + ("silu",) * 3
VAE_QKV_MULTISCALES = ((),) * 3 + ((5,),) * 3
VAE_SCALING_FACTOR = 0.41407  # Sana's DC-AE f32c32
VAE_SPATIAL_STRIDE = 2 ** (VAE_LEVELS - 1)
# DPMSolverMultistepScheduler as Sana's diffusers checkpoints ship it (flow prediction, flow sigmas).
SCHEDULER_CONFIG = dict(
    algorithm_type="dpmsolver++", beta_end=0.02, beta_schedule="linear", beta_start=0.0001,
    dynamic_thresholding_ratio=0.995, euler_at_final=False, final_sigmas_type="zero", lower_order_final=True,
    num_train_timesteps=1000, prediction_type="flow_prediction", sample_max_value=1.0, solver_order=2,
    solver_type="midpoint", steps_offset=0, thresholding=False, timestep_spacing="linspace", use_beta_sigmas=False,
    use_exponential_sigmas=False, use_flow_sigmas=True, use_karras_sigmas=False, variance_type=None)
SAMPLE_SIZES = (16, 32, 64, 128)  # SanaPipeline's resolution bins (512, 1024, 2048, 4096 px)


@dataclass(frozen=True)
class TinySanaSpec(BuiltinSpec):
    """One tiny SANA configuration (SanaPipeline's classes, smaller widths) plus the request it serves."""

    PIPELINE = "SanaPipeline"
    SERVING_DEFAULT_KEYS = ("height", "width", "num_inference_steps", "guidance_scale", "max_sequence_length")

    name: str
    # SanaTransformer2DModel
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 8
    num_cross_attention_heads: int = 2
    cross_attention_head_dim: int = 8
    mlp_ratio: float = 2.5
    sample_size: int = 16
    latent_channels: int = 4
    timestep_scale: float = 1.0
    # Gemma2Model
    text_hidden_size: int = 32
    text_num_layers: int = 2
    text_num_heads: int = 2
    text_num_kv_heads: int = 1
    text_head_dim: int = 16
    text_intermediate_size: int = 64
    # AutoencoderDC: widths per level
    vae_block_out_channels: tuple[int, ...] = (4, 4, 8, 8, 8, 8)
    vae_attention_head_dim: int = 4
    flow_shift: float = 3.0
    # Default request
    height: int = 512
    width: int = 512
    num_inference_steps: int = 4
    guidance_scale: float = 4.5
    max_sequence_length: int = 64

    def __post_init__(self) -> None:
        object.__setattr__(self, "vae_block_out_channels", tuple(self.vae_block_out_channels))
        if self.sample_size not in SAMPLE_SIZES:
            raise ValueError(f"sample_size must be one of {SAMPLE_SIZES} (SanaPipeline's resolution bins)")
        if len(self.vae_block_out_channels) != VAE_LEVELS:
            raise ValueError(f"vae_block_out_channels must have {VAE_LEVELS} entries (32x)")
        if any(c % self.vae_attention_head_dim for c in self.vae_block_out_channels[3:]):
            raise ValueError("the EfficientViT levels' widths must be multiples of vae_attention_head_dim")
        if self.height % VAE_SPATIAL_STRIDE or self.width % VAE_SPATIAL_STRIDE:
            raise ValueError(f"height and width must be multiples of {VAE_SPATIAL_STRIDE}")
        check_weights_dtype(self)


SPECS: dict[str, TinySanaSpec] = {s.name: s for s in (
    # Tiny everything: a forward takes a few ms on a CPU; the default request is the 512 px bin.
    TinySanaSpec(name="tiny-sana"),
    # A compute-bound transformer for CPU benchmarks; text encoder and VAE stay small.
    TinySanaSpec(name="small-sana", num_layers=8, num_attention_heads=4, attention_head_dim=32,
                 num_cross_attention_heads=4, cross_attention_head_dim=32, sample_size=16, latent_channels=8,
                 text_hidden_size=128, text_num_layers=2, text_num_heads=4, text_num_kv_heads=2, text_head_dim=32,
                 text_intermediate_size=256, vae_block_out_channels=(8, 8, 16, 16, 32, 32), seed=1,
                 num_inference_steps=10),
)}


def components(spec: TinySanaSpec) -> dict:
    """``SanaPipeline``'s components of ``spec``: the transformer, ``AutoencoderDC``, the DPM-Solver, Gemma2
    and its tokenizer."""
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaTransformer2DModel

    from common.builtin.text_encoders import gemma2
    from common.builtin.tokenizer.gemma import gemma_tokenizer
    from common.families.sana.text import complex_human_instruction

    # The pipeline's instruction before every prompt: the tokenizer learns it into a few hundred tokens.
    tokenizer = gemma_tokenizer(complex_human_instruction())
    inner = spec.num_attention_heads * spec.attention_head_dim
    transformer = seeded(spec, "transformer", lambda: SanaTransformer2DModel(
        in_channels=spec.latent_channels, out_channels=spec.latent_channels,
        num_attention_heads=spec.num_attention_heads, attention_head_dim=spec.attention_head_dim,
        num_layers=spec.num_layers, num_cross_attention_heads=spec.num_cross_attention_heads,
        cross_attention_head_dim=spec.cross_attention_head_dim, cross_attention_dim=inner,
        caption_channels=spec.text_hidden_size, mlp_ratio=spec.mlp_ratio, sample_size=spec.sample_size,
        patch_size=1, timestep_scale=spec.timestep_scale))
    text_encoder = gemma2(spec, "text_encoder", tokenizer, hidden_size=spec.text_hidden_size,
                          intermediate_size=spec.text_intermediate_size, num_layers=spec.text_num_layers,
                          num_heads=spec.text_num_heads, num_kv_heads=spec.text_num_kv_heads,
                          head_dim=spec.text_head_dim)
    levels = (1,) * VAE_LEVELS
    vae = seeded(spec, "vae", lambda: AutoencoderDC(
        in_channels=3, latent_channels=spec.latent_channels, attention_head_dim=spec.vae_attention_head_dim,
        encoder_block_types=VAE_BLOCK_TYPES, decoder_block_types=VAE_BLOCK_TYPES,
        encoder_block_out_channels=spec.vae_block_out_channels, decoder_block_out_channels=spec.vae_block_out_channels,
        encoder_layers_per_block=levels, decoder_layers_per_block=levels,
        encoder_qkv_multiscales=VAE_QKV_MULTISCALES, decoder_qkv_multiscales=VAE_QKV_MULTISCALES,
        upsample_block_type="interpolate", downsample_block_type="Conv", decoder_norm_types=VAE_NORM_TYPES,
        decoder_act_fns=VAE_ACT_FNS, scaling_factor=VAE_SCALING_FACTOR))
    return dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                scheduler=DPMSolverMultistepScheduler(**SCHEDULER_CONFIG, flow_shift=spec.flow_shift))


# The parity sweep's choices (common/builtin/sweep.py): self- and cross-attention heads and widths, the MLP, the
# Gemma-2 text model, the flow shift, and the request (sizes SanaPipeline's bins keep).
SWEEP_KNOBS = {
    "num_layers": (1, 2, 3), "num_attention_heads": (1, 2, 4), "attention_head_dim": (8, 16),
    "num_cross_attention_heads": (1, 2), "cross_attention_head_dim": (8, 16), "mlp_ratio": (2.0, 2.5),
    "text_hidden_size": (32, 64), "text_num_layers": (1, 2), "text_num_heads": (1, 2), "text_head_dim": (8, 16),
    "flow_shift": (1.0, 3.0, 4.5), "latent_channels": (4, 8, 16), "num_inference_steps": (2, 3, 4), "guidance_scale": (1.0, 4.5),
    "max_sequence_length": (32, 64),
}
