"""Groups that share their initial noise, and groups that branch from a shared prefix.

``initial_noise_seed``: every sample's initial noise comes from one generator seeded with it (the same noise
for all), and sample i's own generator (``seed + i``) draws only its SDE noise. The rule is the same in a
group and alone, so sample i of a group equals the request ``{seed: seed + i, n: 1, initial_noise_seed: S}``.

``share_prefix`` (with ``initial_noise_seed = seed`` when it is not given): the steps before the
first SDE step are deterministic and start from the same noise, so every sample would compute the same rows.
The task holds one row for them (one row of the batched forward, two with CFG), and repeats it to the
group's n rows when it reaches the first SDE step, where each sample branches with its own noise.
"""

from __future__ import annotations

import torch

from common.protocol.messages import GenerationParams
from common.diffusion.step_variants import step_variant


def shared_noise_seed(params: GenerationParams) -> int | None:
    """The seed every sample's initial noise is drawn from, or None (each sample's own generator)."""
    r = params.rollout
    if r is None:
        return None
    if r.initial_noise_seed is None and r.share_prefix:
        return params.seed
    return r.initial_noise_seed


def branch_step(params: GenerationParams, steps: int) -> int:
    """The step at which a ``share_prefix`` group's one row becomes n: its first SDE step (``steps`` when no
    step is stochastic); 0 for a request that does not share its prefix."""
    r = params.rollout
    if r is None or not r.share_prefix or not r.sde_scheduler or params.n == 1:
        return 0
    if step_variant(r.sde_type, r.noise_level).deterministic:
        return steps
    idx = r.sde_step_indices
    if idx is None:
        return 0
    return min(idx) if idx else steps


def noise_rows(noise: torch.Tensor, n: int, branch_at: int) -> torch.Tensor:
    """The task's first latents from the shared noise [1, ...]: one row while a shared prefix lasts, else n."""
    return noise if branch_at > 0 else per_sample(noise, n)


def per_sample(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` with one row per sample: a prefix's single row repeated n times (its n rows as they are)."""
    return x if x.shape[0] == n else x.expand(n, *x.shape[1:]).contiguous()
