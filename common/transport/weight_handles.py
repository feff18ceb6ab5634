"""Weight-update buckets on the trainer's GPU, handed to the denoise workers of its host as CUDA IPC handles.

The GPU counterpart of :mod:`common.transport.weight_segments`: when the
trainer's tensors are on a GPU and the engine's denoise workers are GPU workers
of the same host, the client packs the update into device buffers (one per
bucket) and posts a CUDA IPC handle to each. Every worker opens the handles,
checks and copies from them straight into its parameters (device to device, no
host memory on either side) and gives them back before it answers
(:meth:`common.transport.cuda_ipc.CudaIpcReceiver.borrowed`). The trainer keeps
the buffers for its next update of the same layout.
"""

from __future__ import annotations

import torch

from common.protocol.control import WeightBucket
from common.transport.cuda_ipc import export_handle


class DeviceBuckets:
    def __init__(self, sizes: list[int], device: torch.device):
        self.sizes = list(sizes)
        self.device = torch.device(device)
        self.buffers = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]

    def buckets(self) -> list[WeightBucket]:
        """Handles to every packed bucket. Waits for the packing first, so no worker needs the trainer's
        stream (a handle's event then has nothing left to wait for)."""
        torch.cuda.synchronize(self.device)
        return [WeightBucket(nbytes=b.numel(), cuda=export_handle(b) if b.numel() else None)
                for b in self.buffers]

    def close(self) -> None:
        self.buffers = []
        torch.cuda.ipc_collect()  # blocks whose handles every worker gave back go back to the allocator
