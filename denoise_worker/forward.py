"""A batched step's forwards: every request's guided model output from forwards of at most ``max_batch`` rows."""

from __future__ import annotations

from typing import Callable

import torch

from common.diffusion.policy import ModelInput, Policy
from denoise_worker.caching import plan_step
from denoise_worker.packing import forward_parts
from denoise_worker.pinned import with_pinned
from denoise_worker.reference import with_reference
from denoise_worker.step_plan import Guided, StepPlan, guide
from denoise_worker.task import DenoiseTask

BeforeForward = Callable[[list[ModelInput]], None]  # called with each forward's inputs (e.g. to size threads)
Outcome = Guided | Exception  # a task's guided output, or the error of its own forwards


def plan_rows(policy: Policy, tasks: list[DenoiseTask]) -> list[StepPlan]:
    """Each task's rows at this step, as data: its own (or, with step caching, the branches that compute), the
    KL reference's adapter-free rows in the same forward, a pinned reference's input for a forward of its own."""
    return with_pinned(tasks, with_reference(tasks, plan_step(policy, tasks)))


@torch.no_grad()
def step_velocities(policy: Policy, tasks: list[DenoiseTask], max_batch: int,
                    before: BeforeForward | None = None) -> list[Guided]:
    """Guided model outputs ([n, ...] per task) for tasks at (possibly) different steps; the rows that
    requests with caching skip take no part in the forwards (denoise_worker/caching.py)."""
    outcomes = _finish(policy, plan_rows(policy, tasks), max_batch, before)
    for outcome in outcomes:
        if isinstance(outcome, Exception):  # several ranks share this forward: any failure is the worker's
            raise outcome
    return outcomes


@torch.no_grad()
def step_each(policy: Policy, tasks: list[DenoiseTask], max_batch: int,
              before: BeforeForward | None = None) -> tuple[list[Outcome], bool]:
    """:func:`step_velocities` where a failure fails only the tasks that fail alone: when the tasks' shared
    forwards fail, each task runs its step in forwards of its own, and one whose own forward fails gets its
    error in place of its output. Also whether the outputs came from the shared forwards.

    Planning (the caching requests' decisions) happens once: a retry re-runs the forwards of the same plans,
    so each task's cache state advances one step, as alone. Planning computes every task's signal (a probe
    forward of several tasks) before any decision: when that fails, each task plans and runs alone.
    """
    try:
        plans = plan_rows(policy, tasks)
    except Exception as e:
        if len(tasks) == 1:
            return [e], True
        return [step_each(policy, [t], max_batch, before)[0][0] for t in tasks], False
    try:
        return _finish(policy, plans, max_batch, before), True
    except Exception as e:
        if sum(bool(plan.inputs) for plan in plans) <= 1:  # no batch mate to blame: the error is the task's own
            return [e if plan.inputs else _guided(policy, plan, []) for plan in plans], True
        return [_alone(policy, plan, max_batch, before) for plan in plans], False


def _finish(policy: Policy, plans: list[StepPlan], max_batch: int, before: BeforeForward | None) -> list[Outcome]:
    """The plans' forwards (a failure raises), then each plan's guided output (or its own error)."""
    outs = iter(forward_inputs(policy, [x for plan in plans for x in plan.inputs], max_batch, before))
    return [_guided(policy, plan, [next(outs) for _ in plan.inputs]) for plan in plans]


def _alone(policy: Policy, plan: StepPlan, max_batch: int, before: BeforeForward | None) -> Outcome:
    try:
        return _finish(policy, [plan], max_batch, before)[0]
    except Exception as e:
        return e


def _guided(policy: Policy, plan: StepPlan, outs: list[torch.Tensor]) -> Outcome:
    try:
        return guide(policy, plan, outs)
    except Exception as e:  # one request's failure is its own
        return e


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
