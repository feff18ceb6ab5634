"""One request's denoising state, owned by that request alone.

A :class:`DenoiseTask` holds everything that changes while a request's ``n``
samples are denoised: its scheduler (rebuilt for it, shared by its samples,
which always stand at the same step), one generator per sample (seeded from
``seed + i``: initial noise first, then the SDE noise; only the SDE noise when
the request shares one initial noise, denoise_worker/branching.py), the stacked
latents [n, ...] (one row during a shared prefix), its step index, and what it
returns (trajectory, log-probs). The worker only asks a task for its model input
and hands it the guided model output; nothing of one request lives on a shared object. Each sample gets
exactly the noise it gets alone, so a group equals its samples run one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.protocol.messages import (
    CONDITIONING,
    KL,
    LOG_PROB_STEPS,
    LOG_PROBS,
    REF_LOG_PROBS,
    STREAM_LOG_PROBS,
    TRAJECTORY_LATENTS,
    TRAJECTORY_STEPS,
    TRAJECTORY_SIGMAS,
    TRAJECTORY_TIMESTEPS,
    GenerationParams,
    RolloutParams,
)
from common.diffusion import schedulers, streams
from common.diffusion.conditioning import conditioning_tensors
from common.diffusion.after_window import last_sde_step, serving_after
from common.diffusion.parts.text import Conditioning
from common.diffusion.lora import LoraAdapter
from common.diffusion.model_info import ModelInfo
from common.diffusion.policy import ModelInput, sigma_max
from common.diffusion.resume import starting_latents
from common.diffusion.step_cache import RequestCache
from common.diffusion.sde import check_schedule
from common.diffusion.step_variants import Ode, StepVariant, step_variant
from common.protocol.errors import RequestError
from denoise_worker import branching
from denoise_worker.rollout_record import RolloutRecord


def initial_noise(info: ModelInfo, params: GenerationParams, generators: list[torch.Generator]) -> torch.Tensor:
    """Each sample's initial latents [n, ...], drawn from its own generator as the family's diffusers pipeline draws them."""
    return torch.cat([info.family.latents.draw(info, params, g) for g in generators])


def step_versions(weight_versions: list[int], lora: tuple[LoraAdapter, float] | None) -> dict[str, list[int]]:
    """A rollout answer's per-step tags: the weight version each step ran on and, with an adapter, its version
    (a request keeps the adapter version it started with)."""
    out = {"step_weight_versions": list(weight_versions)}
    if lora is not None:
        out["step_lora_versions"] = [lora[0].version] * len(weight_versions)
    return out


def sde_settings(params: GenerationParams) -> RolloutParams | None:
    """The request's rollout settings when it runs the rollout (SDE) scheduler, else None (serving)."""
    r = params.rollout
    return r if r is not None and r.sde_scheduler else None


@dataclass
class StepRule:
    """How a rollout request's steps are taken: its SDE settings and variant, the latent elements that follow
    their ODE (several streams), the serving scheduler that takes over after its window, and the step where a
    shared prefix branches."""

    sde: RolloutParams | None = None  # None: the serving scheduler steps this request
    variant: StepVariant | None = None  # the request's SDE step variant (with ``sde``; checked at creation)
    # ode_solver "serving": the serving scheduler that steps from ``after_from`` (the step after the last SDE step)
    after: object | None = None
    after_from: int | None = None
    branch_at: int = 0  # share_prefix: the step where its one row becomes n (denoise_worker/branching.py)
    # Several latent streams (common/diffusion/streams.py): the SDE streams' masks, and the elements that follow
    # their ODE at an SDE step (None: none).
    streams: dict[str, torch.Tensor] = field(default_factory=dict)
    ode: torch.Tensor | None = None


