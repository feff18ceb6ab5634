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
* the receiver opens the handle on a side stream (which waits on the sender's
  CUDA event, so it never reads before the sender's copy finished), copies the
  tensor into its own memory and releases the handle at once; releasing waits
  for that side stream only (the copy), never for the worker's own queued
  compute, and lets the sender's block go back to its allocator.

What it does not cover: a message that never reaches a live receiver (the
receiver died with it queued) leaves its block in the sender's limbo until the
sender process exits, since only the receiver can release the counter; that
is one tensor per lost message, never a growing leak on a healthy engine. A
receiver without CUDA, or a CUDA tensor to the router or over tcp, never uses
this path: such tensors are staged through host memory as before.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import msgspec
import torch

from common.config.engine import EngineConfig, WorkerSpec
from common.protocol.messages import CudaIpcHandle
from common.protocol.codec import WireError

log = logging.getLogger("disagg.cuda_ipc")

def takes_cuda_ipc(config: EngineConfig, worker: WorkerSpec) -> bool:
    """Whether ``worker`` is a GPU worker of an engine whose same-host links may carry CUDA IPC handles."""
    # ipc transport: one host, the only case where a CUDA IPC handle means anything.
    return config.cuda_ipc and config.transport == "ipc" and worker.device.startswith("cuda")


def link_uses_cuda_ipc(config: EngineConfig, sender: WorkerSpec, dest: WorkerSpec | None) -> bool:
    """Whether CUDA tensors from ``sender`` to ``dest`` (None: the router) travel as CUDA IPC handles."""
    return dest is not None and takes_cuda_ipc(config, sender) and takes_cuda_ipc(config, dest)


def _release(h: CudaIpcHandle) -> None:
    """Give back the reference counter ``h`` carries, so that the sender may free its block."""
    try:
        torch.UntypedStorage._release_ipc_counter(h.ref_counter.encode("ascii"), h.ref_counter_offset,
                                                  device=h.device)
    except Exception as e:  # a counter file already gone (sender exited): nothing left to free
        log.debug("could not release a CUDA IPC counter: %s", e)


def export_handle(t: torch.Tensor) -> CudaIpcHandle:
    """A CUDA IPC handle to ``t``'s storage, as the receiver accepts it (msgspec-checked here, so that a torch
    whose export looks different fails at the sender, not at every receiver)."""
    (device, handle, storage_bytes, offset_bytes, ref_counter, ref_counter_offset,
     event, event_sync) = t.untyped_storage()._share_cuda_()
    raw = dict(device=device, handle=handle, storage_bytes=storage_bytes, offset_bytes=offset_bytes,
               ref_counter=ref_counter.decode("ascii", "replace") if isinstance(ref_counter, bytes) else ref_counter,
               ref_counter_offset=ref_counter_offset, event=event, event_sync=event_sync)
    try:
        return msgspec.convert(raw, CudaIpcHandle)
    except msgspec.ValidationError:
        torch.UntypedStorage._release_ipc_counter(ref_counter, ref_counter_offset, device=device)
        raise


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
        try:
            desc = export_handle(private)
        except Exception as e:  # an allocator or a container that cannot export, or a torch whose export differs
            self.enabled = False
            log.warning("cannot export CUDA IPC handles (%s); tensors to %s go through host memory", e, self.dest)
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
        self._streams: dict[int, torch.cuda.Stream] = {}

    def _stream(self, index: int) -> torch.cuda.Stream:
        # A side stream: releasing a handle synchronises the stream current at that moment (torch's deleter
        # does), and on this one only the copy is queued, never the worker's own compute.
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        return self._streams[index]

    def _storage(self, h: CudaIpcHandle, nbytes: int, request_id: str | None) -> torch.UntypedStorage:
        """The sender's block, opened on the side stream of its device (which waits on the sender's event,
        so nothing queued there reads before the sender's copy ran). Call with that stream current."""
        if h.storage_bytes != nbytes:
            _release(h)
            raise WireError(f"CUDA IPC block of {h.storage_bytes} bytes, the descriptor needs {nbytes}", request_id)
        if h.device >= torch.cuda.device_count():
            _release(h)
            raise WireError(f"CUDA IPC handle on device {h.device}, which this process does not see", request_id)
        try:
            return torch.UntypedStorage._new_shared_cuda(
                h.device, h.handle, h.storage_bytes, h.offset_bytes, h.ref_counter.encode("ascii"),
                h.ref_counter_offset, h.event if h.event is not None else b"", h.event_sync)
        except Exception as e:  # e.g. the sender exited and its memory is gone
            raise WireError(f"CUDA IPC handle cannot be opened: {e}", request_id) from None

    def open(self, h: CudaIpcHandle, dtype: torch.dtype, shape: list[int], nbytes: int,
             request_id: str | None = None) -> torch.Tensor:
        """The tensor, in this worker's own memory. Raises :class:`WireError` for a handle it cannot use."""
        torch.cuda.init()  # no-op once this process has used CUDA; opening a handle needs a context
        source = torch.device("cuda", h.device)
        with torch.cuda.device(source), torch.cuda.stream(self._stream(h.device)):
            storage = self._storage(h, nbytes, request_id)
            view = torch.empty(0, dtype=dtype, device=source).set_(storage, 0, shape)
            copy = view.clone()
            # Freeing the last reference synchronises the side stream (the copy has run), closes the
            # mapping and gives the counter back: the sender's block is free from here on.
            del view, storage
        # ``copy`` was allocated on the side stream and is used on the worker's stream from now on.
        copy.record_stream(torch.cuda.current_stream(source))
        self.received += 1
        return copy if source == self.device else copy.to(self.device)

    @contextlib.contextmanager
    def borrowed(self, handles: list[CudaIpcHandle], sizes: list[int]) -> Iterator[list[torch.Tensor]]:
        """The senders' blocks as uint8 tensors, without a copy, for reading inside the block only (a
        trainer's weight buckets, which every worker reads). Work queued meanwhile runs on the side streams;
        on leaving, the device waits for it and every handle is given back."""
        torch.cuda.init()
        storages: list[torch.UntypedStorage] = []
        views: list[torch.Tensor] = []
        try:
            for k, (h, n) in enumerate(zip(handles, sizes)):
                with torch.cuda.device(h.device), torch.cuda.stream(self._stream(h.device)):
                    try:
                        storages.append(self._storage(h, n, None))
                    except WireError:
                        for later in handles[k + 1:]:  # never opened: give their counters back too
                            _release(later)
                        raise
                    views.append(torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", h.device))
                                 .set_(storages[-1], 0, [n]))
            with torch.cuda.stream(self._stream(handles[0].device)) if handles else contextlib.nullcontext():
                yield views
        finally:
            torch.cuda.synchronize(self.device)  # what the block queued (on any stream) has run
            for d in {h.device for h in handles}:
                torch.cuda.synchronize(d)
            views.clear()
            storages.clear()  # each storage's deleter gives its counter back
            self.received += len(handles)

    def discard(self, h: CudaIpcHandle) -> None:
        """A handle of a message rejected before it was opened: release it so the sender can free the block."""
        _release(h)


def receiver_for(config: EngineConfig, me: WorkerSpec) -> CudaIpcReceiver | None:
    """A receiver for a GPU worker that may take CUDA IPC handles, else None."""
    return CudaIpcReceiver(torch.device(me.device)) if takes_cuda_ipc(config, me) and torch.cuda.is_available() \
        else None


class CudaIpcContext:
    """One worker's side of the GPU data plane: a receiver if it is a GPU worker, a sender per GPU peer."""

    def __init__(self, config: EngineConfig, me: WorkerSpec):
        self.config, self.me = config, me
        self.receiver = receiver_for(config, me)
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
