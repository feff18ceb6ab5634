"""Weight sync from the trainer's memory: shared-memory buckets on one host, a torch.distributed group across.

The router checks the request and hands each denoise worker its part: the
bucket description (all of them), or its rank in the trainer's group. The
weights themselves never pass through the router. Off unless the engine runs
with ``--weight-sync-from-memory`` (403 here, before anything reaches a worker).
"""

from __future__ import annotations

import asyncio

import msgspec

from common.config.engine import EngineConfig
from common.protocol.control import (DestroyWeightsGroup, FromMemory, GroupReply, InitWeightsGroup,
                                     UpdateWeightsFromGroup, UpdateWeightsFromTensors, WeightBucket, WeightTensor)
from common.diffusion.weight_buckets import LayoutError, check_layout
from common.transport.cuda_ipc import takes_cuda_ipc
from common.transport.shm import engine_prefix
from common.transport.weight_segments import weight_prefix
from router.control.fanout import control_failure
from router.control.weights import WeightControl
from router.core.errors import EngineError, FieldError
from router.control.lora import LoraControl
from router.request.schemas import (InitWeightsGroupBody, UpdateWeightsFromDistributedBody,
                                    UpdateWeightsFromTensorsBody)

DISABLED = "weight sync from memory is off: start the engine with --weight-sync-from-memory"
GRACE_S = 30.0  # the router waits this much longer than a worker's own group timeout


class MemorySync:
    role = "denoise"

    def __init__(self, config: EngineConfig, control, weights: WeightControl, loras: LoraControl):
        self.config, self._control, self.weights, self.loras = config, control, weights, loras
        self.group_timeout_s: float | None = None  # set while a weights group exists

    def check_enabled(self) -> None:
        """The routes call this before reading a body, so that nothing is parsed when the feature is off."""
        if not self.config.weight_sync_from_memory:
            raise EngineError(403, "forbidden", DISABLED, "router", "")

    def info(self) -> dict:
        """What a trainer needs to write buckets and to size a group."""
        same_host = self.config.transport == "ipc"
        return {"enabled": self.config.weight_sync_from_memory,
                "shm_prefix": weight_prefix(engine_prefix(self.config.runtime_dir)) if same_host else None,
                "cuda_ipc": all(takes_cuda_ipc(self.config, w) for w in self.config.of_role(self.role)),
                "denoise_workers": len(self.config.of_role(self.role)),
                "weight_version": self.weights.version, "group": self.group_timeout_s is not None}

    async def _apply(self, kind: type[FromMemory], body: UpdateWeightsFromTensorsBody,
                     timeout_s: float | None = None, typed: bool = False) -> dict:
        """The weights of ``body.module``, or the adapter ``body.lora`` names, from the trainer's memory
        (``typed``: one broadcast per tensor, in its own dtype)."""
        layout = _layout(body)
        if typed:
            layout["typed_broadcast"] = True
        if body.lora is None:
            return await self.weights.update_from_memory(kind, body.module, timeout_s=timeout_s, **layout)
        return await self.loras.load_from_memory(kind, body.lora.lora_name, module=body.module, timeout_s=timeout_s,
                                                 lora_rank=body.lora.rank, lora_alpha=body.lora.alpha, **layout)

    async def from_tensors(self, body: UpdateWeightsFromTensorsBody) -> dict:
        return await self._apply(UpdateWeightsFromTensors, body)

    async def init_group(self, body: InitWeightsGroupBody) -> dict:
        workers = self.config.of_role(self.role)
        world = 1 + len(workers)
        replies = await asyncio.gather(*(
            self._control(self.role, InitWeightsGroup, only=w, timeout_s=body.timeout_s + GRACE_S,
                          master_address=body.master_address, master_port=body.master_port, world_size=world,
                          rank=1 + k, backend=body.backend, group_timeout_s=body.timeout_s)
            for k, w in enumerate(workers)))
        replies: list[GroupReply] = [r for rs in replies for r in rs]
        failure = control_failure(replies, self.role)
        if failure is not None:
            raise failure
        self.group_timeout_s = body.timeout_s
        return {"world_size": world, "backend": body.backend,
                "ranks": [{"index": r.index, "rank": r.rank} for r in replies]}

    async def from_distributed(self, body: UpdateWeightsFromDistributedBody, typed: bool = False) -> dict:
        """``typed``: the trainer broadcasts each tensor in its own dtype (SGLang's trainers), one bucket each."""
        if self.group_timeout_s is None:
            raise EngineError(400, "invalid_request", "no weights group: POST /init_weights_group first", "router", "")
        try:
            return await self._apply(UpdateWeightsFromGroup, body, self.group_timeout_s + GRACE_S, typed)
        except EngineError as e:
            if e.status == 504 or e.type == "inconsistent_workers":
                self.group_timeout_s = None  # a broken-off broadcast drops the group on the workers
            raise

    async def destroy_group(self) -> dict:
        failure = control_failure(await self._control(self.role, DestroyWeightsGroup), self.role)
        self.group_timeout_s = None
        if failure is not None:
            raise failure
        return {"destroyed": True}


def _layout(body: UpdateWeightsFromTensorsBody) -> dict:
    """The update's description, checked here (names, dtypes, each tensor inside its bucket) so that a bad one
    is a 400 naming the field before any worker opens a bucket."""
    tensors = []
    for i, t in enumerate(body.tensors):
        try:
            tensors.append(msgspec.convert(t.model_dump(), WeightTensor))
        except msgspec.ValidationError as e:
            raise FieldError(f"tensors.{i}", str(e)) from None
    try:
        check_layout(tensors, [b.nbytes for b in body.buckets])
    except LayoutError as e:
        raise FieldError(f"tensors.{e.index}.{e.key}", str(e)) from None
    return {"checksum": body.checksum, "weight_tensors": tensors, "weight_buckets": [_bucket(b) for b in body.buckets]}


def _bucket(b) -> WeightBucket:
    try:
        return msgspec.convert(b.model_dump(), WeightBucket)  # a handle's bytes arrive in base64
    except msgspec.ValidationError as e:
        raise FieldError("buckets", str(e)) from None
