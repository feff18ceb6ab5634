"""The engine's workers in this process: each stage's own message loop (common/runtime/worker.py) without a socket.

A :class:`LocalWorker` is a :class:`~common.runtime.worker.WorkerRuntime` whose messages come in through a queue
and go out through a callable instead of ZeroMQ. Every message still goes through the wire's codec (encoded,
its frames copied as a socket would copy them, decoded against the receiver's contract): what a stage receives
is what it receives from a socket, so the answers are the launched engine's bit for bit. :class:`WorkerLoop`
runs every worker's turns on one thread, each at the intra-op thread count its process would have.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from common.config.engine import worker_threads
from common.protocol.codec import decode, encode
from common.protocol.contracts import WireContract
from common.runtime.stage import Forward, Stage
from common.runtime.worker import WorkerRuntime
from common.transport.cuda_ipc import CudaIpcContext
from common.transport.security import process_name
from common.transport.shm import ShmContext

log = logging.getLogger("disagg.local")
# One model load at a time in this process: diffusers' and transformers' loaders patch torch.nn.Module for the
# whole process while they build a model (accelerate's init_empty_weights), so two local engines loading on two
# threads could leave it patched. Code of the caller's own that loads a model while an engine starts is not covered.
MODEL_LOADS = threading.Lock()

# Where a worker's message goes: (role or "router", its index or None, the message, its tensors).
Deliver = Callable[[str, int | None, Any, dict[str, torch.Tensor]], None]


def over_the_wire(msg: Any, tensors: dict[str, torch.Tensor] | None, contract: WireContract):
    """``msg`` and ``tensors`` as a receiver gets them: encoded, each frame copied (a socket's copy), decoded."""
    frames = [bytes(memoryview(frame)) for frame in encode(msg, tensors)]
    return decode(frames, contract=contract)


class LocalWorker(WorkerRuntime):
    def __init__(self, stage: Stage, deliver: Deliver):
        self.deliver = deliver
        self.inbox: collections.deque[tuple[Any, dict[str, torch.Tensor]]] = collections.deque()
        super().__init__(stage)
        self.threads = worker_threads(self.config, self.spec)

    def open_transport(self) -> None:
        """No sockets; shared memory and CUDA IPC off (the engine's config has no threshold, no peers)."""
        self.ctx = self.security = None
        self.shm = ShmContext(self.config, process_name(self.spec.role, self.spec.index))
        self.cuda_ipc = CudaIpcContext(self.config, self.spec)

    def send(self, fwd: Forward) -> None:
        index = None if fwd.to == "router" else getattr(fwd.msg.route, fwd.to)
        self.deliver(fwd.to, index, fwd.msg, fwd.tensors)

    def turn(self) -> bool:
        """One turn of the worker's loop (take what arrived, controls when quiet, held requests, one step of its
        work); whether it had anything to do."""
        busy = bool(self.inbox) or self.stage.has_work() or bool(self._controls) or bool(self._held)
        if not busy:
            return False
        if torch.get_num_threads() != self.threads:  # its process's intra-op threads
            torch.set_num_threads(self.threads)
        while self.inbox:
            self.take(*self.inbox.popleft())
        self.apply_controls_when_quiet()
        self.admit_held()
        self.advance()
        return True


class WorkerLoop:
    """Every local worker's turns on one thread: their stages load there, then they take turns while any has work,
    and each tells the router it is alive every ``heartbeat_s``."""

    def __init__(self, workers: list[LocalWorker], heartbeat: Callable[[LocalWorker], None], heartbeat_s: float):
        self.workers, self.heartbeat, self.heartbeat_s = workers, heartbeat, heartbeat_s
        self.wake = threading.Event()  # set by each delivery to a worker
        self.stopping = threading.Event()
        self.error: BaseException | None = None  # what stopped the loading, if anything did
        self._thread = threading.Thread(target=self._run, name="local-workers", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            for w in self.workers:
                torch.set_num_threads(w.threads)
                with MODEL_LOADS:
                    w.stage.load()
                w.state = "ready"
                self.heartbeat(w)
        except BaseException as e:  # the engine's start fails with it
            self.error = e
            log.exception("a stage failed to load")
            return
        last_beat = 0.0
        try:
            while not self.stopping.is_set():
                self.wake.clear()
                busy = False
                for w in self.workers:
                    busy = w.turn() or busy
                now = time.monotonic()
                if now - last_beat >= self.heartbeat_s:
                    for w in self.workers:
                        self.heartbeat(w)
                    last_beat = now
                if not busy:
                    self.wake.wait(self.heartbeat_s)
        finally:
            for w in self.workers:
                w.stage.close()

