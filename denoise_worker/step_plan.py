"""A request's part of one batched step, as data: which rows it adds to the step's forward and how its guided
output is made from theirs.

:class:`StepPlan` is filled in phases (denoise_worker/caching.py: the request's own rows, and with step caching
the branches that compute; denoise_worker/reference.py: ``return_kl``'s adapter-free rows in the same forward;
denoise_worker/pinned.py: the rows its pinned reference runs on its own copy), then the forwards run, then
:func:`guide` turns the rows' outputs into a :class:`Guided`. Nothing is written to the task on the way: the
step's record phase (denoise_worker/joint_step.py) reads the :class:`Guided`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.diffusion.policy import ModelInput, Policy
from denoise_worker.task import DenoiseTask


@dataclass(frozen=True)
class CachedBranches:
    """Step caching's decision for one request at one step: per branch, which samples compute (``masks``) and
    the branches that bring rows to the forward (``computed``, in the order of their inputs)."""

    masks: list[torch.Tensor]
    computed: list[int]


@dataclass(frozen=True)
class StepPlan:
    task: DenoiseTask
    expert: str  # the expert every row of the step runs on
    model_input: ModelInput  # the request's guided input at this step
    own: list[ModelInput]  # its rows in the forward: ``[model_input]``, or the branches that compute (caching)
    cached: CachedBranches | None = None  # None: no step caching, ``own`` is the whole input
    reference: ModelInput | None = None  # return_kl with an adapter: its adapter-free rows, after ``own``
    pinned: ModelInput | None = None  # return_kl "pinned": the input the pinned copy runs (a forward of its own)

    @property
    def inputs(self) -> list[ModelInput]:
        """What the request adds to the step's shared forward (possibly nothing: every row reuses its cache)."""
        return [*self.own, *(() if self.reference is None else (self.reference,))]


@dataclass(frozen=True)
class Guided:
    """A request's outcome of the forward phase: its guided model output ([n, ...]) and, for a KL step, its
    reference's guided output and the reference's forwards per sample."""

    velocity: torch.Tensor
    ref_velocity: torch.Tensor | None = None
    reference_passes: int = 0


def guide(policy: Policy, plan: StepPlan, outs: list[torch.Tensor]) -> Guided:
    """``plan``'s guided outputs from the forward's outputs for its :attr:`StepPlan.inputs`."""
    own = outs[:len(plan.own)]
    if plan.cached is None:
        velocity = own[0]
    else:  # the computed branches' rows, the others from the request's cache, then guided as the policy guides
        task, computed = plan.task, dict(zip(plan.cached.computed, own))
        velocity = policy.combine(plan.expert, plan.model_input, [
            task.cache.output(b, mask, computed.get(b)) for b, mask in enumerate(plan.cached.masks)])
    if plan.reference is not None:
        return Guided(velocity, outs[len(plan.own)], len(plan.reference.branches))
    if plan.pinned is not None:  # other weights: the copy's own forward
        reference: Policy = plan.task.reference
        return Guided(velocity, reference.batched_velocity([plan.pinned])[0], len(plan.pinned.branches))
    return Guided(velocity)
