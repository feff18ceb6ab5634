"""The built-in LTX-2 models: :class:`TinyLtx2Spec` (one configuration plus the request it serves), the table of
named specs, :data:`SPECS`, and their pipeline's :func:`components`: the layout of a real LTX-2 checkpoint
(``LTX2Pipeline``, or ``LTX2ImageToVideoPipeline`` for the image-to-video ones: the same components) with a
Gemma3 text encoder, the text connectors, the audio-video transformer, the video VAE (32x spatial, 8x temporal
as the real one), the audio VAE and the vocoder.

The streams' token widths are ``in_channels`` (video latent channels, patch 1) and ``audio_in_channels`` (audio
latent channels x mel bins / 4): equal in the named specs, as in LTX-2's checkpoints; another
``audio_latent_channels`` or ``mel_bins`` makes a model whose widths differ (``LTX2Pipeline`` runs it). The
transformer's blocks take the perturbed-attention processor (``perturbed_attn``, as LTX-2.3's config sets it) so
that spatio-temporal guidance perturbs the blocks the serving default names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from common.builtin.build import component_seed, seeded
from common.builtin.spec import BuiltinSpec, check_weights_dtype

AUDIO_DOWNSAMPLE = 4  # AutoencoderKLLTX2Audio's time and mel compression (two downsamplings, ch_mult of 3)
# FlowMatchEulerDiscreteScheduler as diffusers' LTX-2 conversion writes it (scripts/convert_ltx2_to_diffusers.py).
SCHEDULER_CONFIG = dict(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
                        max_image_seq_len=4096, shift_terminal=0.1)
VAE_SPATIAL, VAE_TEMPORAL = 32, 8  # patch 4 x three 2x levels in space; three 2x levels in time
VAE_DOWNSAMPLE_TYPES = ("spatial", "temporal", "spatiotemporal", "spatiotemporal")  # LTX-2.0's
SAMPLE_RATE, HOP_LENGTH = 16000, 160  # the audio VAE's mel spectrogram (100 mel frames a second)


@dataclass(frozen=True)
class TinyLtx2Spec(BuiltinSpec):
    """One tiny LTX-2 configuration (the pipeline's classes, smaller widths) plus the request it serves."""

    PIPELINE = "LTX2Pipeline"
    SERVING_DEFAULT_KEYS = ("height", "width", "num_frames", "frame_rate", "num_inference_steps",
                            "guidance_scale", "stg_block", "max_sequence_length")

    name: str
    image_to_video: bool = False
    # TeaCache's polynomial the built directory carries in step_cache.json (none is published for LTX-2): a line
    # fitted on small-ltx2-smooth by bench/fit_teacache.py --degree 1 over every guidance pass (2 prompts, 30
    # steps: R^2 0.86).
    teacache_coefficients: tuple[float, ...] = (5.38060050e-01, 4.09891032e-03)
    TEACACHE_FITTED_ON: ClassVar[str] = "small-ltx2-smooth"
    # Gemma3ForConditionalGeneration (its text model; a one-layer vision tower the class needs)
    text_hidden_size: int = 32
    text_num_layers: int = 2
    text_num_heads: int = 2
    text_num_kv_heads: int = 1
    text_head_dim: int = 16
    text_intermediate_size: int = 64
    text_sliding_window: int = 64
    # LTX2TextConnectors: heads x head_dim == text_hidden_size (the connectors run at the caption width)
    connector_num_heads: int = 2
    connector_num_layers: int = 1
    connector_num_registers: int = 8  # max_sequence_length must be a multiple of it
    # LTX2VideoTransformer3DModel
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    audio_num_attention_heads: int = 2
    audio_attention_head_dim: int = 8
    latent_channels: int = 16  # the video VAE's; the video tokens' width
    # AutoencoderKLLTX2Video
    vae_block_out_channels: tuple[int, ...] = (8, 16, 32, 32)
    vae_decoder_block_out_channels: tuple[int, ...] = (8, 16, 32)
    # AutoencoderKLLTX2Audio (its base width is the packed audio token width, as latents_mean's length):
    # audio_latent_channels * mel_bins / 4, the audio tokens' width (latent_channels's by default)
    audio_latent_channels: int = 4
    mel_bins: int = 16
    # LTX2Vocoder: 240x upsampling of 100 mel frames a second = 24 kHz, as the real one's
    vocoder_hidden_channels: int = 32
    vocoder_upsample_factors: tuple[int, ...] = (6, 5, 8)
    vocoder_output_sampling_rate: int = 24000
    # Default request
    height: int = 64
    width: int = 64
    num_frames: int = 9
    frame_rate: float = 24.0
    num_inference_steps: int = 4
    guidance_scale: float = 4.0
    max_sequence_length: int = 64  # (the pipeline's 1024 would make the tiny model's text most of its cost)
    stg_block: int = 1  # the block STG perturbs (the pipeline's spatio_temporal_guidance_blocks, one block)

    @property
    def pipeline(self) -> str:
        return "LTX2ImageToVideoPipeline" if self.image_to_video else "LTX2Pipeline"

    @property
    def audio_token_width(self) -> int:
        return self.audio_latent_channels * self.mel_bins // AUDIO_DOWNSAMPLE

    def __post_init__(self) -> None:
        for name in ("vae_block_out_channels", "vae_decoder_block_out_channels", "vocoder_upsample_factors",
                     ):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.connector_num_heads < 1 or self.text_hidden_size % self.connector_num_heads:
            raise ValueError("text_hidden_size must be a multiple of connector_num_heads")
        if self.mel_bins < AUDIO_DOWNSAMPLE or self.mel_bins % AUDIO_DOWNSAMPLE or self.audio_latent_channels < 1:
            raise ValueError("mel_bins must be a positive multiple of 4 and audio_latent_channels positive")
        if len(self.vae_block_out_channels) != 4 or len(self.vae_decoder_block_out_channels) != 3:
            raise ValueError("the video VAE has 4 encoder and 3 decoder levels (32x spatial, 8x temporal)")
        if self.height % VAE_SPATIAL or self.width % VAE_SPATIAL or (self.num_frames - 1) % VAE_TEMPORAL:
            raise ValueError("height and width must be multiples of 32 and num_frames of the form 8k+1")
        if self.vocoder_hidden_channels % 2 ** len(self.vocoder_upsample_factors):
            raise ValueError("vocoder_hidden_channels must halve at every upsampling")
        if not 0 <= self.stg_block < self.num_layers:
            raise ValueError("stg_block must name a block of the transformer")
        check_weights_dtype(self)


_SMALL = dict(text_hidden_size=64, text_num_heads=4, text_head_dim=16, text_intermediate_size=128,
              connector_num_heads=4, connector_num_layers=2, num_layers=8, num_attention_heads=8,
              attention_head_dim=32, audio_num_attention_heads=4, audio_attention_head_dim=32,
              vae_block_out_channels=(16, 32, 64, 64), vae_decoder_block_out_channels=(16, 32, 64),
              vocoder_hidden_channels=64, height=256, width=384, num_frames=25, num_inference_steps=10,
              stg_block=6)

SPECS: dict[str, TinyLtx2Spec] = {s.name: s for s in (
    TinyLtx2Spec(name="tiny-ltx2"),
    TinyLtx2Spec(name="tiny-ltx2-i2v", image_to_video=True, seed=1),
    # For benches: a few seconds a step on a 2-core CPU at its default request.
    TinyLtx2Spec(name="small-ltx2", seed=2, **_SMALL),
)}


def _statistics(spec, component: str, n: int):
    """Per-channel ``latents_mean`` / ``latents_std`` away from 0 / 1, so that de-normalisation is exercised."""
    import torch

    gen = torch.Generator().manual_seed(component_seed(spec, component + "/statistics"))
    return 0.1 * torch.randn(n, generator=gen), 0.5 + torch.rand(n, generator=gen)


def _with_statistics(spec, component: str, vae, n: int):
    import torch

    mean, std = _statistics(spec, component, n)
    with torch.no_grad():
        vae.latents_mean.copy_(mean)
        vae.latents_std.copy_(std)
    return vae


def transformer_config(spec: TinyLtx2Spec) -> dict:
    """``LTX2VideoTransformer3DModel`` arguments: LTX-2.0's structure with the spec's sizes, perturbed attention."""
    return dict(
        in_channels=spec.latent_channels, out_channels=spec.latent_channels, patch_size=1, patch_size_t=1,
        num_attention_heads=spec.num_attention_heads, attention_head_dim=spec.attention_head_dim,
        cross_attention_dim=spec.num_attention_heads * spec.attention_head_dim,
        vae_scale_factors=(VAE_TEMPORAL, VAE_SPATIAL, VAE_SPATIAL),
        audio_in_channels=spec.audio_token_width, audio_out_channels=spec.audio_token_width,
        audio_num_attention_heads=spec.audio_num_attention_heads,
        audio_attention_head_dim=spec.audio_attention_head_dim,
        audio_cross_attention_dim=spec.audio_num_attention_heads * spec.audio_attention_head_dim,
        audio_scale_factor=AUDIO_DOWNSAMPLE, audio_sampling_rate=SAMPLE_RATE, audio_hop_length=HOP_LENGTH,
        num_layers=spec.num_layers, caption_channels=spec.text_hidden_size, rope_type="split",
        perturbed_attn=True,
    )


def components(spec: TinyLtx2Spec) -> dict:
    """``LTX2Pipeline``'s components of ``spec``."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder

    from common.builtin.text_encoders import gemma3
    from common.builtin.tokenizer.gemma import gemma_tokenizer

    tokenizer = gemma_tokenizer()
    text_encoder = gemma3(spec, "text_encoder", tokenizer=tokenizer, hidden_size=spec.text_hidden_size,
                          intermediate_size=spec.text_intermediate_size, num_layers=spec.text_num_layers,
                          num_heads=spec.text_num_heads, num_kv_heads=spec.text_num_kv_heads,
                          head_dim=spec.text_head_dim, sliding_window=spec.text_sliding_window,
                          vision_hidden_size=16, vision_layers=1, vision_heads=2)
    head_dim = spec.text_hidden_size // spec.connector_num_heads
    connectors = dict(
        caption_channels=spec.text_hidden_size, text_proj_in_factor=spec.text_num_layers + 1,
        video_connector_num_attention_heads=spec.connector_num_heads, video_connector_attention_head_dim=head_dim,
        video_connector_num_layers=spec.connector_num_layers,
        video_connector_num_learnable_registers=spec.connector_num_registers,
        audio_connector_num_attention_heads=spec.connector_num_heads, audio_connector_attention_head_dim=head_dim,
        audio_connector_num_layers=spec.connector_num_layers,
        audio_connector_num_learnable_registers=spec.connector_num_registers,
        rope_type="split")
    vae = dict(
        latent_channels=spec.latent_channels, block_out_channels=spec.vae_block_out_channels,
        decoder_block_out_channels=spec.vae_decoder_block_out_channels, layers_per_block=(1,) * 5,
        decoder_layers_per_block=(1,) * 4, downsample_type=VAE_DOWNSAMPLE_TYPES,
        decoder_inject_noise=(False,) * 4, timestep_conditioning=True, decoder_causal=False,
        spatial_compression_ratio=VAE_SPATIAL, temporal_compression_ratio=VAE_TEMPORAL)
    audio_vae = dict(
        base_channels=spec.audio_token_width, ch_mult=(1, 2, 4), num_res_blocks=1,
        latent_channels=spec.audio_latent_channels, sample_rate=SAMPLE_RATE, mel_hop_length=HOP_LENGTH,
        mel_bins=spec.mel_bins)
    factors = spec.vocoder_upsample_factors
    vocoder = dict(
        in_channels=2 * spec.mel_bins, hidden_channels=spec.vocoder_hidden_channels, out_channels=2,
        upsample_factors=list(factors), upsample_kernel_sizes=[2 * f for f in factors], resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]], output_sampling_rate=spec.vocoder_output_sampling_rate)
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=_with_statistics(spec, "vae", seeded(spec, "vae", lambda: AutoencoderKLLTX2Video(**vae)),
                             spec.latent_channels),
        audio_vae=_with_statistics(spec, "audio_vae",
                                   seeded(spec, "audio_vae", lambda: AutoencoderKLLTX2Audio(**audio_vae)),
                                   spec.audio_token_width),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=seeded(spec, "connectors", lambda: LTX2TextConnectors(**connectors)),
        transformer=seeded(spec, "transformer", lambda: LTX2VideoTransformer3DModel(**transformer_config(spec))),
        vocoder=seeded(spec, "vocoder", lambda: LTX2Vocoder(**vocoder)),
    )


# The parity sweep's choices (common/builtin/sweep.py): the video and audio streams' heads, the Gemma-3 text
# model and its connectors, and the request's size, frames, rate and steps.
SWEEP_KNOBS = {
    "num_layers": (1, 2), "num_attention_heads": (1, 2), "attention_head_dim": (8, 16),
    "audio_num_attention_heads": (1, 2), "audio_attention_head_dim": (4, 8), "text_hidden_size": (32, 64),
    "connector_num_layers": (1, 2), "connector_num_registers": (4, 8), "audio_latent_channels": (2, 4, 8),
    "latent_channels": (8, 16),
    # (the VAE decoder's reflection padding needs latents of 2 or more: 64 px at its 32x)
    "height": (64, 96), "width": (64, 96, 128), "num_frames": (1, 9, 17), "frame_rate": (24.0, 12.5),
    "num_inference_steps": (2, 3), "guidance_scale": (1.0, 4.0),
}
