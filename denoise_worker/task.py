"""One request's denoising state, owned by that request alone.

A :class:`DenoiseTask` holds everything that changes while a request is
denoised: its scheduler (rebuilt for it), its generator (seeded from its
seed: initial noise first, then the SDE noise), its latents, its step index,
and what it returns (trajectory, log-probs). The worker only asks a task for
its current timestep and hands it the guided model output; nothing of one
request lives on a shared object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.protocol.messages import GenerationParams, RolloutParams
from common.wan.model_info import ModelInfo
from common.wan.sde import sde_step
from common.wan import schedulers


def initial_noise(info: ModelInfo, params: GenerationParams, generator: torch.Generator) -> torch.Tensor:
    """The seed's initial latents, drawn exactly as diffusers' WanPipeline draws them."""
    shape = info.latent_shape(params.height, params.width, params.num_frames)
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def rollout_of(params: GenerationParams) -> RolloutParams | None:
    """The request's rollout settings when it asked for the rollout scheduler, else None."""
    r = params.rollout
    return r if r is not None and r.rollout else None


@dataclass
class DenoiseTask:
    params: GenerationParams
    cond: torch.Tensor
    uncond: torch.Tensor | None
    scheduler: object
    generator: torch.Generator
    latents: torch.Tensor
    rollout: RolloutParams | None
    step: int = 0
    trajectory: list[torch.Tensor] = field(default_factory=list)
    log_probs: list[torch.Tensor] = field(default_factory=list)
    log_prob_steps: list[int] = field(default_factory=list)

    @classmethod
    def create(cls, params, cond, uncond, info: ModelInfo, serving_template, rollout_template, device):
        rollout = rollout_of(params)
        template = rollout_template if rollout is not None else serving_template
        scheduler = schedulers.build(template, params, device)
        if rollout is not None:
            schedulers.check_flow_match_convention(scheduler)
        generator = torch.Generator("cpu").manual_seed(params.seed)
        latents = initial_noise(info, params, generator).to(device)
        task = cls(params, cond, uncond, scheduler, generator, latents, rollout)
        if task.wants_trajectory:
            task.trajectory.append(latents)
        return task

    @property
    def wants_trajectory(self) -> bool:
        return self.params.rollout is not None and self.params.rollout.return_trajectory

    @property
    def num_steps(self) -> int:
        return len(self.scheduler.timesteps)

    @property
    def done(self) -> bool:
        return self.step >= self.num_steps

    @property
    def timestep(self) -> torch.Tensor:
        return self.scheduler.timesteps[self.step]

    def _is_sde_step(self) -> bool:
        r = self.rollout
        if r is None or r.sde_type == "ode":
            return False
        return r.sde_step_indices is None or self.step in r.sde_step_indices

    def advance(self, velocity: torch.Tensor) -> None:
        """Take this request's step ``self.step`` with the guided model output."""
        if self.rollout is None:
            self.latents = self.scheduler.step(velocity, self.timestep, self.latents, return_dict=False)[0]
        else:
            sig = self.scheduler.sigmas
            s, s_next = sig[self.step], sig[self.step + 1]
            s_max = sig[1] if sig.numel() > 1 else sig[0]
            sde_type = self.rollout.sde_type if self._is_sde_step() else "ode"
            out = sde_step(
                velocity, self.latents, s, s_next, s_max,
                sde_type=sde_type, noise_level=self.rollout.noise_level, generator=self.generator,
            )
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
        if self.rollout is not None and r.return_log_probs:
            out["log_probs"] = torch.stack(self.log_probs).float() if self.log_probs else torch.zeros(0)
            out["log_prob_steps"] = torch.tensor(self.log_prob_steps, dtype=torch.int64)
        if r.return_trajectory:
            out["trajectory.latents"] = torch.cat([x.float() for x in self.trajectory], dim=0)
            out["trajectory.timesteps"] = self.scheduler.timesteps.float()
            out["trajectory.sigmas"] = self.scheduler.sigmas.float()
        return out
