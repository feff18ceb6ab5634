"""The per-step KL of a rollout's step against a reference model's, and the step's log-prob under the reference.

At a stochastic step the policy and the reference (the same model with the request's adapter off) predict
``v`` and ``v_ref`` on the same ``x``; with the step's coefficients both give a Gaussian of the same noise scale
``sd`` around ``mean = a x + b v`` and ``mean_ref = a x + b v_ref``. Their KL, element by element, is
``(mean - mean_ref)^2 / (2 sd^2)``; :func:`reference_step` averages it over the elements that count in the
log-prob (the same mask), one number per sample, as Flow-GRPO's Wan pipeline averages its ``kl_reward``. The
reference's log-prob is that of the drawn ``x_next`` under ``mean_ref``: :func:`common.diffusion.sde.sde_step` in
evaluation mode with ``v_ref``. The denoise worker and :class:`rl.TrainerPolicy` both call this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.diffusion.policy import sigma_max
from common.diffusion.sde import SdeStep, SigmaLike, _mean_square, sde_step
from common.diffusion.step_variants import StepVariant


@dataclass(frozen=True)
class KlStep:
    """One step's comparison with the reference; float32 [B] tensors."""

    kl: torch.Tensor
    """The Gaussian KL of the policy's step from the reference's, averaged over the counted elements."""
    ref_log_prob: torch.Tensor
    """The log-prob of the step's ``x_next`` under the reference (the variant's own formula)."""


def reference_step(step: SdeStep, ref_velocity: torch.Tensor, sample: torch.Tensor, sigma: SigmaLike,
                   sigma_next: SigmaLike, sigma_max_: SigmaLike, variant: StepVariant,
                   log_prob_mask: torch.Tensor | None = None, sigma_min: SigmaLike = 0.0) -> KlStep:
    """``step`` (the policy's, taken or evaluated from ``sample`` with ``variant`` and these sigmas, as
    :func:`common.diffusion.sde.sde_step` takes them) against the reference's velocity on the same ``sample``.
    Gradients flow through ``step.mean`` (the policy), not the reference."""
    if step.log_prob is None:
        raise ValueError("a deterministic step has no KL: it draws no noise")
    ref = sde_step(ref_velocity, sample, sigma, sigma_next, sigma_max_, sigma_min=sigma_min, sde_type=variant,
                   prev_sample=step.prev_sample, log_prob_mask=log_prob_mask)
    # _mean_square treats its first argument as a constant: the reference's mean here.
    sd = step.noise_scale.flatten()
    kl = _mean_square(ref.mean, step.mean, log_prob_mask) / (2 * sd.square())
    return KlStep(kl=kl, ref_log_prob=ref.log_prob)


def kl_at(sigmas: torch.Tensor, i: int, step: SdeStep, ref_velocity: torch.Tensor, latents: torch.Tensor,
          variant: StepVariant, log_prob_mask: torch.Tensor | None = None) -> KlStep:
    """:func:`reference_step` at rollout step ``i`` of a schedule (as :func:`common.diffusion.policy.step_at`)."""
    return reference_step(step, ref_velocity, latents, sigmas[i], sigmas[i + 1], sigma_max(sigmas), variant,
                          log_prob_mask, sigma_min=sigmas[-1])
