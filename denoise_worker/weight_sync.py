"""Weight updates from the trainer's memory, for one denoise worker.

Two transports, one layout (:mod:`common.wan.weight_buckets`):

- on the engine's host, the trainer's buckets in shared-memory segments
  (:mod:`common.transport.weight_segments`), mapped and copied from;
- across hosts, a torch.distributed group with the trainer (rank 0, which hosts
  the store): a standalone gloo (CPU) or NCCL (GPU) group that is not the
  process's default group, so it never meets any other use of torch.distributed.
  The trainer broadcasts the buckets; the worker receives them into staging
  buffers.

Either way, the update is applied whole or not at all: every bucket is
received (or mapped) first, then :func:`~common.wan.weights.load_into` checks
names, shapes, dtypes and values against the module before copying anything.
A broadcast that breaks off (the trainer died) or times out applies nothing and
drops the group, which the trainer then sets up again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.config.engine import EngineConfig
from common.protocol.codec import WireError
from common.protocol.errors import RequestError, TransferFailed
from common.protocol.messages import ControlRequest
from common.transport import weights_group
from common.transport.shm import engine_prefix
from common.transport.weight_segments import close_maps, open_buckets, weight_prefix
from common.wan.weight_buckets import LayoutError, unpack
from common.wan.weights import WeightsError, load_into


@dataclass
class _Group:
    store: dist.TCPStore  # kept alive with the group
    pg: object
    backend: str


class WeightSync:
    def __init__(self, config: EngineConfig, device: torch.device):
        self.prefix = weight_prefix(engine_prefix(config.runtime_dir))
        self.device = device
        self.group: _Group | None = None
        self._kept: list[torch.Tensor] = []  # CPU staging of the last broadcast update

    # --- one host: shared memory -----------------------------------------------------
    def load_from_segments(self, module: torch.nn.Module, msg: ControlRequest) -> None:
        try:
            views, maps = open_buckets(self.prefix, msg.weight_buckets)
        except WireError as e:
            raise RequestError(str(e)) from None
        try:
            _load(module, views, msg)
        finally:
            del views
            close_maps(maps)

    # --- across hosts: a torch.distributed group ---------------------------------------
    def init_group(self, msg: ControlRequest) -> dict:
        if msg.master_address is None or msg.master_port is None or msg.world_size is None or msg.rank is None:
            raise RequestError("master_address, master_port, world_size and rank: required")
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
        return {"rank": msg.rank, "world_size": msg.world_size, "backend": msg.backend}

    def _staging(self, sizes: list[int], backend: str) -> list[torch.Tensor]:
        """Buffers for every bucket of an update. On the CPU (gloo) they are kept for the next update of the
        same layout (fresh pages cost a fault each); on a GPU (NCCL) they are freed after each update."""
        if backend == "nccl":
            return [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        if [b.numel() for b in self._kept] != sizes:
            self._kept = []  # the old ones go first
            self._kept = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        return self._kept

    def destroy_group(self) -> dict:
        had = self.group is not None
        self.group = None  # the group and its store close when they are collected
        self._kept = []
        return {"group": "destroyed" if had else "none"}

    def load_from_group(self, module: torch.nn.Module, msg: ControlRequest) -> None:
        group = self.group
        if group is None:
            raise RequestError("no weights group: call init_weights_group first")
        buffers = self._staging([b.nbytes for b in msg.weight_buckets], group.backend)
        try:
            for buf in buffers:  # every bucket, even if the update turns out wrong: the trainer sends them all
                if buf.numel():
                    group.pg.broadcast([buf], weights_group.broadcast_options(0)).wait()
        except Exception as e:
            self.group = None  # a collective that broke off leaves the group unusable
            raise TransferFailed(f"the trainer's broadcast broke off; nothing applied, the group is gone "
                                 f"(init_weights_group again): {e}") from None
        _load(module, buffers, msg)


def _load(module: torch.nn.Module, buffers: list[torch.Tensor], msg: ControlRequest) -> None:
    try:
        load_into(module, unpack(buffers, msg.weight_tensors))
    except (LayoutError, WeightsError) as e:
        raise RequestError(str(e)) from None
