"""Wan text-to-video (``WanPipeline``): Wan2.1, and Wan2.2 with two experts.

- encoder: the tokenizer and UMT5 (:mod:`common.families.wan.text`); a prompt travels as its trimmed
  embeddings ``prompt_embeds`` [L, D], zero-padded back to ``max_sequence_length`` on the denoise worker;
- denoise: ``WanTransformer3DModel`` (``transformer``, and ``transformer_2`` with ``boundary_ratio``),
  called with ``encoder_hidden_states``; guidance as two forwards, as ``WanPipeline`` runs it; the
  cross-attention's text side is shared by the rows of one text; diffusers' context-parallel plan;
- decode: ``AutoencoderKLWan`` with ``latents_mean`` / ``latents_std``;
- latents ``(1, 16, (F - 1) // 4 + 1, H / 8, W / 8)``; serving UniPC (flow prediction), rollout Euler;
- Wan2.2 TI2V-5B (``expand_timesteps`` in ``model_index.json``): a 48-channel VAE with 16x spatial
  compression, a timestep per latent token, and an optional ``image``: the encoder worker sends frame 0's
  latent (``image_condition`` [48, 1, H', W']), which replaces frame 0 in every model input (its tokens'
  timestep 0) and in the result, as ``WanImageToVideoPipeline`` does on such a model. A rollout's frame 0
  is then no Gaussian step: its elements are left out of the log-probs (:meth:`WanBinding.log_prob_mask`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from common.diffusion.binding import Binding, Geometry
from common.diffusion.vae_tiling import VaeTiling
from common.families.wan.text import MAX_SEQUENCE_LENGTH, WanTextEncoder, pad_embeddings
from common.protocol.messages import IMAGE_CONDITION, PROMPT_EMBEDS


def frame_mask(latents: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
    """[1, 1, F', H', W'] float32: 0 on frame 0 when an image gives it, else 1 (diffusers' first_frame_mask)."""
    mask = torch.ones(1, 1, *latents.shape[2:], dtype=torch.float32, device=latents.device)
    if image is not None:
        mask[:, :, 0] = 0
    return mask


class WanBinding(Binding):
    family = "wan"
    pipeline = "WanPipeline"
    video = True
    # WanPipeline's own defaults (480p).
    defaults = {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50, "guidance_scale": 5.0,
                "max_sequence_length": MAX_SEQUENCE_LENGTH}
    fields = frozenset({"num_frames", "guidance_scale_2", "max_sequence_length"})
    text_fields = (PROMPT_EMBEDS,)
    # WanTransformer3DModel takes no text mask: the zero padding to max_sequence_length is attended.
    masks_text_padding = False
    shares_text = True
    context_parallel = True
    # Wan2.1 / Wan2.2 text-to-video models make 16 frames per second (diffusers' examples export at 16).
    fps = 16
    image_fields = (IMAGE_CONDITION,)  # expand_timesteps models (TI2V) only

    def geometry(self, path: Path, transformer_config: dict) -> Geometry:
        import json

        vcfg = json.loads((path / "vae" / "config.json").read_text())
        # AutoencoderKLWan stores its strides in the config; Wan2.1's VAE uses 8 and 4.
        # The noise's channels: the transformer's output (image-to-video inputs add condition channels).
        channels = transformer_config.get("out_channels") or transformer_config.get("in_channels", 16)
        return Geometry(latent_channels=int(channels),
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

    # TeaCache4Wan2.1's published polynomial for Wan2.1-T2V-1.3B on the 6 x D timestep projection (its
    # "ret steps" mode: the first 5 steps always computed).
    teacache_coefficients = (-5.21862437e04, 9.23041404e03, -5.28275948e02, 1.36987616e01, -4.99875664e-02)
    teacache_source = "published: TeaCache4Wan2.1, fitted on Wan2.1-T2V-1.3B"
    teacache_warmup = 5

    def modulated_input(self, model, timestep, text, guidance) -> torch.Tensor:
        embedder = model.condition_embedder
        t = embedder.timesteps_proj(timestep)
        temb = embedder.time_embedder(t.to(next(iter(embedder.time_embedder.parameters())).dtype))
        return embedder.time_proj(embedder.act_fn(temb))

    def example_text(self, info, model, max_sequence_length: int, generator, device, dtype) -> torch.Tensor:
        return torch.randn(1, max_sequence_length, model.config.text_dim, generator=generator, device=device,
                           dtype=dtype)

    # --- TI2V: frame 0 from an image, a timestep per token (expand_timesteps) ---------------------------------
    def image_input(self, info) -> str | None:
        return "optional" if info.expand_timesteps else None

    def load_image_conditioner(self, info, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()):
        from common.families.wan_i2v.image import WanImageConditioner

        return WanImageConditioner.load(info.path, dtype, device, expand_timesteps=info.expand_timesteps,
                                        image_encoder=info.has_component("image_encoder"), tiling=tiling)

    def image_conditioning(self, wire: dict[str, torch.Tensor]) -> torch.Tensor | None:
        c = wire.get(IMAGE_CONDITION.name)
        return None if c is None else c[None]

    def example_image(self, info, latent_shape, generator, device, dtype):
        if not info.expand_timesteps:
            return None
        c, _, h, w = latent_shape  # frame 0's latent: an image's requests (the same graph as text-only ones')
        return torch.randn(1, c, 1, h, w, generator=generator, device=device, dtype=dtype)

    def model_latents(self, info, latents: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
        return _frame0_from(info, latents, image)

    def row_timesteps(self, info, timestep: torch.Tensor, latents: torch.Tensor,
                      image: torch.Tensor | None) -> torch.Tensor:
        if not info.expand_timesteps:
            return super().row_timesteps(info, timestep, latents, image)
        # One per token of the patched grid: the mask at the patches' corners, times t (0 on an image's frame 0).
        _, ph, pw = info.patch_size
        corners = frame_mask(latents, image)[0, 0][:, ::ph, ::pw].flatten()
        return (corners * timestep.float().reshape(-1, 1)).expand(latents.shape[0], -1)

    def final_latents(self, info, latents: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
        return _frame0_from(info, latents, image)

    def log_prob_mask(self, info, latents: torch.Tensor, image: torch.Tensor | None):
        if image is None or not info.expand_timesteps:
            return None
        return frame_mask(latents, image)[:, :, :, :1, :1]  # [1, 1, F', 1, 1]: frame 0 left out

    def load_decoder(self, info, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()):
        from common.families.wan.vae import WanDecoder

        return WanDecoder.load(info.path, dtype, device, tiling)


def _frame0_from(info, latents: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
    """``latents`` with frame 0 replaced by the image's latent (expand_timesteps models given an image)."""
    if image is None or not info.expand_timesteps:
        return latents
    mask = frame_mask(latents, image)
    return (1 - mask) * image + mask * latents
