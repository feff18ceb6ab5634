"""Same-node GPU data plane: a CUDA tensor goes from one GPU worker to the next without leaving the GPUs.

Host staging costs two PCIe crossings per hop (device to host in the sender,
host to device in the receiver). When both ends of a link are GPU workers of
one engine on one host (the ``ipc`` transport) and ``EngineConfig.cuda_ipc`` is
on (``launch.py --no-cuda-ipc`` turns it off), a CUDA tensor instead travels as
a CUDA IPC handle in its descriptor (``TensorSpec.cuda``):

* the sender copies the tensor into a private allocation (so nothing it does
  later can change what the receiver reads, and the shared block holds this
  tensor only), exports it with torch's own CUDA IPC sharing, and drops it;
  torch keeps the block alive (its "limbo") while the receiver's reference
  counter is held. The descriptor is bytes and integers in the msgpack header:
  no pickle;
* the receiver opens the handle (torch waits on the sender's CUDA event, so it
  never reads before the sender's copy finished), copies the tensor into its
  own memory on its own device, and releases the handle as soon as that copy
  has run on the GPU (checked with an event, without blocking the host), which
  lets the sender's block go back to its allocator.

What it does not cover: a message that never reaches a live receiver (the
receiver died with it queued) leaves its block in the sender's limbo until the
sender process exits, since only the receiver can release the counter; that
is one tensor per lost message, never a growing leak on a healthy engine. A
receiver without CUDA, or a CUDA tensor to the router or over tcp, never uses
this path: such tensors are staged through host memory as before.
"""

from __future__ import annotations

import collections
import logging

import msgspec
import torch

from common.config import EngineConfig, WorkerSpec
from common.messages import CudaIpcHandle
from common.wire import WireError

log = logging.getLogger("disagg.cuda_ipc")

# Opened handles whose copy may still be running; past this many, the oldest is waited for.
MAX_HELD = 64


def link_uses_cuda_ipc(config: EngineConfig, sender: WorkerSpec, dest: WorkerSpec | None) -> bool:
    """Whether CUDA tensors from ``sender`` to ``dest`` (None: the router) travel as CUDA IPC handles."""
    return (
        config.cuda_ipc
        and config.transport == "ipc"  # one host: the only case where a CUDA IPC handle means anything
        and dest is not None
        and sender.device.startswith("cuda")
        and dest.device.startswith("cuda")
    )


def _release(h: CudaIpcHandle) -> None:
    """Give back the reference counter ``h`` carries, so that the sender may free its block."""
    try:
        torch.UntypedStorage._release_ipc_counter(h.ref_counter.encode("ascii"), h.ref_counter_offset,
                                                  device=h.device)
    except Exception as e:  # a counter file already gone (sender exited): nothing left to free
        log.debug("could not release a CUDA IPC counter: %s", e)


class CudaIpcSender:
    """Exports CUDA tensors for one destination worker."""

    def __init__(self, dest: str):
        self.dest = dest
        self.enabled = True
        self.sent = 0

    def put(self, t: torch.Tensor) -> CudaIpcHandle | None:
        """A handle to a private device copy of ``t``, or None: stage ``t`` through host memory."""
        if not self.enabled or not t.is_cuda or t.numel() == 0:
            return None
        private = t.detach().clone(memory_format=torch.contiguous_format)
        (device, handle, storage_bytes, offset_bytes, ref_counter, ref_counter_offset,
         event, event_sync) = private.untyped_storage()._share_cuda_()
        raw = dict(device=device, handle=handle, storage_bytes=storage_bytes, offset_bytes=offset_bytes,
                   ref_counter=ref_counter.decode("ascii", "replace") if isinstance(ref_counter, bytes)
                   else ref_counter, ref_counter_offset=ref_counter_offset, event=event, event_sync=event_sync)
        try:
            # The receiver accepts only descriptors of this shape: check ours the same way, so that a
            # torch whose export looks different falls back to host staging instead of failing requests.
            desc = msgspec.convert(raw, CudaIpcHandle)
        except msgspec.ValidationError as e:
            self.enabled = False
            log.warning("CUDA IPC export not understood (%s); tensors to %s go through host memory", e, self.dest)
            torch.UntypedStorage._release_ipc_counter(ref_counter, ref_counter_offset, device=device)
            return None
        del private  # the block now lives in torch's limbo until the receiver releases its counter
        torch.cuda.ipc_collect()  # frees blocks of earlier sends whose receivers are done
        self.sent += 1
        return desc

    def discard(self, h: CudaIpcHandle) -> None:
        """A handle whose message was never sent: nobody else will release it."""
        _release(h)


