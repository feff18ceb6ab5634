"""The rollout step's variants: one object per way of taking a flow-matching step.

Each variant is a small frozen object (in the spirit of diffusers' schedulers: one
object per algorithm, its settings the single source) that says three things about
a step from ``s = sigma`` to ``s_next = sigma_next``:

- :meth:`StepVariant.coefficients`: the per-sample ``(a, b, sd)`` of
  ``mean = a x + b v`` and ``x_next = mean + sd eps``;
- :meth:`StepVariant.log_prob`: the log-probability of ``x_next`` from its mean
  squared deviation from ``mean``;
- its own check of ``noise_level`` (made when it is built).

Everything they share (argument checks, float32 on the CPU, noise drawing, the
deterministic limit, the average over elements) is :func:`common.diffusion.sde.sde_step`,
which takes a variant. :data:`STEP_VARIANTS` names them as the wire does
(``RolloutParams.sde_type``); adding a variant is one class and one entry there.
The formulas are those of the design notes, "The rollout step".
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import ClassVar

import torch

_LOG_SQRT_2PI = math.log(math.sqrt(2.0 * math.pi))


@dataclass(frozen=True)
class StepVariant:
    """One step variant with its noise level. Coefficients are float32 CPU tensors of shape [B]."""

    noise_level: float = 0.7
    name: ClassVar[str]
    deterministic: ClassVar[bool] = False
    """True for a variant that never draws noise and has no log-probability, whatever its noise level."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_level", self.checked_noise_level(self.noise_level))

    def checked_noise_level(self, noise_level) -> float:
        """``noise_level`` as a float, or ``ValueError``; a variant with a narrower range adds its rule."""
        if not isinstance(noise_level, numbers.Real) or isinstance(noise_level, bool) or not math.isfinite(noise_level):
            raise ValueError(f"noise_level must be a finite number, got {noise_level!r}")
        noise_level = float(noise_level)
        if noise_level < 0:
            raise ValueError(f"noise_level must be >= 0, got {noise_level}")
        return noise_level

    def coefficients(self, s: torch.Tensor, s_next: torch.Tensor, s_max: torch.Tensor,
                     s_min: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-sample ``(a, b, sd)`` with ``mean = a x + b v`` and ``x_next = mean + sd eps``; ``s_max`` is the
        schedule's ``sigmas[1]``, ``s_min`` its last sigma."""
        raise NotImplementedError

    def log_prob(self, mean_sq: torch.Tensor, sd: torch.Tensor) -> torch.Tensor | None:
        """[B] log-probability of ``x_next`` from ``mean_sq``, its [B] mean squared deviation from ``mean``
        (over the elements that count), and ``sd`` [B]; None for a variant without one."""
        raise NotImplementedError


def _flow_sde(std: torch.Tensor, s: torch.Tensor, s_next: torch.Tensor):
    """``(a, b, sd)`` of the flow-matching SDE step with diffusion coefficient ``std`` (per sample):
    ``mean = x (1 + std^2 dt / (2 s)) + v (1 + std^2 (1 - s) / (2 s)) dt``, ``sd = std sqrt(-dt)``."""
    dt = s_next - s
    # s == 0 only happens with dt == 0 (sd == 0): the term is 0 there.
    k = std.square() / (2 * torch.where(s > 0, s, torch.ones_like(s)))
    a = 1 + k * dt
    b = (1 + k * (1 - s)) * dt
    return a, b, std * torch.sqrt(-dt)


def _gaussian(mean_sq: torch.Tensor, sd: torch.Tensor) -> torch.Tensor:
    """The Gaussian log-density, constants included, from the mean squared deviation."""
    return -mean_sq / (2 * sd.square()) - torch.log(sd) - _LOG_SQRT_2PI


@dataclass(frozen=True)
class Sde(StepVariant):
    """Flow-GRPO's SDE: ``std = noise_level sqrt(s / (1 - (s_max if s == 1 else s)))``,
    ``mean = x (1 + std^2 dt / (2 s)) + v (1 + std^2 (1 - s) / (2 s)) dt``, ``sd = std sqrt(-dt)``;
    the Gaussian log-density."""

    name: ClassVar[str] = "sde"

    def coefficients(self, s, s_next, s_max, s_min):
        at_one = s == 1
        if bool((at_one & (s_max == 1)).any()):
            raise ValueError("sde step at sigma == 1 needs sigma_max < 1 (the formula divides by 1 - sigma_max)")
        return _flow_sde(self.noise_level * torch.sqrt(s / (1 - torch.where(at_one, s_max, s))), s, s_next)

    def log_prob(self, mean_sq, sd):
        return _gaussian(mean_sq, sd)


@dataclass(frozen=True)
class Cps(StepVariant):
    """Coefficient-preserving sampling: ``std = s_next sin(noise_level pi / 2)``, ``x0 = x - s v``,
    ``x1 = x + (1 - s) v``, ``mean = x0 (1 - s_next) + x1 sqrt(s_next^2 - std^2)``, ``sd = std``;
    ``log_prob = -(x_next - mean)^2`` (constants dropped). ``noise_level`` lies in [0, 1]."""

    name: ClassVar[str] = "cps"

    def checked_noise_level(self, noise_level) -> float:
        noise_level = super().checked_noise_level(noise_level)
        if noise_level > 1:
            raise ValueError(f"cps noise_level must be in [0, 1], got {noise_level}")
        return noise_level

    def coefficients(self, s, s_next, s_max, s_min):
        std = s_next * math.sin(self.noise_level * math.pi / 2)
        c = torch.sqrt(torch.clamp(s_next.square() - std.square(), min=0))
        # x0 (1 - s_next) + x1 c with x0 = x - s v, x1 = x + (1 - s) v
        return 1 - s_next + c, (1 - s) * c - s * (1 - s_next), std

    def log_prob(self, mean_sq, sd):
        return -mean_sq


@dataclass(frozen=True)
class Ode(StepVariant):
    """The Euler step ``x_next = x + dt v``: no noise, no log-probability (its noise level is unused)."""

    name: ClassVar[str] = "ode"
    deterministic: ClassVar[bool] = True

    def coefficients(self, s, s_next, s_max, s_min):
        return torch.ones_like(s), s_next - s, torch.zeros_like(s)

    def log_prob(self, mean_sq, sd):
        return None


@dataclass(frozen=True)
class FlowGrpoWan(StepVariant):
    """Flow-GRPO's Wan step: ``sde``'s mean and noise with ``std = s_min + (s_max - s_min) s`` (linear in
    sigma, ``s_max = sigmas[1]``, ``s_min = sigmas[-1]``); the Gaussian log-density. It has no noise level:
    ``noise_level`` is accepted (any valid value) and unused."""

    name: ClassVar[str] = "flow_grpo_wan"

    def coefficients(self, s, s_next, s_max, s_min):
        return _flow_sde(s_min + (s_max - s_min) * s, s, s_next)

    def log_prob(self, mean_sq, sd):
        return _gaussian(mean_sq, sd)


@dataclass(frozen=True)
class DanceGrpo(StepVariant):
    """DanceGRPO's step: ``sde``'s mean and noise with the constant ``std = eta`` (``noise_level``), so
    ``sd = eta sqrt(-dt)``; the Gaussian log-density."""

    name: ClassVar[str] = "dance_grpo"

    def coefficients(self, s, s_next, s_max, s_min):
        return _flow_sde(torch.full_like(s, self.noise_level), s, s_next)

    def log_prob(self, mean_sq, sd):
        return _gaussian(mean_sq, sd)


STEP_VARIANTS: dict[str, type[StepVariant]] = {v.name: v for v in (Sde, Cps, Ode, FlowGrpoWan, DanceGrpo)}
"""Every step variant by its wire name (``RolloutParams.sde_type``)."""


def step_variant(sde_type: str | StepVariant, noise_level: float | None = None) -> StepVariant:
    """The variant a request's ``sde_type`` and ``noise_level`` name (``ValueError`` for an unknown name or a
    noise level the variant refuses); a variant object is returned as it is (it carries its noise level)."""
    if isinstance(sde_type, StepVariant):
        if noise_level is not None and noise_level != sde_type.noise_level:
            raise ValueError(f"noise_level {noise_level} given with a {sde_type.name} variant of noise_level "
                             f"{sde_type.noise_level}: a variant carries its own")
        return sde_type
    if sde_type not in STEP_VARIANTS:
        raise ValueError(f"unknown sde_type {sde_type!r}; expected one of {tuple(STEP_VARIANTS)}")
    return STEP_VARIANTS[sde_type](0.7 if noise_level is None else noise_level)