@dataclass
class DenoiseTask:
    params: GenerationParams
    info: ModelInfo
    cond: Conditioning
    uncond: Conditioning | None
    scheduler: object
    generators: list[torch.Generator]  # one per sample
    latents: torch.Tensor  # [n, *latent] (the family's: Binding.latents.shape)
    rule: StepRule
    lora: tuple[LoraAdapter, float] | None = None  # the adapter version and scale it started with
    image: torch.Tensor | None = None  # image-to-video: the latent-side condition [1, ...] (Binding)
    cache: RequestCache | None = None  # step caching (denoise_worker/caching.py); None: every step computes
    reference: object | None = None  # kl_reference "pinned": the pinned Policy it started with (pinned.py)
    step: int = 0
    record: RolloutRecord = field(default_factory=RolloutRecord)

    @property
    def sde(self) -> RolloutParams | None:
        return self.rule.sde

    @classmethod
    def create(cls, params, cond, uncond, info: ModelInfo, serving_template, rollout_template, device, lora=None,
               image: torch.Tensor | None = None, initial_latents: torch.Tensor | None = None):
        """``initial_latents``: a resumed rollout's starting latents [1 or n, *latent] (checked by the router,
        common/diffusion/resume.py), used instead of the drawn noise."""
        sde = sde_settings(params)
        seq_len = info.family.latents.seq_len(info, params)
        on_rollout = sde is not None and sde.schedule == "rollout"
        scheduler = schedulers.build(rollout_template if on_rollout else serving_template, params, device,
                                     image_seq_len=seq_len, default_sigmas=info.family.guidance.default_sigmas,
                                     mu=info.family.latents.mu(info, params))
        if sde is not None:
            schedulers.check_rollout_schedule(scheduler)
        generators = [torch.Generator("cpu").manual_seed(params.sample_seed(i)) for i in range(params.n)]
        shared = branching.shared_noise_seed(params)
        branch_at = branching.branch_step(params, len(scheduler.timesteps))
        if shared is None:
            latents = initial_noise(info, params, generators)
        else:  # one draw for every sample; the samples' generators keep their whole stream for the SDE noise
            latents = branching.noise_rows(
                initial_noise(info, params, [torch.Generator("cpu").manual_seed(shared)]), params.n, branch_at)
        if initial_latents is not None:  # drawn all the same: the generators stand where a fresh run's do
            latents = starting_latents(initial_latents, latents.to(device))
        rule = StepRule(sde, branch_at=branch_at)
        task = cls(params, info, cond, uncond, scheduler, generators, latents.to(device), rule, lora, image)
        if sde is not None:  # a noise level its variant refuses fails the request here, before any step
            ode = streams.ode_mask(info, params)
            rule.ode = None if ode is None else ode.to(device)
            condition = info.family.condition.log_prob_mask(info, task.latents, task.image)
            rule.streams = {k: m.to(device) for k, m in streams.sde_streams(info, params, condition).items()}
            joint = task.log_prob_mask()
            if joint is not None and not bool(joint.bool().any()):
                raise RequestError("sde_streams: the SDE streams hold no element a step moves (an image-to-video "
                                   "request of one latent frame has only the image's); choose another stream or "
                                   "more frames")
            rule.variant = step_variant(sde.sde_type, sde.noise_level)
            task._check_schedule()
            last = last_sde_step(sde.sde_step_indices)
            if sde.ode_solver == "serving" and last is not None and last + 1 < len(scheduler.timesteps):
                rule.after_from = last + 1
                rule.after = serving_after(serving_template, scheduler, last + 1)
        if task.wants_trajectory:
            task.record.trajectory.append(task.latents)
        return task

    @property
    def n(self) -> int:
        """The rows it brings to a forward: its samples, or one during a shared prefix."""
        return self.latents.shape[0]

    @property
    def samples(self) -> int:
        return self.params.n

    @property
    def branches(self) -> int:
        """The guidance passes each of its samples runs per step (1 without guidance)."""
        return len(self.info.family.guidance.passes(self.params, self.cond)) + (1 if self.uncond is None else 2)

    def step_generators(self) -> list[torch.Generator]:
        """One generator per row: during a shared prefix the step is deterministic and draws nothing."""
        return self.generators[:self.n]

    @property
    def wants_trajectory(self) -> bool:
        return self.params.rollout is not None and self.params.rollout.return_trajectory

    @property
    def schedule(self) -> str:
        """Which schedule steps it (the answer's ``schedule``): the rollout (flow-match Euler) one, or the
        serving scheduler's (a plain generation, ``rollout: false``, or ``schedule: "serving"``)."""
        return "serving" if self.sde is None else self.sde.schedule

    @property
    def done(self) -> bool:
        return self.step >= len(self.scheduler.timesteps)

    @property
    def timestep(self) -> torch.Tensor:
        return self.scheduler.timesteps[self.step]

    def model_input(self) -> ModelInput:
        return ModelInput.of(self.info, self.params, self.latents, self.timestep, self.cond, self.uncond, self.lora,
                             self.image, self.scheduler.sigmas[self.step])

    def variant_at(self, step: int) -> StepVariant:
        """Step ``step``'s variant: the request's inside its window of SDE steps, the Euler step outside it."""
        windowed = self.sde.sde_step_indices is not None and step not in self.sde.sde_step_indices
        return Ode(self.rule.variant.noise_level) if windowed else self.rule.variant

    def step_variant_now(self) -> StepVariant:
        return self.variant_at(self.step)

    def _check_schedule(self) -> None:
        """Every step's variant is defined on the request's schedule (caller sigmas may make one undefined, e.g.
        ``sde`` at two sigmas of 1): a 400 now rather than a failure at that step."""
        s = self.scheduler.sigmas
        try:
            check_schedule([self.variant_at(i) for i in range(len(self.scheduler.timesteps))], s, float(sigma_max(s)))
        except ValueError as e:
            raise RequestError(f"the rollout's schedule: {e}") from None

    def step_key(self) -> tuple | None:
        """What an SDE step depends on besides the tensors: tasks with equal keys take this step in one
        ``sde_step`` call (see denoise_worker/joint_step.py). None: the serving scheduler steps it alone."""
        if self.sde is None or self.past_window:
            return None
        s = self.scheduler.sigmas
        return (self.step_variant_now(), float(s[self.step]), float(s[self.step + 1]),
                float(sigma_max(s)), float(s[-1]), self.log_prob_mask() is not None)

    def log_prob_mask(self) -> torch.Tensor | None:
        """Which latent elements this request's log-probs average over (None: all): the condition's
        (Binding.condition.log_prob_mask) on the SDE streams (common/diffusion/streams.py)."""
        condition = self.info.family.condition.log_prob_mask(self.info, self.latents, self.image)
        return condition if self.rule.ode is None else streams.times(condition, 1 - self.rule.ode)

    def output_latents(self) -> torch.Tensor:
        """The final latents as the family's pipeline returns them."""
        latents = branching.per_sample(self.latents, self.samples)  # (a partial answer inside a shared prefix)
        return self.info.family.condition.final_latents(self.info, latents, self.image)

    @property
    def past_window(self) -> bool:
        """This step is one of the serving scheduler's after the last SDE step (``ode_solver: "serving"``)."""
        return self.rule.after_from is not None and self.step >= self.rule.after_from

    def advance(self, velocity: torch.Tensor) -> None:
        """Take a serving-scheduler step with the guided model output (all samples at once)."""
        scheduler = self.rule.after if self.past_window else self.scheduler
        self.took(scheduler.step(velocity, self.timestep, self.latents, return_dict=False)[0])

    def took(self, latents: torch.Tensor, log_prob: torch.Tensor | None = None,
             by_stream: dict[str, torch.Tensor] | None = None) -> None:
        """Record this step's outcome: the new latents and, for a stochastic SDE step, its [n] log-probs (and
        each SDE stream's, for a model with several)."""
        self.latents = latents
        if log_prob is not None:
            self.record.step(self.step, log_prob, by_stream)
        if self.wants_trajectory:
            self.record.trajectory.append(latents)
        self.step += 1
        if self.step == self.rule.branch_at:  # the shared prefix ends: each sample goes on from its own row
            self.latents = branching.per_sample(self.latents, self.samples)

    def pass_counts(self) -> dict[str, list[int] | int]:
        """Per sample: full transformer forwards of its own rows (summed over its CFG branches) and reused
        row-steps; with a shared prefix also ``prefix_transformer_passes``, the group's once."""
        ref = self.record.reference_passes  # return_kl's reference rows
        if self.cache is not None:
            return {"transformer_passes": [p + ref for p in self.cache.transformer_passes],
                    "cached_steps": list(self.cache.cached_steps)}
        branches = self.branches
        shared = min(self.step, self.rule.branch_at)
        out = {"transformer_passes": [(self.step - shared) * branches + ref] * self.samples,
               "cached_steps": [0] * self.samples}
        if self.params.rollout is not None and self.params.rollout.share_prefix:
            out["prefix_transformer_passes"] = shared * branches
        return out

    def window_info(self) -> dict[str, list[int]]:
        """The answer's ``sde_window`` [start, stop) when the request's window was picked from its seed."""
        return {} if self.sde is None or self.sde.sde_window is None else {"sde_window": list(self.sde.sde_window)}

    def extras(self) -> dict[str, torch.Tensor]:
        """Rollout tensors for the response (empty for a plain generation); per-sample ones lead with n."""
        r, record = self.params.rollout, self.record
        out: dict[str, torch.Tensor] = {}
        if r is None:
            return out
        if self.sde is not None and r.return_log_probs:
            out[LOG_PROBS.name] = record.log_prob_tensor(record.log_probs, self.samples)
            out[LOG_PROB_STEPS.name] = torch.tensor(record.log_prob_steps, dtype=torch.int64)
            for name in self.rule.streams:
                out[STREAM_LOG_PROBS[name].name] = record.log_prob_tensor(record.stream_log_probs.get(name, []),
                                                                          self.samples)
        if self.sde is not None and r.return_kl:  # [n, K] beside log_probs, the same steps
            for f, values in ((KL, record.kls), (REF_LOG_PROBS, record.ref_log_probs)):
                out[f.name] = record.log_prob_tensor(values, self.n)
            out[LOG_PROB_STEPS.name] = torch.tensor(record.log_prob_steps, dtype=torch.int64)
        if r.return_conditioning:  # what the transformer took besides latents and timestep (shared)
            guidance = self.info.family.guidance.embedded(self.info, self.params.guidance_scale)
            for name, t in conditioning_tensors(self.cond, self.uncond, self.image, guidance).items():
                out[CONDITIONING.name + name] = t
        if r.return_trajectory:  # the steps taken: all of them, or a cancelled rollout's (partial answer)
            kept = range(len(record.trajectory))
            if r.trajectory_steps is not None:  # the entries asked for (of those a partial answer reached)
                kept = [i for i in r.trajectory_steps if i < len(record.trajectory)]
                out[TRAJECTORY_STEPS.name] = torch.tensor(kept, dtype=torch.int64)
            out[TRAJECTORY_LATENTS.name] = (torch.stack(
                [branching.per_sample(record.trajectory[i].float(), self.samples) for i in kept], dim=1) if kept
                else self.latents.new_zeros((self.samples, 0, *self.latents.shape[1:])).float())
            out[TRAJECTORY_TIMESTEPS.name] = self.scheduler.timesteps[:self.step].float()
            out[TRAJECTORY_SIGMAS.name] = self.scheduler.sigmas[:self.step + 1].float()
        return out
