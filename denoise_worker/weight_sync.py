"""Weight updates from the trainer's memory, for one denoise worker.

Two transports, one layout (:mod:`common.diffusion.weight_buckets`):

- on the engine's host, the trainer's buckets in shared-memory segments
  (:mod:`common.transport.weight_segments`), mapped and copied from;
- across hosts, a torch.distributed group with the trainer (rank 0, which hosts
  the store): a standalone gloo (CPU) or NCCL (GPU) group that is not the
  process's default group, so it never meets any other use of torch.distributed.
  The trainer broadcasts the buckets; the worker receives them into staging
  buffers.

Either way, the update is applied whole or not at all: every bucket is
received (or mapped) first, then :func:`~common.diffusion.weights.load_into` checks
names, shapes, dtypes and values against the module before copying anything.
A broadcast that breaks off (the trainer died) or times out applies nothing and
drops the group, which the trainer then sets up again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.config.engine import EngineConfig
from common.protocol.codec import DTYPES, WireError
from common.protocol.errors import RequestError, TransferFailed
from common.protocol.control import FromMemory, InitWeightsGroup, UpdateWeightsFromGroup
from common.transport import weights_group
from common.transport.cuda_ipc import CudaIpcReceiver
from common.transport.shm import engine_prefix
from common.transport.weight_segments import MappedBuckets, weight_prefix
from common.diffusion.weight_buckets import LayoutError, unpack
from common.diffusion.weights import WeightsError, load_into

PRUNE_INTERVAL_S = 1.0


@dataclass
class _Group:
    store: dist.TCPStore  # kept alive with the group
    pg: object
    backend: str


class WeightSync:
    def __init__(self, config: EngineConfig, device: torch.device, cuda_ipc: CudaIpcReceiver | None = None):
        self.cuda_ipc = cuda_ipc
        self.segments = MappedBuckets(weight_prefix(engine_prefix(config.runtime_dir)))
        self.device = device
        self.group: _Group | None = None
        # CPU staging of the last broadcast update, one for weights and one for adapters (small, frequent)
        self._kept: dict[bool, list[torch.Tensor]] = {}
        self._pruned_at = 0.0

    def idle(self) -> None:
        """Let go of kept segments the trainer removed (it closed its client, or died and was swept)."""
        now = time.monotonic()
        if now - self._pruned_at >= PRUNE_INTERVAL_S:
            self._pruned_at = now
            self.segments.prune()

    def release(self) -> None:
        """Unmap the trainer's buckets and drop the broadcast staging (a colocated trainer needs the pages)."""
        self.segments.close()
        self._kept = {}

    def load(self, module: torch.nn.Module, msg: FromMemory) -> None:
        """``module``'s new weights, from the trainer's memory: every bucket first, then all of it or nothing."""
        with self._buffers(msg) as buffers:
            try:
                load_into(module, unpack(buffers, msg.weight_tensors))
            except (LayoutError, WeightsError) as e:
                raise RequestError(str(e)) from None

    def tensors(self, msg: FromMemory) -> dict[str, torch.Tensor]:
        """The update's tensors as copies of their own on this worker's device (an adapter's: it outlives
        the buckets)."""
        with self._buffers(msg) as buffers:
            try:
                return {name: t.to(self.device, copy=True)
                        for name, t in unpack(buffers, msg.weight_tensors).items()}
            except LayoutError as e:
                raise RequestError(str(e)) from None

    @contextlib.contextmanager
    def _buffers(self, msg: FromMemory) -> Iterator[list[torch.Tensor]]:
        """Every bucket of the update, for the length of the block."""
        if isinstance(msg, UpdateWeightsFromGroup):
            yield self._broadcast(msg)
        elif any(b.cuda is not None for b in msg.weight_buckets):
            with self._borrowed(msg) as views:
                yield views
        else:
            yield self._mapped(msg)

    # --- one host, the trainer's tensors on a GPU: CUDA IPC ------------------------------
    @contextlib.contextmanager
    def _borrowed(self, msg: FromMemory) -> Iterator[list[torch.Tensor]]:
        if self.cuda_ipc is None:
            raise RequestError("buckets: CUDA IPC handles need denoise workers on GPUs of the trainer's host "
                               "(and CUDA IPC on); send host buckets or use a weights group")
        buckets = msg.weight_buckets
        if any(b.cuda is None and b.nbytes for b in buckets) or any(b.segment is not None for b in buckets):
            raise RequestError("buckets: all of an update's buckets are CUDA IPC handles, or none")
        full = [b for b in buckets if b.nbytes]
        try:
            with self.cuda_ipc.borrowed([b.cuda for b in full], [b.nbytes for b in full]) as views:
                opened = iter(views)
                yield [next(opened) if b.nbytes else torch.empty(0, dtype=torch.uint8) for b in buckets]
        except WireError as e:  # a handle that cannot be opened
            raise RequestError(str(e)) from None

    # --- one host: shared memory -----------------------------------------------------
    def _mapped(self, msg: FromMemory) -> list[torch.Tensor]:
        try:
            return self.segments.open(msg.weight_buckets)
        except WireError as e:
            raise RequestError(str(e)) from None

    # --- across hosts: a torch.distributed group ---------------------------------------
    def init_group(self, msg: InitWeightsGroup) -> None:
        if msg.backend == "nccl" and self.device.type != "cuda":
            raise RequestError("backend: nccl needs denoise workers on GPUs; use gloo")
        self.destroy_group()
        try:
            tcp = weights_group.store(msg.master_address, msg.master_port, msg.world_size, False, msg.group_timeout_s)
            pg = weights_group.new_group(tcp, msg.rank, msg.world_size, msg.backend, msg.group_timeout_s)
        except Exception as e:  # the trainer never came, or went
            raise TransferFailed(f"could not join the trainer's {msg.backend} group at "
                                 f"{msg.master_address}:{msg.master_port}: {e}") from None
        self.group = _Group(tcp, pg, msg.backend)

    def _staging(self, sizes: list[int], backend: str, adapter: bool) -> list[torch.Tensor]:
        """Buffers for every bucket of an update. On the CPU (gloo) they are kept for the next update of the
        same layout (fresh pages cost a fault each); on a GPU (NCCL) they are freed after each update."""
        if backend == "nccl":
            return [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        if [b.numel() for b in self._kept.get(adapter, [])] != sizes:
            self._kept.pop(adapter, None)  # the old ones go first
            self._kept[adapter] = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        return self._kept[adapter]

    def destroy_group(self) -> bool:
        """Leave the trainer's group; whether there was one."""
        had = self.group is not None
        self.group = None  # the group and its store close when they are collected
        self._kept = {}
        return had

    def _broadcast(self, msg: FromMemory) -> list[torch.Tensor]:
        group = self.group
        if group is None:
            raise RequestError("no weights group: call init_weights_group first")
        buffers = self._staging([b.nbytes for b in msg.weight_buckets], group.backend, msg.lora_name is not None)
        try:
            for buf in _received_as(buffers, msg):  # every bucket, even if the update turns out wrong
                if buf.numel():
                    group.pg.broadcast([buf], weights_group.broadcast_options(0)).wait()
        except Exception as e:
            self.group = None  # a collective that broke off leaves the group unusable
            raise TransferFailed(f"the trainer's broadcast broke off; nothing applied, the group is gone "
                                 f"(init_weights_group again): {e}") from None
        return buffers


def _received_as(buffers: list[torch.Tensor], msg: FromMemory) -> list[torch.Tensor]:
    """The views the broadcasts fill: raw bytes, or with ``typed_broadcast`` each bucket's one tensor in its dtype
    (a collective's ranks agree on the element type; the bytes land in the same staging either way)."""
    if not msg.typed_broadcast:
        return buffers
    views = []
    for buf, t in zip(buffers, msg.weight_tensors):
        if t.bucket != len(views) or t.offset:
            raise RequestError("typed_broadcast: each bucket holds one tensor at offset 0, in order")
        views.append(buf.view(DTYPES[t.dtype]) if buf.numel() else buf)
    return views
