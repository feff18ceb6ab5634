"""A batched step's forwards: every request's guided model output from forwards of at most ``max_batch`` rows."""

from __future__ import annotations

from typing import Callable

import torch

from common.diffusion.policy import ModelInput, Policy
from denoise_worker.caching import plan_step
from denoise_worker.packing import forward_parts
from denoise_worker.task import DenoiseTask

BeforeForward = Callable[[list[ModelInput]], None]  # called with each forward's inputs (e.g. to size threads)


@torch.no_grad()
def step_velocities(policy: Policy, tasks: list[DenoiseTask], max_batch: int,
                    before: BeforeForward | None = None) -> list[torch.Tensor]:
    """Guided model outputs ([n, ...] per task) for tasks at (possibly) different steps; the rows that
    requests with caching skip take no part in the forwards (denoise_worker/caching.py)."""
    plans = plan_step(policy, tasks)
    outs = iter(forward_inputs(policy, [x for plan in plans for x in plan.inputs], max_batch, before))
    return [plan.finish([next(outs) for _ in plan.inputs]) for plan in plans]


def forward_inputs(policy: Policy, inputs: list[ModelInput], max_batch: int,
                   before: BeforeForward | None = None) -> list[torch.Tensor]:
    """The policy's output ([n, ...] per input): one forward, or one per ``max_batch`` rows."""
    outs: list[list[torch.Tensor]] = [[] for _ in inputs]
    if not inputs:  # every row of every request reuses its cache at this step
        return []
    for part in forward_parts(inputs, max_batch):
        xs = [x for _, x in part]
        if before is not None:
            before(xs)
        for (i, _), v in zip(part, policy.batched_velocity(xs)):
            outs[i].append(v)
    return [v[0] if len(v) == 1 else torch.cat(v) for v in outs]
