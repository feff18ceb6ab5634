"""Sequence parallelism for the Wan transformer with diffusers' own context parallelism (Ulysses).

``enable_ulysses(model, degree)`` splits each forward's token sequence over
``degree`` ranks of the default torch.distributed group: diffusers'
``ContextParallelConfig(ulysses_degree=degree)`` and ``model.enable_parallelism``,
with the model's own ``_cp_plan`` (inputs split along the sequence, an
all-to-all around each attention, the output gathered on every rank). No
attention code of ours.

diffusers places rank ``r`` on device ``r % torch.accelerator.device_count()``,
which divides by zero on a machine without an accelerator. :func:`allow_cpu_ranks`
makes the count 1 there, so that ranks of a gloo group run on the CPU (the
device diffusers then names is the CPU: the accelerator type it reads is
``cpu``). On a machine with GPUs it changes nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def allow_cpu_ranks() -> None:
    """Let diffusers place context-parallel ranks on a CPU-only machine (see the module's docstring)."""
    if torch.accelerator.device_count() == 0:  # once patched it reports 1: calling again changes nothing
        torch.accelerator.device_count = lambda: 1


def enable_ulysses(model: torch.nn.Module, degree: int, mesh=None) -> None:
    """Split ``model``'s sequence over ``degree`` ranks (the default group's, or ``mesh``'s "ring" x "ulysses")."""
    from diffusers import ContextParallelConfig

    if not dist.is_initialized():
        raise RuntimeError("context parallelism needs torch.distributed initialised on every rank first")
    if degree < 2:
        raise ValueError(f"ulysses degree must be at least 2, got {degree}")
    heads = model.config.num_attention_heads
    if heads % degree:
        raise ValueError(f"ulysses degree {degree} must divide the model's {heads} attention heads")
    allow_cpu_ranks()
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree, mesh=mesh))


def settled(t: torch.Tensor) -> torch.Tensor:
    """``t`` once its collective finished. diffusers gathers the output with functional collectives, so it is
    an ``AsyncCollectiveTensor`` until used; a rank that discards it must still wait, or tearing the group
    down aborts the process."""
    wait = getattr(t, "wait", None)
    return wait() if callable(wait) else t
