"""Several latent streams in one tensor (LTX-2's video and audio): which elements an SDE step takes, and each
stream's log-probs beside the joint one.

A family with streams (``Binding.latents.streams``) carries them in one tensor per sample; its latents part
says which elements are whose (``stream_masks``). A rollout may put the SDE on some streams only
(``sde_streams``): the others take the Euler step (their ODE) at every step, and the joint log-prob averages
over the SDE streams' elements. The joint log-prob is the element-weighted average of the streams' (the
Gaussian over all their elements, as one stream's is over its own). Elements of no stream (the zero padding of
a narrower stream) follow the ODE and count in no log-prob. The denoise worker and ``rl.TrainerPolicy``
both read these rules here.
"""

from __future__ import annotations

import torch

from common.diffusion.sde import SdeStep, _mean_square
from common.diffusion.step_variants import StepVariant


def times(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a * b


def sde_streams(info, params, condition_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The masks ([1, ...] each) of the streams a request's SDE steps take (empty: a one-stream model), those
    with an element the condition leaves in (an image-to-video request of one latent frame: its video has none,
    so it has no log-prob of its own)."""
    masks = info.family.latents.stream_masks(info, params)
    chosen = None if params.rollout is None else params.rollout.sde_streams
    return {k: m for k, m in masks.items() if (chosen is None or k in chosen)
            and (condition_mask is None or bool((m.to(condition_mask.device) * condition_mask).any()))}


def ode_mask(info, params) -> torch.Tensor | None:
    """1 on the elements that follow their ODE at an SDE step, else None: the streams left out of
    ``sde_streams``, and the elements of no stream (padding the family keeps at 0: its velocity there is 0, so
    the Euler step leaves it so, and it counts in no log-prob)."""
    if not info.family.latents.stream_masks(info, params):
        return None
    rest = 1 - sum(sde_streams(info, params).values())
    return rest if bool(rest.any()) else None


def log_prob_mask(info, params, condition_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The elements a request's joint log-prob averages over: the condition's (e.g. an image's frame 0 left
    out) on the SDE streams."""
    ode = ode_mask(info, params)
    return times(condition_mask, None if ode is None else 1 - ode)


def follow_ode(step: SdeStep, latents: torch.Tensor, velocity: torch.Tensor, sigma, sigma_next,
               ode: torch.Tensor) -> SdeStep:
    """``step`` with the ``ode`` elements' next latents the Euler step's (``x + (sigma_next - sigma) v``)."""
    euler = latents.float() + (sigma_next - sigma) * velocity.float()
    prev = torch.where(ode.to(latents.device).bool(), euler, step.prev_sample)
    return SdeStep(prev_sample=prev, log_prob=step.log_prob, mean=step.mean, noise_scale=step.noise_scale)


def stream_log_probs(variant: StepVariant, step: SdeStep, streams: dict[str, torch.Tensor],
                     condition_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Each SDE stream's [B] log-prob of ``step`` (its elements, the condition's mask applied)."""
    sd = step.noise_scale.flatten()
    out = {}
    for name, mask in streams.items():
        m = times(mask.to(step.mean.device), condition_mask)
        out[name] = variant.log_prob(_mean_square(step.prev_sample, step.mean, m), sd)
    return out
