"""How a set of named tensors is laid out in flat byte buckets, for weight sync from memory.

One layout, used by both ends: the trainer packs its tensors into buckets of at
most ``bucket_bytes`` (a larger tensor gets a bucket of its own) and describes
them with :class:`~common.protocol.control.WeightTensor` entries; a denoise
worker turns the buckets it received (shared-memory segments, or broadcast
buffers) back into named tensors with :func:`unpack`, views without a copy,
which it validates against its module before loading anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from common.protocol.codec import DTYPE_NAMES, DTYPES
from common.protocol.control import WeightTensor

ALIGN = 64  # every tensor starts on a 64-byte boundary: any dtype can view it, copies stay aligned


class LayoutError(ValueError):
    """The buckets and their description do not fit together: entry ``index``'s ``key`` is wrong."""

    def __init__(self, message: str, index: int = 0, key: str = "name"):
        super().__init__(message)
        self.index, self.key = index, key


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def named_tensors(obj) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a module (its ``state_dict()``), a mapping, or pairs."""
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    items = obj.items() if hasattr(obj, "items") else obj
    return [(str(n), t) for n, t in items]


def plan(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> tuple[list[WeightTensor], list[int]]:
    """Where each tensor goes: its entries, and each bucket's size in bytes, in order."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be at least {ALIGN}")
    entries: list[WeightTensor] = []
    sizes: list[int] = []
    for name, t in named:
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} cannot travel")
        n = _nbytes(t)
        start = -(-sizes[-1] // ALIGN) * ALIGN if sizes else 0
        if not sizes or (start + n > bucket_bytes and sizes[-1] > 0):
            sizes.append(0)
            start = 0
        entries.append(WeightTensor(name=name, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape),
                                    bucket=len(sizes) - 1, offset=start))
        sizes[-1] = start + n
    return entries, sizes


def pack_into(buffers: list[torch.Tensor], entries: list[WeightTensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy every tensor into its place in the uint8 ``buffers`` (one per bucket)."""
    for e in entries:
        t = tensors[e.name].detach()
        n = _nbytes(t)
        if n:
            buffers[e.bucket][e.offset : e.offset + n].copy_(t.contiguous().view(-1).view(torch.uint8))


def check_layout(entries: list[WeightTensor], bucket_bytes: list[int]) -> None:
    """Every entry named once, of a wire dtype, inside its bucket at an aligned offset (the router checks this
    against the buckets' declared sizes before any worker opens one, the worker against what it opened)."""
    seen: set[str] = set()
    for i, e in enumerate(entries):
        if e.name in seen:
            raise LayoutError(f"{e.name}: named twice", i, "name")
        seen.add(e.name)
        if not 0 <= e.bucket < len(bucket_bytes):
            raise LayoutError(f"{e.name}: bucket {e.bucket} of {len(bucket_bytes)}", i, "bucket")
        dtype = DTYPES.get(e.dtype)
        if dtype is None:
            raise LayoutError(f"{e.name}: unknown dtype {e.dtype!r}", i, "dtype")
        n = _entry_bytes(e, dtype)
        if e.offset % ALIGN or e.offset + n > bucket_bytes[e.bucket]:
            raise LayoutError(f"{e.name}: {n} bytes at offset {e.offset} do not fit bucket {e.bucket} "
                              f"({bucket_bytes[e.bucket]} bytes, {ALIGN}-byte aligned offsets)", i, "offset")


def _entry_bytes(e: WeightTensor, dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in e.shape:
        n *= d
    return n


def unpack(buffers: list[torch.Tensor], entries: list[WeightTensor]) -> dict[str, torch.Tensor]:
    """Named views over the uint8 ``buffers``, after checking that every entry lies inside its bucket."""
    check_layout(entries, [b.numel() for b in buffers])
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        dtype = DTYPES[e.dtype]
        out[e.name] = buffers[e.bucket][e.offset : e.offset + _entry_bytes(e, dtype)].view(dtype).view(e.shape)
    return out
