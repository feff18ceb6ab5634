"""The built-in FLUX.2 [klein] models: :class:`TinyFlux2KleinSpec` (one configuration plus the request it serves),
the table of named specs, :data:`SPECS`, and their pipeline's :func:`components`: the layout of a real
black-forest-labs/FLUX.2-klein checkpoint (a ``Qwen3ForCausalLM`` in ``text_encoder/`` with its Qwen2 tokenizer,
``Flux2Transformer2DModel``, ``AutoencoderKLFlux2``, flow-match Euler, ``is_distilled`` in model_index.json).

The pipeline stacks the text encoder's hidden states of layers (9, 18, 27) by default, so every built-in Qwen3
has at least 27 layers (narrow ones: the encoder stays cheap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from common.builtin.build import component_seed, seeded
from common.builtin.spec import BuiltinSpec, check_weights_dtype
from common.builtin.text_encoders import qwen3

# Flux2KleinPipeline's default text_encoder_out_layers: hidden_states[27] needs 27 decoder layers.
TEXT_ENCODER_OUT_LAYERS = (9, 18, 27)
# AutoencoderKLFlux2 halves the image at every level after the first (four: 8x, as FLUX.2's); the pipeline
# packs 2x2 latent patches into channels.
PACK_SIZE = 2
ROPE_AXES = 4  # Flux2Transformer2DModel's position ids: (t, h, w, l)
# The FlowMatchEulerDiscreteScheduler config FLUX.2 ships: the pipeline hands it its own mu
# (compute_empirical_mu), so the base / max shifts are never read.
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                        max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
                        time_shift_type="exponential")
@dataclass(frozen=True, kw_only=True)
class TinyFlux2KleinSpec(BuiltinSpec):
    """One tiny FLUX.2 [klein] configuration plus the request it serves."""

    PIPELINE = "Flux2KleinPipeline"
    SERVING_DEFAULT_KEYS = ("height", "width", "num_inference_steps", "guidance_scale", "max_sequence_length")

    name: str
    # TeaCache's polynomial the built directory carries in step_cache.json (none is published for FLUX.2): a line
    # fitted on small-flux2-klein-smooth by bench/fit_teacache.py --degree 1 (2 prompts, 20 steps: R^2 0.99).
    teacache_coefficients: tuple[float, ...] = (5.31693963e-01, 5.99864963e-03)
    TEACACHE_FITTED_ON: ClassVar[str] = "small-flux2-klein-smooth"
    # model_index.json's is_distilled: a step-distilled checkpoint runs without classifier-free guidance.
    is_distilled: bool = False
    # Text encoder (Qwen3ForCausalLM); the transformer's joint_attention_dim is 3x its hidden size.
    text_hidden_size: int = 16
    text_intermediate_size: int = 32
    text_num_layers: int = 27
    text_num_heads: int = 2
    text_num_kv_heads: int = 1
    text_head_dim: int = 8
    # Transformer (Flux2Transformer2DModel).
    num_layers: int = 1
    num_single_layers: int = 1
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, ...] = (4, 4, 4, 4)
    timestep_guidance_channels: int = 32
    # VAE (AutoencoderKLFlux2): latent_channels x 4 is the transformer's in_channels.
    latent_channels: int = 8
    vae_block_out_channels: tuple[int, ...] = (8, 8, 16, 16)
    vae_norm_num_groups: int = 4
    # Default request.
    height: int = 64
    width: int = 64
    num_inference_steps: int = 4
    guidance_scale: float = 4.0
    max_sequence_length: int = 64

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        object.__setattr__(self, "vae_block_out_channels", tuple(self.vae_block_out_channels))
        if self.text_num_layers < max(TEXT_ENCODER_OUT_LAYERS):
            raise ValueError(f"text_num_layers must be >= {max(TEXT_ENCODER_OUT_LAYERS)} (the pipeline's "
                             f"text_encoder_out_layers {TEXT_ENCODER_OUT_LAYERS})")
        if self.text_num_heads % self.text_num_kv_heads:
            raise ValueError("text_num_heads must be a multiple of text_num_kv_heads")
        if len(self.axes_dims_rope) != ROPE_AXES or sum(self.axes_dims_rope) != self.attention_head_dim \
                or any(d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope must be {ROPE_AXES} even dimensions summing to attention_head_dim")
        if len(self.vae_block_out_channels) < 2 \
                or any(c % self.vae_norm_num_groups for c in self.vae_block_out_channels):
            raise ValueError("vae_block_out_channels: at least 2 multiples of vae_norm_num_groups")
        multiple = 2 ** (len(self.vae_block_out_channels) - 1) * PACK_SIZE
        if self.height % multiple or self.width % multiple:
            raise ValueError(f"height and width must be multiples of {multiple}")
        if self.is_distilled and self.guidance_scale > 1:
            raise ValueError("a distilled model's guidance_scale must be <= 1 (no classifier-free guidance)")
        check_weights_dtype(self)


SPECS: dict[str, TinyFlux2KleinSpec] = {
    spec.name: spec
    for spec in (
        # The base (non-distilled) layout: CFG with the empty prompt; a 64x64, 4-step call well under a second.
        TinyFlux2KleinSpec(name="tiny-flux2-klein"),
        # A compute-bound transformer for benches (about 17M parameters: 5 double-stream and 10 single-stream
        # blocks at width 256), distilled as FLUX.2-klein-4B (4 steps, no CFG), 256x256.
        TinyFlux2KleinSpec(name="small-flux2-klein", is_distilled=True, seed=1, text_hidden_size=64,
                           text_intermediate_size=128, text_num_heads=4, text_num_kv_heads=2, text_head_dim=16,
                           num_layers=5, num_single_layers=10, num_attention_heads=4, attention_head_dim=64,
                           axes_dims_rope=(16, 16, 16, 16), timestep_guidance_channels=256, latent_channels=32,
                           vae_block_out_channels=(8, 16, 32, 32), vae_norm_num_groups=8, height=256, width=256,
                           guidance_scale=1.0),
    )
}


def vae(spec: TinyFlux2KleinSpec):
    """``AutoencoderKLFlux2`` with seeded batch-norm statistics (the defaults, mean 0 and variance 1, would
    make the pipeline's normalisation an identity no test could tell from a missing one)."""
    import torch
    from diffusers import AutoencoderKLFlux2

    levels = len(spec.vae_block_out_channels)
    model = seeded(spec, "vae", lambda: AutoencoderKLFlux2(
        block_out_channels=spec.vae_block_out_channels, down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels, layers_per_block=1, latent_channels=spec.latent_channels,
        norm_num_groups=spec.vae_norm_num_groups, sample_size=1024))
    gen = torch.Generator().manual_seed(component_seed(spec, "vae/bn"))
    with torch.no_grad():
        model.bn.running_mean.copy_(0.3 * torch.randn(model.bn.num_features, generator=gen))
        model.bn.running_var.copy_(0.5 + torch.rand(model.bn.num_features, generator=gen))
    return model


def components(spec: TinyFlux2KleinSpec) -> dict:
    """``Flux2KleinPipeline``'s components of ``spec`` (and its ``is_distilled`` flag)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    from common.builtin.tokenizer.qwen import qwen3_tokenizer

    tok = qwen3_tokenizer()
    transformer = dict(patch_size=1, in_channels=spec.latent_channels * PACK_SIZE * PACK_SIZE, out_channels=None,
                       num_layers=spec.num_layers, num_single_layers=spec.num_single_layers,
                       attention_head_dim=spec.attention_head_dim, num_attention_heads=spec.num_attention_heads,
                       joint_attention_dim=spec.text_hidden_size * len(TEXT_ENCODER_OUT_LAYERS),
                       timestep_guidance_channels=spec.timestep_guidance_channels, axes_dims_rope=spec.axes_dims_rope,
                       guidance_embeds=False)
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=vae(spec),
        text_encoder=qwen3(spec, "text_encoder", tok, causal_lm=True),
        tokenizer=tok,
        transformer=seeded(spec, "transformer", lambda: Flux2Transformer2DModel(**transformer)),
        is_distilled=spec.is_distilled,
    )


# The parity sweep's choices (common/builtin/sweep.py): the two block kinds, heads, rope axes, the timestep
# guidance width, latent channels, the VAE's widths, distilled or not, and the request.
SWEEP_KNOBS = {
    "num_layers": (1, 2), "num_single_layers": (1, 2), "num_attention_heads": (1, 2),
    "attention_head_dim": (16, 32), "axes_dims_rope": ((4, 4, 4, 4), (8, 8, 8, 8), (2, 2, 6, 6)),
    "timestep_guidance_channels": (16, 32), "latent_channels": (4, 8),
    "vae_block_out_channels": ((8, 8, 16, 16), (4, 8, 8, 8), (8, 8, 16)), "is_distilled": (False, True),
    "height": (32, 64), "width": (32, 48, 64), "num_inference_steps": (2, 3, 4), "guidance_scale": (1.0, 4.0),
}
