"""FLUX.1 (``FluxPipeline``).

- encoder: CLIP-L's pooled output and T5's sequence (:mod:`common.families.flux.text`); a prompt travels as
  ``prompt_embeds`` [max_sequence_length, D] and ``pooled_prompt_embeds`` [P];
- denoise: ``FluxTransformer2DModel`` on packed latents (:class:`~common.diffusion.parts.latents.PackedLatents`)
  with its text and image position ids, the timestep / 1000, and FLUX.1-dev's embedded guidance
  (``guidance_scale``, when the config has ``guidance_embeds``); true classifier-free guidance is
  ``true_cfg_scale`` with a negative prompt, two forwards (cond, then uncond) as the pipeline runs them;
- schedule: flow-match Euler with dynamic shifting: ``mu`` from the image sequence length unless the
  request gives one, sigmas ``linspace(1, 1/N, N)``;
- decode: ``AutoencoderKL`` (16 channels), unpacked, ``latents / scaling_factor + shift_factor``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.diffusion.binding import Binding
from common.diffusion.parts.decoder import AutoencoderKLDecoder
from common.diffusion.parts.guidance import TrueGuidance
from common.diffusion.parts.latents import Geometry, PackedLatents, autoencoder_kl_scale
from common.diffusion.parts.text import HIDDEN, POOLED_PROMPT_EMBEDS, TextCond, TextPart
from common.diffusion.parts.transformer import JOINT_ATTENTION_PROJECTIONS, TransformerPart
from common.diffusion.request_fields import TRUE_CFG_SCALE, max_sequence_length
from common.protocol.messages import PROMPT_EMBEDS

POOLED = "pooled_projections"


def image_ids(grid: tuple[int, int], device, dtype: torch.dtype) -> torch.Tensor:
    """[rows * cols, 3] position ids of the packed tokens, as ``FluxPipeline._prepare_latent_image_ids``."""
    rows, cols = grid
    ids = torch.zeros(rows, cols, 3)
    ids[..., 1] += torch.arange(rows)[:, None]
    ids[..., 2] += torch.arange(cols)[None, :]
    return ids.reshape(rows * cols, 3).to(device=device, dtype=dtype)


def geometry(path, transformer_config: dict) -> Geometry:
    return Geometry(latent_channels=int(transformer_config.get("in_channels", 64)) // 4,
                    vae_scale_spatial=autoencoder_kl_scale(path), patch_size=(2, 2))


def load_text_encoder(info, dtype: torch.dtype, device):
    from common.families.flux.text import FluxTextEncoder

    return FluxTextEncoder.load(info.path, dtype, device)


def example_text(info, model, max_sequence_length: int, generator, device, dtype) -> TextCond:
    c = model.config
    return TextCond({
        HIDDEN: torch.randn(1, max_sequence_length, c.joint_attention_dim, generator=generator, device=device,
                            dtype=dtype),
        POOLED: torch.randn(1, c.pooled_projection_dim, generator=generator, device=device, dtype=dtype)})


@dataclass(frozen=True, kw_only=True)
class FluxTransformer(TransformerPart):
    model_class: str = "FluxTransformer2DModel"
    context_parallel: bool = True  # FluxTransformer2DModel has a _cp_plan
    splits_text: bool = True  # its plan splits encoder_hidden_states
    # Flow-GRPO's FLUX LoRA: both streams' attention projections.
    lora_targets: tuple[str, ...] = JOINT_ATTENTION_PROJECTIONS

    def forward(self, model, hidden_states, timestep, text, grid, guidance) -> torch.Tensor:
        dtype, device = hidden_states.dtype, hidden_states.device
        txt_ids = torch.zeros(text[HIDDEN].shape[1], 3, device=device, dtype=dtype)
        return model(hidden_states=hidden_states, timestep=timestep.to(dtype) / 1000, guidance=guidance,
                     pooled_projections=text[POOLED], encoder_hidden_states=text[HIDDEN], txt_ids=txt_ids,
                     img_ids=image_ids(grid, device, dtype), return_dict=False)[0]

    # No published TeaCache polynomial for this signal: teacache needs the directory's step_cache.json (the
    # built-in models carry one fitted on small-flux-smooth; a real checkpoint: bench/fit_teacache.py MODEL_DIR --write).
    def modulated_input(self, model, timestep, text, guidance) -> torch.Tensor:
        dtype = text[HIDDEN].dtype  # as forward: the pipeline's t / 1000, scaled back by the transformer
        t = timestep.to(dtype) / 1000 * 1000
        if guidance is None:
            return model.time_text_embed(t, text[POOLED])
        return model.time_text_embed(t, guidance.to(dtype) * 1000, text[POOLED])


FLUX = Binding(
    family="flux", pipeline="FluxPipeline", words=("flux",),
    # FluxTransformer2DModel takes no text mask (FluxPipeline passes none): T5's padding tokens are attended.
    text=TextPart(fields=(PROMPT_EMBEDS, POOLED_PROMPT_EMBEDS), keywords=(HIDDEN, POOLED),
                  load_encoder=load_text_encoder, example=example_text),
    latents=PackedLatents(geometry=geometry), transformer=FluxTransformer(), decoder=AutoencoderKLDecoder,
    guidance=TrueGuidance(),
    # FluxPipeline's own defaults (height and width: 128 x the VAE's scale, 1024 for FLUX.1).
    defaults={"height": 1024, "width": 1024, "num_frames": 1, "num_inference_steps": 28, "guidance_scale": 3.5,
              "true_cfg_scale": 1.0, "max_sequence_length": 512},
    default_size=lambda tcfg, geometry: 128 * geometry.vae_scale_spatial,  # FluxPipeline.default_sample_size
    request_fields=(max_sequence_length(), TRUE_CFG_SCALE))
