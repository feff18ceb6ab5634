"""Wan text-to-video (``WanPipeline``): Wan2.1, and Wan2.2 with two experts.

- encoder: the tokenizer and UMT5 (:mod:`common.families.wan.text`); a prompt travels as its trimmed
  embeddings ``prompt_embeds`` [L, D], zero-padded back to ``max_sequence_length`` on the denoise worker;
- denoise: ``WanTransformer3DModel`` (``transformer``, and ``transformer_2`` with ``boundary_ratio``),
  called with ``encoder_hidden_states``; guidance as two forwards, as ``WanPipeline`` runs it; the
  cross-attention's text side is shared by the rows of one text; diffusers' context-parallel plan;
- decode: ``AutoencoderKLWan`` with ``latents_mean`` / ``latents_std``;
- latents ``(1, 16, (F - 1) // 4 + 1, H / 8, W / 8)``; serving UniPC (flow prediction), rollout Euler.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from common.diffusion.binding import Binding, Geometry
from common.families.wan.text import MAX_SEQUENCE_LENGTH, WanTextEncoder, pad_embeddings
from common.protocol.messages import PROMPT_EMBEDS


class WanBinding(Binding):
    family = "wan"
    pipeline = "WanPipeline"
    video = True
    # WanPipeline's own defaults (480p).
    defaults = {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50, "guidance_scale": 5.0,
                "max_sequence_length": MAX_SEQUENCE_LENGTH}
    fields = frozenset({"num_frames", "guidance_scale_2", "max_sequence_length"})
    text_fields = (PROMPT_EMBEDS,)
    shares_text = True
    context_parallel = True
    # Wan2.1 / Wan2.2 text-to-video models make 16 frames per second (diffusers' examples export at 16).
    fps = 16

    def geometry(self, path: Path, transformer_config: dict) -> Geometry:
        import json

        vcfg = json.loads((path / "vae" / "config.json").read_text())
        # AutoencoderKLWan stores its strides in the config; Wan2.1's VAE uses 8 and 4.
        return Geometry(latent_channels=int(transformer_config.get("in_channels", 16)),
                        vae_scale_spatial=int(vcfg.get("scale_factor_spatial", 8)),
                        vae_scale_temporal=int(vcfg.get("scale_factor_temporal", 4)),
                        patch_size=tuple(transformer_config.get("patch_size", (1, 2, 2))))

    def latent_shape(self, info, height: int, width: int, num_frames: int) -> tuple[int, ...]:
        return (1, info.latent_channels, (num_frames - 1) // info.vae_scale_temporal + 1,
                height // info.vae_scale_spatial, width // info.vae_scale_spatial)

    def load_expert(self, path: Path, dtype: torch.dtype) -> torch.nn.Module:
        return WanTransformer3DModel.from_pretrained(path, dtype=dtype)

    def load_text_encoder(self, info, dtype: torch.dtype, device) -> WanTextEncoder:
        return WanTextEncoder.load(info.path, dtype, device)

    def conditioning(self, wire: dict[str, torch.Tensor], max_sequence_length: int) -> torch.Tensor:
        return pad_embeddings(wire[PROMPT_EMBEDS.name], max_sequence_length)

    def example_text(self, model, max_sequence_length: int, generator, device, dtype) -> torch.Tensor:
        return torch.randn(1, max_sequence_length, model.config.text_dim, generator=generator, device=device,
                           dtype=dtype)

    def load_decoder(self, info, dtype: torch.dtype, device):
        from common.families.wan.vae import WanDecoder

        return WanDecoder.load(info.path, dtype, device)
