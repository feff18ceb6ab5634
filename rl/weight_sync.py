"""The trainer's half of a weights group: broadcast new weights into every denoise worker, across hosts.

    with WeightsGroup(client, master_address="10.0.0.5", master_port=29600) as group:   # gloo, or "nccl"
        for step in training:
            ...
            group.push(policy.transformer)             # every worker applies it whole, or none does

The trainer is rank 0 and hosts the group's store on ``master_address:master_port``
(reachable from the denoise workers' hosts); each denoise worker is one more rank.
On one host, ``client.update_weights_from_tensors`` (shared memory) needs no group.
"""

from __future__ import annotations

from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

import torch

from common.transport import weights_group
from common.diffusion import weight_buckets

REFUSAL_WAIT_S = 0.02


class WeightsGroup:
    def __init__(self, client, master_address: str, master_port: int, backend: str = "gloo",
                 timeout_s: float = 600.0, bucket_bytes: int = 256 << 20, device: str | torch.device = "cpu"):
        """``device``: where the broadcast buckets live (a GPU for NCCL, the CPU for gloo)."""
        self.client, self.address, self.port = client, master_address, master_port
        self.backend, self.timeout_s, self.bucket_bytes = backend, timeout_s, bucket_bytes
        self.device = torch.device(device)
        self.pg = None
        self._store = None
        self._buffers: list[torch.Tensor] | None = None
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="weights-group")

    def open(self) -> dict:
        """Create rank 0 and have every denoise worker join; returns the engine's answer (world size, ranks)."""
        world = 1 + self.client.weight_sync_info()["denoise_workers"]
        self._store = weights_group.store(self.address, self.port, world, True, self.timeout_s)
        forming = self._pool.submit(weights_group.new_group, self._store, 0, world, self.backend, self.timeout_s)
        joined = self._pool.submit(self.client.init_weights_group, self.address, self.port, self.backend,
                                   self.timeout_s)
        wait([forming, joined], return_when=FIRST_EXCEPTION)
        if joined.done() and joined.exception() is not None:
            raise joined.exception()  # refused (e.g. 403): say so now, not after the group's timeout
        self.pg = forming.result()
        return joined.result()

    def push(self, named_tensors, module: str = "transformer", checksum: bool = True,
             lora: dict | None = None) -> dict:
        """Broadcast ``named_tensors`` (a module, a mapping or (name, tensor) pairs) as ``module``'s new weights;
        returns the engine's answer: the new ``weight_version`` and the workers' ``sha256``. With
        ``lora={"lora_name", "rank", "alpha"}`` they are an adapter of ``module`` instead (peft names)."""
        if self.pg is None:
            raise RuntimeError("the weights group is not open")
        named = weight_buckets.named_tensors(named_tensors)
        entries, sizes = weight_buckets.plan(named, self.bucket_bytes)
        tensors = dict(named)
        answer: Future = self._pool.submit(self.client.update_weights_from_distributed, module, entries, sizes,
                                           checksum, lora)
        wait([answer], timeout=REFUSAL_WAIT_S)  # a refusal by the router comes at once, before any worker waits
        staging = self._staging(max(sizes))
        works: list = [None, None]
        try:
            for k, size in enumerate(sizes):
                if answer.done() and answer.exception() is not None:
                    break  # refused: no worker receives, so broadcasting would only wait for the timeout
                if not size:
                    continue
                if works[k % 2] is not None:
                    works[k % 2].wait()  # that buffer's previous bucket has gone out
                bucket = staging[k % 2][:size]
                weight_buckets.pack_into({k: bucket}, [e for e in entries if e.bucket == k], tensors)
                works[k % 2] = self.pg.broadcast([bucket], weights_group.broadcast_options(0))  # packs k+1 meanwhile
        finally:
            for w in works:
                if w is not None:
                    w.wait()
        return answer.result()

    def _staging(self, nbytes: int) -> list[torch.Tensor]:
        """Two bucket buffers, kept across pushes: one is packed while the other is broadcast."""
        if self._buffers is None or self._buffers[0].numel() < nbytes:
            self._buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return self._buffers

    def close(self) -> None:
        try:
            if self.pg is not None:
                self.client.destroy_weights_group()
        finally:
            self.pg, self._store, self._buffers = None, None, None
            self._pool.shutdown(wait=False)

    def __enter__(self) -> "WeightsGroup":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
