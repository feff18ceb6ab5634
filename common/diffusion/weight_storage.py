"""Where a model's weights live in memory: every tensor in contiguous storage of its own, as torch allocates it.

The same bytes at another address can give other outputs: BLAS kernels choose their vector paths by the
alignment of their operands (MKL's CPU sgemm rounds a product whose operand sits 8 bytes past a 16-byte
boundary differently from an aligned one, ~1e-6 a matmul), and a model's output carries that into every step.
A load from safetensors leaves each tensor wherever the reader's buffer put it (4, 8 or 12 bytes past such a
boundary, as it happens), while a push copies into storage torch allocated (64-byte aligned) and a level-1
resume on a GPU copies into new storage too. So every load :func:`settle`-s its modules into the layout those
give, and a release then a resume or a push of the same bytes gives bit-identical outputs.
"""

from __future__ import annotations

import torch

ALIGN = 64  # torch's CPU allocator aligns to 64 bytes (c10's gAlignment); its CUDA allocator to 512


def weight_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state-dict tensors themselves (parameters and persistent buffers), each once: what a
    release drops and a push or a reload fills."""
    out, seen = {}, set()
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def settled(t: torch.Tensor) -> bool:
    """Whether ``t`` lies as a tensor torch allocated itself: contiguous, alone in its storage from its first
    byte to its last, at an aligned address."""
    if t.numel() == 0 or t.is_meta:
        return True
    storage = t.untyped_storage()
    return (t.is_contiguous() and t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size()
            and t.data_ptr() % ALIGN == 0)


def unsettled(module: torch.nn.Module) -> list[str]:
    """The names of the module's weights that do not lie so."""
    return [name for name, t in weight_tensors(module).items() if not settled(t)]


def settle(module: torch.nn.Module) -> torch.nn.Module:
    """Each weight that does not lie so copied into storage of its own (in place: the parameter objects stay,
    so hooks and compiled graphs that hold them still do); the module."""
    with torch.no_grad():
        for t in weight_tensors(module).values():
            if not settled(t):
                fresh = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                fresh.copy_(t.data)
                t.data = fresh
    return module
