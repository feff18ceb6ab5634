"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``).

- encoder: CLIP-L, CLIP-G and T5 (:mod:`common.families.sd3.text`); a prompt travels as
  ``prompt_embeds`` [77 + max_sequence_length, D] and ``pooled_prompt_embeds`` [P];
- denoise: ``SD3Transformer2DModel(hidden_states, encoder_hidden_states, pooled_projections, timestep)``,
  the pooled projection per row; guidance with both halves in one forward ([uncond, cond]), as the
  pipeline batches them; joint attention, so no shared text side; no context-parallel plan in diffusers;
- decode: ``AutoencoderKL`` (16 channels), ``latents / scaling_factor + shift_factor``;
- latents ``(1, 16, H / 8, W / 8)``; serving and rollout both flow-match Euler (static shift, 3.0 for SD3.5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.diffusion.binding import Binding
from common.diffusion.parts.decoder import AutoencoderKLDecoder
from common.diffusion.parts.guidance import Guidance
from common.diffusion.parts.latents import Geometry, LatentsPart, autoencoder_kl_scale
from common.diffusion.parts.text import HIDDEN, POOLED_PROMPT_EMBEDS, TextCond, TextPart
from common.diffusion.parts.transformer import JOINT_ATTENTION_PROJECTIONS, TransformerPart
from common.diffusion.request_fields import max_sequence_length
from common.protocol.messages import PROMPT_EMBEDS

POOLED = "pooled_projections"  # the transformer's keyword for the pooled text
CLIP_TOKENS = 77  # the CLIP tokenizers' length: the joined sequence is 77 + max_sequence_length tokens


def geometry(path, transformer_config: dict) -> Geometry:
    p = int(transformer_config.get("patch_size", 2))
    return Geometry(latent_channels=int(transformer_config.get("in_channels", 16)),
                    vae_scale_spatial=autoencoder_kl_scale(path), patch_size=(p, p))


def load_text_encoder(info, dtype: torch.dtype, device):
    from common.families.sd3.text import SD3TextEncoder

    return SD3TextEncoder.load(info.path, dtype, device)


def example_text(info, model, max_sequence_length: int, generator, device, dtype) -> TextCond:
    c = model.config
    return TextCond({
        HIDDEN: torch.randn(1, CLIP_TOKENS + max_sequence_length, c.joint_attention_dim, generator=generator,
                            device=device, dtype=dtype),
        POOLED: torch.randn(1, c.pooled_projection_dim, generator=generator, device=device, dtype=dtype)})


@dataclass(frozen=True, kw_only=True)
class SD3Transformer(TransformerPart):
    model_class: str = "SD3Transformer2DModel"
    # Flow-GRPO's SD3 LoRA: both streams' attention projections of every joint block.
    lora_targets: tuple[str, ...] = JOINT_ATTENTION_PROJECTIONS

    # No published TeaCache polynomial for this signal: teacache needs the directory's step_cache.json (the
    # built-in models carry one fitted on small-sd3-smooth; a real checkpoint: bench/fit_teacache.py MODEL_DIR --write).
    def modulated_input(self, model, timestep, text, guidance) -> torch.Tensor:
        return model.time_text_embed(timestep.to(text[POOLED].dtype), text[POOLED])


SD3 = Binding(
    family="sd3", pipeline="StableDiffusion3Pipeline", words=("sd3", "stable diffusion"),
    # SD3Transformer2DModel takes no text mask: the joint attention attends CLIP's and T5's padding tokens.
    text=TextPart(fields=(PROMPT_EMBEDS, POOLED_PROMPT_EMBEDS), keywords=(HIDDEN, POOLED),
                  load_encoder=load_text_encoder, example=example_text),
    latents=LatentsPart(geometry=geometry), transformer=SD3Transformer(), decoder=AutoencoderKLDecoder,
    guidance=Guidance(in_one_forward=True),
    # StableDiffusion3Pipeline's own defaults (height and width: the transformer's sample size x 8).
    defaults={"height": 1024, "width": 1024, "num_frames": 1, "num_inference_steps": 28, "guidance_scale": 7.0,
              "max_sequence_length": 256},
    default_size=lambda tcfg, geometry: int(tcfg.get("sample_size", 128)) * geometry.vae_scale_spatial,
    request_fields=(max_sequence_length(),))
