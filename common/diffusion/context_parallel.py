"""Sequence parallelism with diffusers' own context parallelism (Ulysses, ring), for models with a ``_cp_plan``.

``enable_context_parallel(model, ulysses, ring)`` splits each forward's token
sequence over ``ulysses * ring`` ranks of the default torch.distributed group
(or of a mesh's "ring" x "ulysses"): diffusers'
``ContextParallelConfig(ulysses_degree=..., ring_degree=...)`` and
``model.enable_parallelism``, with the model's own ``_cp_plan`` (inputs split
along the sequence, an all-to-all around each self-attention for Ulysses, key
and value chunks passed round for ring attention, the output gathered on every
rank). No attention code of ours. Ring attention merges partial attentions by
their log-sum-exp, which only some backends return: it runs on cuDNN attention
(``_native_cudnn``: GPUs, bfloat16 or float16).

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


RING_BACKEND = "_native_cudnn"  # diffusers' name: torch's cuDNN attention, which returns the log-sum-exp


def enable_context_parallel(model: torch.nn.Module, ulysses: int = 1, ring: int = 1, mesh=None) -> None:
    """Split ``model``'s sequence over ``ulysses * ring`` ranks (the default group's, or ``mesh``'s "ring" x
    "ulysses")."""
    from diffusers import ContextParallelConfig

    if not dist.is_initialized():
        raise RuntimeError("context parallelism needs torch.distributed initialised on every rank first")
    if ulysses < 1 or ring < 1 or ulysses * ring < 2:
        raise ValueError(f"ulysses {ulysses} x ring {ring}: context parallelism needs at least 2 ranks")
    heads = model.config.num_attention_heads
    if heads % ulysses:
        raise ValueError(f"ulysses degree {ulysses} must divide the model's {heads} attention heads")
    if ring > 1:
        if model.device.type != "cuda":
            raise ValueError("ring attention needs GPUs: it runs on cuDNN attention, which returns the log-sum-exp")
        model.set_attention_backend(RING_BACKEND)
    allow_cpu_ranks()
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring, mesh=mesh))


def settled(t: torch.Tensor) -> torch.Tensor:
    """``t`` once its collective finished. diffusers gathers the output with functional collectives, so it is
    an ``AsyncCollectiveTensor`` until used; a rank that discards it must still wait, or tearing the group
    down aborts the process."""
    wait = getattr(t, "wait", None)
    return wait() if callable(wait) else t
