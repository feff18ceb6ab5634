"""One step for every task of a batched forward, with the SDE steps that can be shared taken together.

Tasks whose samples stand at the same step of the same schedule with the same
SDE settings (:meth:`DenoiseTask.step_key`; the samples of one request always
do, requests with equal settings often do) take that step in one
:func:`~common.diffusion.policy.step_at` call on the stacked tensors: one set of
coefficients, one log-prob reduction. Each sample still draws its noise from
its own generator, so every sample gets what it gets alone. Serving (UniPC)
tasks step on their own scheduler, all their samples at once.
"""

from __future__ import annotations

import torch

from common.diffusion import streams
from common.diffusion.policy import step_at
from common.diffusion.sde import SdeStep
from denoise_worker.reference import record_kl, wants_kl
from denoise_worker.step_plan import Guided
from denoise_worker.task import DenoiseTask


def advance_all(tasks: list[DenoiseTask], guided: list[Guided | torch.Tensor]) -> list[BaseException | None]:
    """Step each task with its guided model output (a :class:`Guided`, or the bare output of a step without a
    KL reference); per task, None or the error that stopped it."""
    guided = [g if isinstance(g, Guided) else Guided(g) for g in guided]
    for task, g in zip(tasks, guided):
        task.record.reference_passes += g.reference_passes
    errors: list[BaseException | None] = [None] * len(tasks)
    shared: dict[tuple, list[int]] = {}
    for i, task in enumerate(tasks):
        key = task.step_key()
        if key is not None:
            shared.setdefault(key, []).append(i)
            continue
        try:
            task.advance(guided[i].velocity)
        except Exception as e:  # one request's failure is its own
            errors[i] = e
    for idx in shared.values():
        try:
            _sde_step_together([tasks[i] for i in idx], [guided[i] for i in idx])
        except Exception as e:
            for i in idx:
                errors[i] = e
    return errors


def _sde_step_together(tasks: list[DenoiseTask], guided: list[Guided]) -> None:
    velocities = [g.velocity for g in guided]
    first = tasks[0]  # equal keys: every task's sigmas at its step equal the first one's
    one = len(tasks) == 1
    masks = [t.log_prob_mask() for t in tasks]  # equal keys: all None, or all tensors
    mask = None if masks[0] is None else torch.cat([m.expand(t.n, *m.shape[1:]) for m, t in zip(masks, tasks)])
    out = step_at(first.scheduler.sigmas, first.step,
                  velocities[0] if one else torch.cat(velocities),
                  first.latents if one else torch.cat([t.latents for t in tasks]),
                  first.step_variant_now(), generator=[g for t in tasks for g in t.step_generators()], log_prob_mask=mask)
    start = 0
    sigma, sigma_next = first.scheduler.sigmas[first.step], first.scheduler.sigmas[first.step + 1]
    for task, velocity, g in zip(tasks, velocities, guided):
        rows = slice(start, start + task.n)
        start += task.n
        step = SdeStep(out.prev_sample[rows], None if out.log_prob is None else out.log_prob[rows], out.mean[rows],
                       out.noise_scale[rows])
        if step.log_prob is None:
            task.took(step.prev_sample)
            continue
        if task.rule.ode is not None:  # the streams the SDE leaves out take their Euler step
            step = streams.follow_ode(step, task.latents, velocity, sigma, sigma_next, task.rule.ode)
        if wants_kl(task):  # against the reference, before the latents move on
            record_kl(task, step, g.ref_velocity)
        by_stream = streams.stream_log_probs(task.step_variant_now(), step, task.rule.streams,
                                             task.info.family.condition.log_prob_mask(task.info, task.latents,
                                                                                      task.image))
        task.took(step.prev_sample, step.log_prob, by_stream)
