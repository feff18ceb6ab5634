"""LoRA adapters across every denoise worker: load (from a path or the trainer's tensors), unload, list.

The router keeps the table of loaded adapters (what every worker answered), so
that a request naming an adapter that is not loaded is refused before any work,
and assigns each name's versions. It also keeps what each was loaded from (the
path, or the trainer's tensors it was posted with), so that a denoise worker
that restarted gets them all again before any request is routed to it; an
adapter the trainer put into shared memory or broadcast over its weights group
never passed through here, so a restarted worker lacks it until the trainer
pushes it again. No sockets here.
"""

from __future__ import annotations

import time

import torch

from common.protocol.http_tensors import body_to_tensor
from common.protocol.control import ControlRequest, FromMemory, LoadLora, LoraTensor, UnloadLora
from common.protocol.messages import LORA_BLOB
from router.request.schemas import LoadLoraBody, LoadLoraTensorsBody
from router.control.fanout import FROM_MEMORY, ControlCall
from router.control.versioned import Replay, VersionedFanout
from router.core.errors import FieldError


def missing_adapter(name: str) -> str:
    """How a worker's list of what it lacks names an adapter (beside expert names)."""
    return f"lora:{name}"


class LoraControl:
    role = "denoise"

    def __init__(self, control: ControlCall):
        self.table: dict[str, dict] = {}  # name -> what the workers reported for it
        # by name: what it was loaded with (a path, or the tensors posted); FROM_MEMORY: not replayable
        self.versioned = VersionedFanout(control, lacking=missing_adapter)

    def check_name(self, name: str | None) -> None:
        if name is not None and name not in self.table:
            raise FieldError("lora_name", f"no adapter {name!r} is loaded (GET /v1/lora_adapters lists them)")

    def adapters(self) -> dict:
        return {"adapters": [self.table[n] for n in sorted(self.table)]}

    async def load_path(self, body: LoadLoraBody) -> dict:
        return await self._load(body.lora_name, None, path=body.lora_path,
                                load_into_transformer_2=body.load_into_transformer_2)

    async def load_tensors(self, body: LoadLoraTensorsBody) -> dict:
        try:
            blob = body_to_tensor(body.blob.model_dump()).reshape(-1)
        except (KeyError, TypeError, ValueError) as e:
            raise FieldError("blob", f"not a tensor body {{dtype, shape, data}}: {e}") from None
        if not blob.is_floating_point():
            raise FieldError("blob", f"must be floating point, got {blob.dtype}")
        specs = [LoraTensor(name=t.name, shape=t.shape) for t in body.tensors]
        return await self._load(body.lora_name, {LORA_BLOB.name: blob}, lora_tensors=specs, lora_rank=body.rank,
                                lora_alpha=body.alpha, module=body.module)

    async def load_from_memory(self, kind: type[FromMemory], name: str, **fields) -> dict:
        """An adapter in the trainer's shared-memory buckets or broadcast over its group (``kind``, as for
        weights)."""
        return await self._load(name, None, kind=kind, source=FROM_MEMORY, **fields)

    async def _load(self, name: str, tensors: dict[str, torch.Tensor] | None,
                    kind: type[ControlRequest] = LoadLora, source: str | None = None, **fields) -> dict:
        held = self.versioned
        async with held.lock:
            version = self.table.get(name, {}).get("lora_version", 0) + 1
            t0 = time.perf_counter()
            replay = source or Replay(LoadLora, {"lora_name": name, **fields}, tensors)
            replies = await held.change(name, replay, kind, tensors=tensors, lora_name=name, version=version,
                                        **fields)
            self.table[name] = replies[0].body()
        return {**self.table[name], "seconds": time.perf_counter() - t0,
                "workers": [{"index": r.index, "sha256": r.sha256} for r in replies]}

    async def unload(self, name: str) -> dict:
        async with self.versioned.lock:
            self.check_name(name)
            await self.versioned.send(UnloadLora, lora_name=name)
            del self.table[name]
            self.versioned.forget(name)
        return {"lora_name": name, "unloaded": True}

    async def replay(self, worker) -> set[str]:
        """Load every listed adapter, at its listed version, into a worker that restarted without them.
        Returns what it lacks: the adapters from the trainer's memory (``missing_adapter`` names)."""
        return await self.versioned.replay(worker, lambda name: self.table[name]["lora_version"])
