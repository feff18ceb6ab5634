"""What a pipeline stage is: the interface each worker directory implements.

A stage (encoder, denoise, decode) subclasses :class:`Stage` and implements
only ``load`` and what it does with requests (``accept`` / ``work``), or
``process_batch`` for a :class:`QueuedBatchStage`. The loop around it, with the
sockets, lives in :mod:`common.runtime.worker`.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from common.config.engine import EngineConfig, WorkerSpec, torch_dtype_for
from common.protocol.errors import Cancelled, RequestError
from common.protocol.control import (ControlReply, ControlRequest, ReleaseMemory, ReleaseReply, ResumeMemory,
                                     ResumeReply, kind_of)
from common.protocol.messages import PROTOCOL_VERSION, Message
from common.runtime.component_memory import ComponentMemory, memory_usage, modules_of, return_freed_memory

log = logging.getLogger("disagg.worker")


@dataclass
class Forward:
    """Where a processed request goes next: ``"router"`` or a stage role."""

    to: str
    msg: Message
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class Stage:
    """What is special to one pipeline stage. Subclasses set ``role``.

    A stage implements ``accept`` (take a request), ``has_work`` and ``work``
    (advance what it holds, e.g. one batched forward, and return the requests
    that finished or failed); the runtime keeps reading its socket between two
    calls of ``work``, so new requests join. :class:`QueuedBatchStage` is the
    simple case: handle whatever has queued up in one call.
    """

    role: ClassVar[str]

    def __init__(self, config: EngineConfig, spec: WorkerSpec):
        self.config = config
        self.spec = spec
        self.device = torch.device(spec.device)
        self.dtype = torch_dtype_for(spec.device, config.dtype)

    def load(self) -> None:
        raise NotImplementedError

    def accept(self, msg: Any, tensors: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def can_accept(self) -> bool:
        return True

    def has_work(self) -> bool:
        return False

    def work(self) -> list[tuple[Any, "Forward | BaseException"]]:
        raise NotImplementedError

    def notices(self) -> list["Forward"]:
        """Messages for the router that are no request's answer (progress), taken after each ``work()``."""
        return []

    def idle(self) -> None:
        """Called when nothing arrived for a while and nothing is held: housekeeping that may wait."""

    def close(self) -> None:
        """When the worker stops (after its loop): release what ``load`` started."""

    def applies_between_steps(self, msg: ControlRequest) -> bool:
        """Whether ``msg`` may apply while requests are in flight; else it waits until none is."""
        return False

    # --- control messages ------------------------------------------------------------
    def control_handlers(self) -> dict[type, Callable[..., ControlReply]]:
        """The control kinds this stage answers, each with its handler: ``handler(msg)``, or ``handler(msg,
        tensors)`` for a kind that carries tensors. A stage adds its own kinds to these."""
        return {ReleaseMemory: self.release, ResumeMemory: self.resume}

    def control(self, msg: ControlRequest, tensors: dict[str, torch.Tensor]) -> ControlReply:
        """``msg``'s handler's reply; a kind this stage does not handle is refused (the worker answers the error)."""
        handler = self.control_handlers().get(type(msg))
        if handler is None:
            raise RequestError(f"the {self.role} worker takes no {kind_of(msg)} messages")
        return handler(msg, tensors) if type(msg).carries else handler(msg)

    def answer(self, msg: ControlRequest, kind: type, **fields) -> ControlReply:
        """The reply of kind ``kind`` to ``msg``, from this worker."""
        return kind(v=PROTOCOL_VERSION, request_id=msg.request_id, role=self.role, index=self.spec.index, **fields)

    # --- releasing and resuming the weights (a colocated trainer) -----------------------
    memory: ComponentMemory | None = None  # set by ``load`` in stages whose weights can sleep

    def component_memory(self, tag: str, holders: dict[str, object]) -> ComponentMemory:
        """The weights ``holders`` (what ``load`` made) hold, as the component ``tag``; a resume from disk loads
        a fresh copy of this stage and takes its weights."""
        return ComponentMemory(tag, modules_of(holders), self.fresh_modules)

    def fresh_modules(self) -> dict[str, torch.nn.Module]:
        fresh = type(self)(self.config, self.spec)
        fresh.load()
        return {name: m.module for name, m in fresh.memory.modules.items()}

    def drop_work(self) -> int:
        """Forget every request held (their answers went out already: a release with ``abort``); how many."""
        return 0

    def cancel(self, request_id: str, partial: bool) -> "tuple[Any, Forward | BaseException] | None":
        """Let go of a held request (a ``Cancel``): its message and what to answer (a :class:`Cancelled`, or a
        partial result); None when it is not held here."""
        return None

    def release(self, msg: ReleaseMemory) -> ReleaseReply:
        """Release the stage's weights (a colocated trainer's turn on the device); with ``abort``, drop the
        requests held first."""
        self._check_memory()
        dropped = self.drop_work() if msg.abort else 0
        if dropped:
            log.info("release_memory (abort): dropped %d request(s)", dropped)
        reply = self.release_memory(msg)
        log.info("weights released (level %d): %d bytes", msg.level, reply.released_bytes)
        return reply

    def resume(self, msg: ResumeMemory) -> ResumeReply:
        self._check_memory()
        return self.resume_memory(msg)

    def _check_memory(self) -> None:
        if self.memory is None:
            raise RequestError(f"the {self.role} worker holds no weights to release")

    def release_memory(self, msg: ReleaseMemory) -> ReleaseReply:
        """The answer says what the process held before and after (``memory_usage``), for the trainer's logs."""
        devices = self.memory.devices
        before = memory_usage(devices)
        released = self.memory.release(msg.level)
        return_freed_memory(devices)
        return self.answer(msg, ReleaseReply, level=self.memory.level, released_bytes=released, before=before,
                           after=memory_usage(devices))

    def resume_memory(self, msg: ResumeMemory) -> ResumeReply:
        self.memory.resume(msg.reload)
        return self.answer(msg, ResumeReply, level=0, after=memory_usage(self.memory.devices))


