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

import json
from pathlib import Path

import torch
from diffusers import SD3Transformer2DModel

from common.diffusion.binding import HIDDEN, Binding, Geometry, TextCond
from common.diffusion.vae_tiling import VaeTiling
from common.protocol.messages import POOLED_PROMPT_EMBEDS, PROMPT_EMBEDS

POOLED = "pooled_projections"  # the transformer's keyword for the pooled text
CLIP_TOKENS = 77  # the CLIP tokenizers' length: the joined sequence is 77 + max_sequence_length tokens


class SD3Binding(Binding):
    family = "sd3"
    pipeline = "StableDiffusion3Pipeline"
    video = False
    # StableDiffusion3Pipeline's own defaults (height and width: the transformer's sample size x 8).
    defaults = {"height": 1024, "width": 1024, "num_frames": 1, "num_inference_steps": 28, "guidance_scale": 7.0,
                "max_sequence_length": 256}
    fields = frozenset({"max_sequence_length"})
    text_fields = (PROMPT_EMBEDS, POOLED_PROMPT_EMBEDS)
    # SD3Transformer2DModel takes no text mask: the joint attention attends CLIP's and T5's padding tokens.
    masks_text_padding = False
    guidance_in_one_forward = True
    # Flow-GRPO's SD3 LoRA: both streams' attention projections of every joint block.
    lora_targets = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                    "attn.to_out.0", "attn.to_q", "attn.to_v")

    def geometry(self, path: Path, transformer_config: dict) -> Geometry:
        vcfg = json.loads((path / "vae" / "config.json").read_text())
        p = int(transformer_config.get("patch_size", 2))
        return Geometry(latent_channels=int(transformer_config.get("in_channels", 16)),
                        vae_scale_spatial=2 ** (len(vcfg.get("block_out_channels", [0] * 4)) - 1),
                        patch_size=(p, p))

    def pipeline_defaults(self, transformer_config: dict, geometry: Geometry) -> dict:
        size = int(transformer_config.get("sample_size", 128)) * geometry.vae_scale_spatial
        return {**self.defaults, "height": size, "width": size}

    def latent_shape(self, info, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        return (1, info.latent_channels, height // info.vae_scale_spatial, width // info.vae_scale_spatial)

    def load_expert(self, path: Path, dtype: torch.dtype) -> torch.nn.Module:
        return SD3Transformer2DModel.from_pretrained(path, dtype=dtype)

    def load_text_encoder(self, info, dtype: torch.dtype, device):
        from common.families.sd3.text import SD3TextEncoder

        return SD3TextEncoder.load(info.path, dtype, device)

    def conditioning(self, wire: dict[str, torch.Tensor], max_sequence_length: int) -> TextCond:
        return TextCond({HIDDEN: wire[PROMPT_EMBEDS.name][None], POOLED: wire[POOLED_PROMPT_EMBEDS.name][None]})

    # No published TeaCache polynomial for this signal: teacache needs the directory's step_cache.json (the
    # built-in models carry one fitted on small-sd3-smooth; a real checkpoint: bench/fit_teacache.py MODEL_DIR --write).

    def modulated_input(self, model, timestep, text, guidance) -> torch.Tensor:
        return model.time_text_embed(timestep.to(text[POOLED].dtype), text[POOLED])

    def example_text(self, info, model, max_sequence_length: int, generator, device, dtype) -> TextCond:
        c = model.config
        return TextCond({
            HIDDEN: torch.randn(1, CLIP_TOKENS + max_sequence_length, c.joint_attention_dim, generator=generator,
                                device=device, dtype=dtype),
            POOLED: torch.randn(1, c.pooled_projection_dim, generator=generator, device=device, dtype=dtype)})

    def load_decoder(self, info, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()):
        from common.families.sd3.vae import SD3Decoder

        return SD3Decoder.load(info.path, dtype, device, tiling)
