"""One batched step's forward inputs when requests cache steps, and each request's output from them.

A request without caching brings its usual :class:`ModelInput` (guided by the policy). A request with
caching (its task's :class:`~common.diffusion.step_cache.RequestCache`) brings each CFG branch as a piece
of its own, holding only the rows that compute at this step; the rows that skip bring nothing to the
forward. Its output is put together from the computed rows and its cache, then guided as the policy
guides. The ``first_block`` probes of every request in the step run as one forward.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from common.diffusion.cache_signals import first_block_residuals, modulated_input
from common.diffusion.policy import ModelInput, Policy
from common.diffusion.step_cache import RequestCache
from denoise_worker.step_plan import CachedBranches, StepPlan
from denoise_worker.task import DenoiseTask


def request_cache(task: DenoiseTask, settings: tuple[tuple[float, ...], int]) -> RequestCache | None:
    """The caching state of a new task whose request asks for it (``settings``: the model's TeaCache ones)."""
    if task.params.cache is None:
        return None
    coefficients, warmup = settings
    teacache = task.params.cache.method == "teacache"
    return RequestCache(task.params.cache, task.n, task.branches, len(task.scheduler.timesteps),
                        warmup=warmup if teacache else 1, coefficients=coefficients)


def plan_step(policy: Policy, tasks: list[DenoiseTask]) -> list[StepPlan]:
    """Each task's own rows at this step (one expert for the whole batched step)."""
    name = policy.expert_for(tasks[0].timestep)
    plans: list[StepPlan | None] = [None] * len(tasks)
    branches: dict[int, list[ModelInput]] = {}
    x_of: dict[int, ModelInput] = {}
    for i, task in enumerate(tasks):
        if task.cache is None:
            x = task.model_input()
            plans[i] = StepPlan(task, name, x, [x])
            continue
        x = x_of[i] = task.model_input()
        # Each pass alone, without its request's guidance settings: the forward gives back its raw output.
        branches[i] = [replace(x, cond=c, uncond=None, passes=(), unconditional=b > 0, settings=None)
                       for b, c in enumerate(x.branches)]
    if not branches:
        return plans
    signals = _signals(policy, name, {i: (tasks[i], b) for i, b in branches.items()})
    for i, pieces in branches.items():
        plans[i] = _cached_plan(name, tasks[i], x_of[i], pieces, signals.get(i))
    return plans


def _signals(policy: Policy, name: str, cached: dict[int, tuple[DenoiseTask, list[ModelInput]]]):
    """Each caching request's signal per branch, or none where this step does not need one."""
    out: dict[int, list[torch.Tensor]] = {}
    probe: list[tuple[int, list[ModelInput]]] = []
    for i, (task, pieces) in cached.items():
        if not task.cache.wants_signal(task.step):
            continue
        if task.cache.method == "teacache":
            out[i] = [modulated_input(policy, name, x) for x in pieces]
        else:
            probe.append((i, pieces))
    if probe:
        residuals = iter(first_block_residuals(policy, name, [x for _, pieces in probe for x in pieces]))
        for i, pieces in probe:
            out[i] = [next(residuals) for _ in pieces]
    return out


def _cached_plan(name: str, task: DenoiseTask, x: ModelInput, pieces: list[ModelInput],
                 signals: list[torch.Tensor] | None) -> StepPlan:
    forced = task.sde is not None and not task.step_variant_now().deterministic  # a rollout's SDE step is never cached
    masks = task.cache.decide(task.step, name, forced, signals)
    inputs, which = [], []
    for b, (piece, mask) in enumerate(zip(pieces, masks)):
        if bool(mask.all()):
            inputs.append(piece)
        elif bool(mask.any()):
            rows = mask.nonzero().flatten().to(piece.latents.device)
            t = piece.timestep if piece.timestep.dim() == 0 else piece.timestep[rows]
            inputs.append(replace(piece, latents=piece.latents[rows], timestep=t))
        else:
            continue
        which.append(b)
    return StepPlan(task, name, x, inputs, CachedBranches(masks, which))