class CudaIpcReceiver:
    """Opens CUDA IPC handles addressed to this worker and copies the tensors onto ``device``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.received = 0
        self._held: collections.deque[tuple[torch.cuda.Event, torch.UntypedStorage]] = collections.deque()

    def open(self, h: CudaIpcHandle, dtype: torch.dtype, shape: list[int], nbytes: int,
             request_id: str | None = None) -> torch.Tensor:
        """The tensor, in this worker's own memory. Raises :class:`WireError` for a handle it cannot use."""
        if h.storage_bytes != nbytes:
            _release(h)
            raise WireError(f"CUDA IPC block of {h.storage_bytes} bytes, the descriptor needs {nbytes}", request_id)
        if h.device >= torch.cuda.device_count():
            _release(h)
            raise WireError(f"CUDA IPC handle on device {h.device}, which this process does not see", request_id)
        torch.cuda.init()  # no-op once this process has used CUDA; opening a handle needs a context
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                h.device, h.handle, h.storage_bytes, h.offset_bytes, h.ref_counter.encode("ascii"),
                h.ref_counter_offset, h.event, h.event_sync)
        except Exception as e:  # e.g. the sender exited and its memory is gone
            raise WireError(f"CUDA IPC handle cannot be opened: {e}", request_id) from None
        view = torch.empty(0, dtype=dtype, device=torch.device("cuda", h.device)).set_(storage, 0, shape)
        own = torch.empty(shape, dtype=dtype, device=self.device)
        own.copy_(view)
        if own.device != view.device:  # a peer copy: rare, so simply wait for it
            torch.cuda.synchronize(view.device)
            del view, storage
        else:
            # The counter may go back only after the copy ran; an event says when, without blocking here.
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self._held.append((done, storage))
            del view
        self.reap()
        self.received += 1
        return own

    def reap(self) -> None:
        """Release the handles whose copies have finished (and the oldest, waited for, past MAX_HELD)."""
        while self._held and (self._held[0][0].query() or len(self._held) > MAX_HELD):
            done, _ = self._held.popleft()
            done.synchronize()

    def discard(self, h: CudaIpcHandle) -> None:
        """A handle of a message rejected before it was opened: release it so the sender can free the block."""
        _release(h)


class CudaIpcContext:
    """One worker's side of the GPU data plane: a receiver if it is a GPU worker, a sender per GPU peer."""

    def __init__(self, config: EngineConfig, me: WorkerSpec | None):
        self.config, self.me = config, me
        enabled = (me is not None and config.cuda_ipc and config.transport == "ipc"
                   and me.device.startswith("cuda") and torch.cuda.is_available())
        self.receiver = CudaIpcReceiver(torch.device(me.device)) if enabled else None
        self._senders: dict[tuple[str, int], CudaIpcSender | None] = {}

    def sender(self, role: str, index: int | None) -> CudaIpcSender | None:
        if self.receiver is None or index is None:  # a CPU worker, or the router as destination
            return None
        key = (role, index)
        if key not in self._senders:
            dest = self.config.worker(role, index)
            self._senders[key] = (CudaIpcSender(f"{role}-{index}")
                                  if link_uses_cuda_ipc(self.config, self.me, dest) else None)
        return self._senders[key]

    @property
    def sent(self) -> int:
        return sum(s.sent for s in self._senders.values() if s is not None)

    @property
    def received(self) -> int:
        return 0 if self.receiver is None else self.receiver.received