class QueuedBatchStage(Stage):
    """A stage that handles whatever has queued up in one call (encoder, decode).

    ``process_batch`` gets up to ``max_batch_size`` requests and returns one
    ``Forward`` or exception per request, in order.
    """

    def __init__(self, config: EngineConfig, spec: WorkerSpec):
        super().__init__(config, spec)
        self.queue: collections.deque = collections.deque()
        self.max_batch = max(1, config.max_batch_size)

    def accept(self, msg: Any, tensors: dict[str, torch.Tensor]) -> None:
        self.queue.append((msg, tensors))

    def can_accept(self) -> bool:
        return len(self.queue) < 4 * self.max_batch

    def has_work(self) -> bool:
        return bool(self.queue)

    def work(self) -> list[tuple[Any, "Forward | BaseException"]]:
        items = [self.queue.popleft() for _ in range(min(self.max_batch, len(self.queue)))]
        try:
            outcomes = self.process_batch(items)
        except Exception as e:  # a failed batch fails its requests, nothing else
            outcomes = [e] * len(items)
        return [(msg, out) for (msg, _), out in zip(items, outcomes)]

    def process_batch(self, items: list[tuple[Any, dict[str, torch.Tensor]]]) -> list["Forward | BaseException"]:
        raise NotImplementedError

    def drop_work(self) -> int:
        dropped = len(self.queue)
        self.queue.clear()
        return dropped

    def cancel(self, request_id: str, partial: bool) -> "tuple[Any, Forward | BaseException] | None":
        for item in self.queue:  # queued, not started: nothing partial to give
            if item[0].request_id == request_id:
                self.queue.remove(item)
                return item[0], Cancelled(f"request cancelled while queued in the {self.role} worker")
        return None
