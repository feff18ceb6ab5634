"""What every denoise worker must hold alike, changed all or nothing: a module's weights, a LoRA adapter.

:class:`VersionedFanout` sends one control to every denoise worker and requires every reply: a change counts
(its caller moves the version) only when all succeeded, else it raises the failure naming each worker that
failed (:func:`~router.control.fanout.control_failure`). It remembers how each item was last set, so that a
worker that restarted can be given every item again at its version; an item that came from the trainer's memory
never passed through the router and cannot be (the worker lacks it until the trainer pushes it again).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from common.config.engine import WorkerSpec
from common.protocol.control import ControlReply, ControlRequest
from router.control.fanout import FROM_MEMORY, ControlCall, control_failure


@dataclass
class Replay:
    """How an item was set, to set it again on a restarted worker: a ``kind`` message with ``fields`` (its
    version added) and ``tensors``."""

    kind: type[ControlRequest]
    fields: dict
    tensors: dict | None = None


class VersionedFanout:
    """Items by key on every denoise worker; ``lacking(key)``: how a worker's list of what it lacks names an
    item; ``on_supplied(name)``: every worker now holds that item's latest change (or its removal)."""

    role = "denoise"

    def __init__(self, control: ControlCall, lacking: Callable[[str], str] = lambda key: key):
        self._control, self._lacking = control, lacking
        self.lock = asyncio.Lock()  # one change at a time, so versions and sources stay in step
        self.sources: dict[str, Replay | str] = {}  # key -> how it was set; FROM_MEMORY: not replayable
        self.on_supplied: Callable[[str], None] | None = None

    async def send(self, kind: type[ControlRequest], only: WorkerSpec | None = None, tensors: dict | None = None,
                   **fields) -> list[ControlReply]:
        """``kind`` to every worker (or ``only`` that one): every reply, or the failure."""
        if only is not None:
            fields["only"] = only
        if tensors is not None:
            fields["tensors"] = tensors
        replies = await self._control(self.role, kind, **fields)
        failure = control_failure(replies, self.role)
        if failure is not None:
            raise failure
        return replies

    async def change(self, key: str, source: Replay | str, kind: type[ControlRequest], tensors: dict | None = None,
                     **fields) -> list[ControlReply]:
        """Change ``key`` on every worker (the caller holds :attr:`lock` and moves its version on success)."""
        replies = await self.send(kind, tensors=tensors, **fields)
        self.sources[key] = source
        self.supplied(key)
        return replies

    def forget(self, key: str) -> None:
        """``key`` is back to what a restarted worker loads by itself (or gone): nothing to replay."""
        self.sources.pop(key, None)
        self.supplied(key)

    def supplied(self, key: str) -> None:
        if self.on_supplied is not None:
            self.on_supplied(self._lacking(key))

    async def replay(self, worker: WorkerSpec, version_of: Callable[[str], int]) -> set[str]:
        """Set every item again on ``worker``, at ``version_of(key)``; what it lacks (from the trainer's memory)."""
        async with self.lock:
            missing = set()
            for key, source in sorted(self.sources.items()):
                if source == FROM_MEMORY:
                    missing.add(self._lacking(key))
                    continue
                await self.send(source.kind, only=worker, tensors=source.tensors, version=version_of(key),
                                **source.fields)
            return missing
