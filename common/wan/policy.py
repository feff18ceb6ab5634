"""The Wan transformer call with classifier-free guidance.

Shared by the denoise worker and by trainers that recompute log-probs from a
returned trajectory: both sides must evaluate the model the same way for
their log-probs to agree to float32 rounding.
"""

from __future__ import annotations

import torch

from common.wan.model_info import MAX_SEQUENCE_LENGTH


def pad_embeddings(embeds: torch.Tensor, length: int = MAX_SEQUENCE_LENGTH) -> torch.Tensor:
    """[L, D] -> [1, length, D], zero-padded after the real tokens as Wan expects."""
    out = embeds.new_zeros((1, length, embeds.shape[-1]))
    out[0, : embeds.shape[0]] = embeds
    return out


def guided_velocity(
    model: torch.nn.Module,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    cond: torch.Tensor,
    uncond: torch.Tensor | None,
    guidance_scale: float,
) -> torch.Tensor:
    """Model output after guidance, in the model's dtype.

    ``timestep`` is a scalar or one value per sample; ``uncond`` None means no
    guidance. Same order of operations as diffusers' WanPipeline: two passes,
    then ``uncond + g * (cond - uncond)``.
    """
    x = latents.to(model.dtype)
    t = timestep.expand(latents.shape[0]) if timestep.dim() == 0 else timestep
    v = model(hidden_states=x, timestep=t, encoder_hidden_states=cond, return_dict=False)[0]
    if uncond is not None:
        v_u = model(hidden_states=x, timestep=t, encoder_hidden_states=uncond, return_dict=False)[0]
        v = v_u + guidance_scale * (v - v_u)
    return v


def guidance_for(expert: str, guidance_scale: float, guidance_scale_2: float | None) -> float:
    """The second expert uses ``guidance_scale_2`` when given, as diffusers' WanPipeline does."""
    if expert == "transformer_2" and guidance_scale_2 is not None:
        return guidance_scale_2
    return guidance_scale


def expert_for_timestep(t: float | torch.Tensor, boundary_ratio: float | None, n_train: int, has_second: bool) -> str:
    """Wan2.2 two-expert split: ``transformer`` for t >= boundary_ratio * n_train, else ``transformer_2``."""
    if boundary_ratio is None or not has_second or t >= boundary_ratio * n_train:
        return "transformer"
    return "transformer_2"
