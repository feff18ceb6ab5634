"""Flow-matching SDE step and its log-probability (Flow-GRPO style).

One pure function, :func:`sde_step`, serves both sides of an RL rollout:

- the denoise worker calls it to take a stochastic step and record the
  log-probability of the step it took;
- a trainer calls it again (or :func:`log_prob_of`) with the recorded next
  latents to recompute that log-probability under the current policy, with
  gradients flowing into ``model_output``.

Both sides must get the same numbers, so:

- everything is computed in float32, whatever the input dtypes;
- the per-sample coefficients (functions of the sigmas only) are computed on
  the CPU and then moved to the latents' device, so they do not depend on the
  device's transcendental functions;
- noise is drawn from a CPU generator, so a request's noise sequence depends on
  its seed only, not on the device it runs on.

The step's formula is a variant's (:mod:`common.diffusion.step_variants`: ``"sde"``,
``"cps"``, ``"ode"``, by the wire's ``sde_type``): its coefficients ``(a, b, sd)`` give
``mean = a x + b v`` and ``x_next = mean + sd eps`` (``x = sample``, ``v = model_output``), and
its log-probability is computed from ``x_next``'s squared deviation from ``mean``, averaged over
every non-batch element.

A step whose noise scale is 0 for every sample is deterministic: noise level 0,
``cps`` with ``s_next == 0``, ``sde`` with ``dt == 0`` or ``s == 0``, ``ode`` always. In all those
cases the formulas reduce to the Euler step, so that is what is returned
(``prev_sample == mean == x + dt v``, ``log_prob`` None, no noise drawn). A
batch in which some samples are deterministic and others are not is rejected
with a ``ValueError``: callers split such a batch (or use ``"ode"`` for the
deterministic ones) instead of getting a partly undefined ``log_prob``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Union

import torch

from common.diffusion.step_variants import StepVariant, step_variant
from common.protocol.messages import SDE_TYPES  # noqa: F401  (the wire's names, re-exported)

SigmaLike = Union[float, torch.Tensor]
"""A Python number, a 0-d tensor, or a 1-d tensor with one value per sample ([B] or [1])."""
Generators = Union[torch.Generator, list, tuple, None]
"""One CPU generator for the whole batch, or one per sample (a list of B), or None (torch's global one)."""


@dataclass(frozen=True)
class SdeStep:
    """Result of one step. All tensors are float32 on the sample's device."""

    prev_sample: torch.Tensor
    """x_{i+1}, same shape as the sample (in evaluation mode: the given one, as float32)."""
    log_prob: torch.Tensor | None
    """[B]: log-probability of ``prev_sample`` averaged over every non-batch element;
    None when the step is deterministic."""
    mean: torch.Tensor
    """Mean of x_{i+1} given x_i, same shape as the sample."""
    noise_scale: torch.Tensor
    """Std of x_{i+1} around ``mean``, shape [B, 1, ..., 1]; 0 for deterministic steps."""


def _per_sample(name: str, value: SigmaLike, batch: int) -> torch.Tensor:
    """A float32 CPU tensor of shape [batch] from a number, a 0-d tensor, or a [1]/[batch] tensor."""
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{name} must be real, got dtype {value.dtype}")
        if value.ndim > 1 or (value.ndim == 1 and value.shape[0] not in (1, batch)):
            raise ValueError(f"{name} must be a number, a 0-d tensor or a 1-d tensor of length {batch} "
                             f"(the batch size), got shape {tuple(value.shape)}")
        t = value.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        t = torch.tensor([float(value)], dtype=torch.float32)
    else:
        raise ValueError(f"{name} must be a number or a tensor, got {type(value).__name__}")
    if not bool(((t >= 0) & (t <= 1)).all()):  # also false for NaN
        raise ValueError(f"{name} must lie in [0, 1] (flow-matching sigmas), got {t.tolist()}")
    return t.expand(batch).contiguous() if t.numel() == 1 else t


def _coefficients(variant: StepVariant, s: torch.Tensor, s_next: torch.Tensor, s_max: torch.Tensor,
                  s_min: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The variant's per-sample ``(a, b, sd)`` (CPU, float32, [B]), checked finite, ``sd`` without -0.0."""
    a, b, sd = variant.coefficients(s, s_next, s_max, s_min)
    if not bool(torch.isfinite(torch.stack((a, b, sd))).all()):
        raise ValueError(f"{variant.name} step is undefined at sigma={s.tolist()}, sigma_next={s_next.tolist()}, "
                         f"sigma_max={s_max.tolist()}")
    sd = torch.where(sd > 0, sd, torch.zeros_like(sd))  # turn -0.0 into 0.0
    return a, b, sd


def _check_like(name: str, t: torch.Tensor | None, sample: torch.Tensor) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.shape != sample.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected the sample's shape {tuple(sample.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


def _check_tensors(model_output: torch.Tensor, sample: torch.Tensor, noise: torch.Tensor | None,
                   generator: Generators, prev_sample: torch.Tensor | None) -> None:
    if not isinstance(sample, torch.Tensor) or sample.ndim < 2:
        raise ValueError("sample must be a tensor of shape [B, ...] with ndim >= 2")
    if not sample.is_floating_point():
        raise ValueError(f"sample must be a floating-point tensor, got {sample.dtype}")
    _check_like("model_output", model_output, sample)
    _check_like("noise", noise, sample)
    _check_like("prev_sample", prev_sample, sample)
    if noise is not None and prev_sample is not None:
        raise ValueError("give either noise (sampling) or prev_sample (evaluation), not both")
    gens = generator if isinstance(generator, (list, tuple)) else [generator]
    if isinstance(generator, (list, tuple)) and len(generator) != sample.shape[0]:
        raise ValueError(f"{len(generator)} generators for a batch of {sample.shape[0]}: give one per sample")
    for g in gens:
        if g is not None and (not isinstance(g, torch.Generator) or g.device.type != "cpu"):
            raise ValueError(f"generator must be a CPU generator, got {getattr(g, 'device', type(g).__name__)}")


def _sigmas(sigma: SigmaLike, sigma_next: SigmaLike, sigma_max: SigmaLike,
            batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three sigmas as float32 CPU tensors of shape [batch], with ``sigma_next <= sigma`` checked."""
    s = _per_sample("sigma", sigma, batch)
    s_next = _per_sample("sigma_next", sigma_next, batch)
    s_max = _per_sample("sigma_max", sigma_max, batch)
    if bool((s_next > s).any()):
        raise ValueError(f"sigma_next must not exceed sigma, got sigma={s.tolist()}, sigma_next={s_next.tolist()}")
    return s, s_next, s_max


def _is_deterministic(sd: torch.Tensor) -> bool:
    """Whether every sample's noise scale is 0; a batch in which only some are is an error (see the module doc)."""
    zero = sd == 0
    deterministic = bool(zero.all())
    if not deterministic and bool(zero.any()):
        raise ValueError(f"batch mixes deterministic and stochastic samples (noise scale {sd.tolist()}); "
                         "split it or use sde_type='ode' for the deterministic ones")
    return deterministic


def _euler_step(x: torch.Tensor, v: torch.Tensor, dt: torch.Tensor, noise_scale: torch.Tensor,
                prev_sample: torch.Tensor | None) -> SdeStep:
    """The deterministic step ``x + dt v`` (``dt`` and ``noise_scale`` already shaped [B, 1, ..., 1])."""
    mean = x + dt * v
    out = mean if prev_sample is None else prev_sample.float()
    return SdeStep(prev_sample=out, log_prob=None, mean=mean, noise_scale=noise_scale)


def _draw(shape: torch.Size, generator: Generators) -> torch.Tensor:
    """Standard-normal noise of ``shape`` on the CPU: from one generator, or row by row from one per sample."""
    if isinstance(generator, (list, tuple)):
        row = (1, *shape[1:])
        return torch.cat([torch.randn(row, generator=g, dtype=torch.float32, device="cpu") for g in generator])
    return torch.randn(shape, generator=generator, dtype=torch.float32, device="cpu")


def _add_noise(mean: torch.Tensor, sd: torch.Tensor, noise: torch.Tensor | None,
               generator: Generators) -> torch.Tensor:
    """``mean + sd eps``; ``eps`` drawn on the CPU (device-independent noise) unless given."""
    if noise is None:
        noise = _draw(mean.shape, generator)
    return torch.addcmul(mean, noise.to(device=mean.device, dtype=torch.float32), sd)


def _mean_square(x_next: torch.Tensor, mean: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B] squared deviation of ``x_next`` from ``mean`` averaged over the non-batch elements (those where
    ``mask`` is 1, when given).

    ``x_next`` is a constant here: gradients flow through ``mean`` only.
    """
    sq = (x_next.detach() - mean).square()
    if mask is None:
        return sq.flatten(1).mean(1)
    keep = mask.to(device=sq.device, dtype=torch.float32).expand_as(sq)
    return (sq * keep).flatten(1).sum(1) / keep.flatten(1).sum(1)


def check_schedule(variants, sigmas: torch.Tensor, sigma_max: SigmaLike) -> None:
    """``ValueError`` when a step of the schedule ``sigmas`` is one its variant cannot take (sigmas out of
    order or range, a formula undefined there); ``variants``: each step's. A rollout fails before its first
    step, not in the middle."""
    sigmas = torch.as_tensor(sigmas).detach().to("cpu", torch.float32)
    s_min = _per_sample("sigma_min", sigmas[-1], 1)
    for i, variant in enumerate(variants):
        s, s_next, s_max = _sigmas(sigmas[i], sigmas[i + 1], sigma_max, 1)
        _coefficients(variant, s, s_next, s_max, s_min)


def sde_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: SigmaLike,
    sigma_next: SigmaLike,
    sigma_max: SigmaLike,
    *,
    sigma_min: SigmaLike = 0.0,
    sde_type: str | StepVariant = "sde",
    noise_level: float | None = None,
    noise: torch.Tensor | None = None,
    generator: Generators = None,
    prev_sample: torch.Tensor | None = None,
    log_prob_mask: torch.Tensor | None = None,
) -> SdeStep:
    """Take (or evaluate) one flow-matching step from ``sigma`` to ``sigma_next``.

    Args:
        model_output: velocity prediction ``v`` (after guidance), shape of ``sample``.
        sample: current latents ``x_i``, shape [B, ...] (ndim >= 2).
        sigma, sigma_next: this step's sigmas, ``0 <= sigma_next <= sigma <= 1``; a number, a 0-d
            tensor, or a [B] tensor (one value per sample, for batches at different steps).
        sigma_max: ``sigmas[1]`` of the schedule; used by ``"sde"`` where ``sigma == 1`` and by
            ``"flow_grpo_wan"``.
        sigma_min: ``sigmas[-1]`` of the schedule (0 for a schedule that ends at 0); used by
            ``"flow_grpo_wan"`` only.
        sde_type: a variant's name (one of :data:`SDE_TYPES`) or a :class:`StepVariant` object (which
            carries its noise level).
        noise_level: with a name, ``>= 0`` (and ``<= 1`` for ``"cps"``); default 0.7.
        noise: standard-normal ``eps`` to use instead of drawing it (shape of ``sample``).
        generator: CPU generator to draw ``eps`` from (default: torch's global CPU generator).
            Exactly one ``torch.randn(sample.shape, dtype=float32, device="cpu")`` is drawn per
            stochastic step, then moved to the sample's device, so the noise is device independent.
            A list of B generators draws each sample's row from its own, so that every sample of a
            batch gets exactly the noise (and the step) it gets alone.
        prev_sample: evaluation mode: the observed ``x_{i+1}``; nothing is drawn and ``log_prob`` is
            that of the given tensor (treated as a constant: gradients flow through ``mean`` only).
        log_prob_mask: 1 where an element counts in the log-prob's average, 0 where not (broadcastable to
            the sample; e.g. Wan TI2V's frame 0, which the pipeline replaces by the image's latent); None:
            every element counts.

    Returns:
        :class:`SdeStep` in float32.

    Raises:
        ValueError: unknown ``sde_type``, bad ``noise_level``, sigmas out of range or out of order,
            shape mismatches, both ``noise`` and ``prev_sample`` given, a non-CPU generator, or a
            batch mixing deterministic and stochastic samples.
    """
    variant = step_variant(sde_type, noise_level)
    _check_tensors(model_output, sample, noise, generator, prev_sample)
    s, s_next, s_max = _sigmas(sigma, sigma_next, sigma_max, sample.shape[0])
    s_min = _per_sample("sigma_min", sigma_min, sample.shape[0])
    a, b, sd = _coefficients(variant, s, s_next, s_max, s_min)
    device, view = sample.device, (sample.shape[0],) + (1,) * (sample.ndim - 1)
    x, v, sd_dev = sample.float(), model_output.float(), sd.to(device)
    if _is_deterministic(sd):
        return _euler_step(x, v, (s_next - s).to(device).view(view), sd_dev.view(view), prev_sample)
    mean = torch.addcmul(x * a.to(device).view(view), v, b.to(device).view(view))
    x_next = prev_sample.float() if prev_sample is not None else _add_noise(mean, sd_dev.view(view), noise, generator)
    log_prob = variant.log_prob(_mean_square(x_next, mean, log_prob_mask), sd_dev)
    return SdeStep(prev_sample=x_next, log_prob=log_prob, mean=mean, noise_scale=sd_dev.view(view))


def log_prob_of(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    prev_sample: torch.Tensor,
    sigma: SigmaLike,
    sigma_next: SigmaLike,
    sigma_max: SigmaLike,
    *,
    sde_type: str | StepVariant,
    noise_level: float | None = None,
    sigma_min: SigmaLike = 0.0,
) -> torch.Tensor:
    """[B] log-probability of the observed ``prev_sample`` (differentiable w.r.t. ``model_output``).

    Same as ``sde_step(..., prev_sample=prev_sample).log_prob``; raises ``ValueError`` when the step is
    deterministic (it has no log-probability).
    """
    variant = step_variant(sde_type, noise_level)
    step = sde_step(model_output, sample, sigma, sigma_next, sigma_max, sigma_min=sigma_min, sde_type=variant,
                    prev_sample=prev_sample)
    if step.log_prob is None:
        raise ValueError(f"{variant.name} step from sigma={sigma} to sigma_next={sigma_next} with noise_level="
                         f"{variant.noise_level} is deterministic and has no log-probability")
    return step.log_prob
