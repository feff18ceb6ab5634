"""A rollout's reference rows (``return_kl``): the same request with its adapter off, in the same forward.

At each stochastic SDE step of a request that asks for ``return_kl`` and runs with an adapter, its plan
(:class:`denoise_worker.step_plan.StepPlan`) gets one more input: the request's own model input (same
latents, timestep, texts, guidance) without the adapter. Policy.batched_velocity puts those rows with the
other adapter-free rows of the step, so the reference costs rows, not a forward. The guided reference
velocity comes back with the request's own (:class:`denoise_worker.step_plan.Guided`) to the step's record
phase (denoise_worker/joint_step.py), where
:func:`common.diffusion.kl.kl_at` turns it into the step's KL and reference log-prob.

Without an adapter the reference is the policy itself: no extra rows, the KL is 0 and the reference
log-probs are the log-probs.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from common.diffusion.kl import kl_at
from common.diffusion.policy import sigma_max
from common.diffusion.sde import SdeStep
from denoise_worker.step_plan import StepPlan
from denoise_worker.task import DenoiseTask


def wants_kl(task: DenoiseTask) -> bool:
    return task.sde is not None and task.params.rollout.return_kl


def stochastic_now(task: DenoiseTask) -> bool:
    """Whether this step draws noise (and so has a log-prob and a KL): its variant's noise scale is not 0."""
    if task.past_window:  # the serving scheduler's steps after the window
        return False
    variant = task.step_variant_now()
    if variant.deterministic:
        return False
    s = task.scheduler.sigmas.detach().float().cpu()
    i = task.step
    _, _, sd = variant.coefficients(s[i : i + 1], s[i + 1 : i + 2], sigma_max(s).reshape(1), s[-1:])
    return bool(sd[0] > 0)


def needs_rows(task: DenoiseTask) -> bool:
    return wants_kl(task) and task.lora is not None and task.reference is None and stochastic_now(task)


def with_reference(tasks: list[DenoiseTask], plans: list[StepPlan]) -> list[StepPlan]:
    """``plans`` (one per task) with the reference rows of the tasks that need them at this step."""
    return [_with_rows(task, plan) if needs_rows(task) else plan for task, plan in zip(tasks, plans)]


def _with_rows(task: DenoiseTask, plan: StepPlan) -> StepPlan:
    # A caching request's SDE step is never cached, so its whole input (both branches) is the reference's too.
    return replace(plan, reference=replace(plan.model_input, lora=None))


def record_kl(task: DenoiseTask, step: SdeStep, ref_velocity: torch.Tensor | None) -> None:
    """The step's KL and reference log-probs ([n] each) for a task that asks for them; ``step``: its rows of
    the step just taken from ``task.latents`` (before :meth:`DenoiseTask.took`), ``ref_velocity``: the
    reference's guided output at this step (none where the reference is the policy)."""
    if task.lora is None and task.reference is None:  # the reference is the policy
        task.record.kl(torch.zeros_like(step.log_prob), step.log_prob)
        return
    if ref_velocity is None:
        raise RuntimeError("the reference rows of this step did not run")
    out = kl_at(task.scheduler.sigmas, task.step, step, ref_velocity, task.latents, task.step_variant_now(),
                task.log_prob_mask())
    task.record.kl(out.kl, out.ref_log_prob)
