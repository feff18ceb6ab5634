"""A multi-device denoise worker's leader hands each call to its followers over their torch.distributed group.

Rank 0 (the leader, which alone has a ZeroMQ socket) broadcasts a call: its
header (a msgspec struct, msgpack bytes in a uint8 tensor, its length first)
and then each tensor it lists, in order; every follower receives them in the
same order into fresh buffers on its own device. No pickle: the header is
msgpack of plain fields, the tensors are raw buffers of the dtypes the wire
allows. A follower runs its share of the call and waits for the next one; a
``stop`` call ends its loop.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch
import torch.distributed as dist

from common.protocol.codec import DTYPE_NAMES, DTYPES


class TensorMeta(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    shape: list[int]


class Call(msgspec.Struct, frozen=True):
    """What the followers are to do: ``op`` (``forward``, ``stop``, ...), its tensors, its plain fields."""

    op: str
    tensors: list[TensorMeta] = []
    fields: dict[str, Any] = {}  # plain msgpack values only: no objects


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Call)


def send_call(call_op: str, tensors: dict[str, torch.Tensor] | None = None, group=None,
              device: torch.device | str | None = None, **fields) -> None:
    """On the leader: broadcast one call and its tensors to every follower of ``group``. ``device``: where the
    header goes (the group's device: NCCL takes GPU tensors only); by default the first tensor's, else the CPU."""
    tensors = tensors or {}
    metas = []
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} cannot travel")
        metas.append(TensorMeta(name=name, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape)))
    header = _ENCODER.encode(Call(op=call_op, tensors=metas, fields=fields))
    if device is None:
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    dist.broadcast(torch.tensor([len(header)], dtype=torch.int64, device=device), src=0, group=group)
    dist.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device), src=0, group=group)
    for t in tensors.values():
        dist.broadcast(t.contiguous(), src=0, group=group)


def receive_call(device: torch.device | str = "cpu", group=None) -> tuple[Call, dict[str, torch.Tensor]]:
    """On a follower: the next call from the leader and its tensors, on ``device``."""
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=0, group=group)
    raw = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(raw, src=0, group=group)
    call = _DECODER.decode(raw.cpu().numpy().tobytes())
    out = {}
    for meta in call.tensors:
        dtype = DTYPES.get(meta.dtype)
        if dtype is None:
            raise ValueError(f"{meta.name}: unknown dtype {meta.dtype!r}")
        buf = torch.empty(meta.shape, dtype=dtype, device=device)
        dist.broadcast(buf, src=0, group=group)
        out[meta.name] = buf
    return call, out
