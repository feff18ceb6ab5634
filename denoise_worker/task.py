"""One request's denoising state, owned by that request alone.

A :class:`DenoiseTask` holds everything that changes while a request is
denoised: its scheduler (rebuilt for it), its generator (seeded from its
seed: initial noise first, then the SDE noise), its latents, its step index,
and what it returns (trajectory, log-probs). The worker only asks a task for
its model input and hands it the guided model output; nothing of one request
lives on a shared object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.protocol.messages import (
    LOG_PROB_STEPS,
    LOG_PROBS,
    TRAJECTORY_LATENTS,
    TRAJECTORY_SIGMAS,
    TRAJECTORY_TIMESTEPS,
    GenerationParams,
    RolloutParams,
)
from common.wan import schedulers
from common.wan.lora import LoraAdapter
from common.wan.model_info import ModelInfo
from common.wan.policy import ModelInput, step_at


def initial_noise(info: ModelInfo, params: GenerationParams, generator: torch.Generator) -> torch.Tensor:
    """The seed's initial latents, drawn exactly as diffusers' WanPipeline draws them."""
    shape = info.latent_shape(params.height, params.width, params.num_frames)
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def sde_settings(params: GenerationParams) -> RolloutParams | None:
    """The request's rollout settings when it runs the rollout (SDE) scheduler, else None (serving)."""
    r = params.rollout
    return r if r is not None and r.sde_scheduler else None


@dataclass
class DenoiseTask:
    params: GenerationParams
    cond: torch.Tensor
    uncond: torch.Tensor | None
    scheduler: object
    generator: torch.Generator
    latents: torch.Tensor
    sde: RolloutParams | None  # None: the serving scheduler steps this request
    lora: tuple[LoraAdapter, float] | None = None  # the adapter version and scale it started with
    step: int = 0
    trajectory: list[torch.Tensor] = field(default_factory=list)
    log_probs: list[torch.Tensor] = field(default_factory=list)
    log_prob_steps: list[int] = field(default_factory=list)

    @classmethod
    def create(cls, params, cond, uncond, info: ModelInfo, serving_template, rollout_template, device, lora=None):
        sde = sde_settings(params)
        scheduler = schedulers.build(rollout_template if sde is not None else serving_template, params, device)
        if sde is not None:
            schedulers.check_flow_match_convention(scheduler)
        generator = torch.Generator("cpu").manual_seed(params.seed)
        latents = initial_noise(info, params, generator).to(device)
        task = cls(params, cond, uncond, scheduler, generator, latents, sde, lora)
        if task.wants_trajectory:
            task.trajectory.append(latents)
        return task

    @property
    def wants_trajectory(self) -> bool:
        return self.params.rollout is not None and self.params.rollout.return_trajectory

    @property
    def done(self) -> bool:
        return self.step >= len(self.scheduler.timesteps)

    @property
    def timestep(self) -> torch.Tensor:
        return self.scheduler.timesteps[self.step]

    def model_input(self) -> ModelInput:
        p = self.params
        return ModelInput(self.latents, self.timestep, self.cond, self.uncond, p.guidance_scale, p.guidance_scale_2,
                          self.lora)

    def _sde_type(self) -> str:
        """This step's SDE type: the request's inside its window of SDE steps, ``ode`` outside it."""
        windowed = self.sde.sde_step_indices is not None and self.step not in self.sde.sde_step_indices
        return "ode" if windowed else self.sde.sde_type

    def advance(self, velocity: torch.Tensor) -> None:
        """Take this request's step ``self.step`` with the guided model output."""
        if self.sde is None:
            self.latents = self.scheduler.step(velocity, self.timestep, self.latents, return_dict=False)[0]
        else:
            out = step_at(self.scheduler.sigmas, self.step, velocity, self.latents, sde_type=self._sde_type(),
                          noise_level=self.sde.noise_level, generator=self.generator)
            self.latents = out.prev_sample
            if out.log_prob is not None:
                self.log_probs.append(out.log_prob[0])
                self.log_prob_steps.append(self.step)
        if self.wants_trajectory:
            self.trajectory.append(self.latents)
        self.step += 1

    def extras(self) -> dict[str, torch.Tensor]:
        """Rollout tensors for the response (empty for a plain generation)."""
        r = self.params.rollout
        out: dict[str, torch.Tensor] = {}
        if r is None:
            return out
        if self.sde is not None and r.return_log_probs:
            out[LOG_PROBS.name] = torch.stack(self.log_probs).float() if self.log_probs else torch.zeros(0)
            out[LOG_PROB_STEPS.name] = torch.tensor(self.log_prob_steps, dtype=torch.int64)
        if r.return_trajectory:
            out[TRAJECTORY_LATENTS.name] = torch.cat([x.float() for x in self.trajectory], dim=0)
            out[TRAJECTORY_TIMESTEPS.name] = self.scheduler.timesteps.float()
            out[TRAJECTORY_SIGMAS.name] = self.scheduler.sigmas.float()
        return out
