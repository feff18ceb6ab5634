"""The router's link to workers in this process: the dispatcher (router/link/dispatcher.py) without sockets.

Everything the dispatcher does (admission, routing, joining the answers, retries, cancels, controls, the
workers' registry and heartbeats) is its own; only its socket writes and reads are replaced: a message for a
worker goes to that :class:`~local_engine.workers.LocalWorker`'s queue, and what a worker sends the router is
handed to the dispatcher on its event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from common.config.engine import EngineConfig, WorkerSpec
from common.protocol.control import ControlRequest
from common.protocol.messages import Cancel, EncodeRequest, PeerMoved
from common.runtime.stage import Stage
from local_engine.workers import LocalWorker, WorkerLoop, over_the_wire
from router.link.dispatcher import Dispatcher


class LocalLink(Dispatcher):
    def __init__(self, config: EngineConfig, stages: list[Stage]):
        super().__init__(config)
        self.workers = {(s.spec.role, s.spec.index): LocalWorker(s, self._deliver) for s in stages}
        self.loop_thread = WorkerLoop(list(self.workers.values()), self._beat, config.heartbeat_interval_s)
        self.workers_restart = False  # a worker here is a thread's stage: nothing restarts it

    # --- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.loop_thread.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self.loop_thread.stop)
        await super().stop()

    # --- to the workers ----------------------------------------------------------------------------------
    async def to_encoder(self, index: int, msg: EncodeRequest, tensors: dict[str, torch.Tensor]) -> None:
        self._to_worker("encoder", index, msg, tensors)

    def cancel_to_encoder(self, index: int, msg: Cancel) -> None:
        self._to_worker("encoder", index, msg, {})

    async def _send_control(self, w: WorkerSpec, msg: ControlRequest | PeerMoved, tensors: dict | None) -> None:
        self._to_worker(w.role, w.index, msg, tensors or {})

    def _to_worker(self, role: str, index: int, msg: Any, tensors: dict[str, torch.Tensor]) -> None:
        worker = self.workers[(role, index)]
        worker.inbox.append(over_the_wire(msg, tensors, worker.contract))
        self.loop_thread.wake.set()

    # --- from the workers --------------------------------------------------------------------------------
    def _deliver(self, to: str, index: int | None, msg: Any, tensors: dict[str, torch.Tensor]) -> None:
        """A worker's message (on the workers' thread): to another worker, or to the router's loop."""
        if to != "router":
            self._to_worker(to, index, msg, tensors)
            return
        arrived = over_the_wire(msg, tensors, self.contract)
        self._loop.call_soon_threadsafe(self._dispatch, *arrived)

    def _beat(self, worker: LocalWorker) -> None:
        self._loop.call_soon_threadsafe(self._dispatch, worker.heartbeat(), {})
