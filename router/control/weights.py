"""Weight updates and checksums across every denoise worker: one weight version for all modules, moved only when
every worker loaded an update (router/control/versioned.py); one update at a time."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from common.config.engine import WorkerSpec
from common.protocol.control import Checksum, ChecksumReply, FromMemory, UpdateWeights, WeightsReply
from router.control.fanout import FROM_MEMORY, ControlCall
from router.control.versioned import Replay, VersionedFanout


def _only(values: set):
    """The one value every worker reported, else ``None``."""
    return next(iter(values)) if len(values) == 1 else None


class WeightControl:
    role = VersionedFanout.role

    def __init__(self, control: ControlCall):
        self.versioned = VersionedFanout(control)  # by module: its last update (a path, or FROM_MEMORY)
        self.version = 0  # the last version every worker loaded

    async def update(self, module: str, path: str, checksum: bool = True) -> dict:
        return await self._update(UpdateWeights, module, Replay(UpdateWeights, {"module": module, "path": path}),
                                  path=path, checksum=checksum)

    async def update_from_memory(self, kind: type[FromMemory], module: str, timeout_s: float | None = None,
                                 **fields) -> dict:
        """An update whose tensors come from the trainer's memory (shared memory or a broadcast)."""
        return await self._update(kind, module, FROM_MEMORY, timeout_s=timeout_s, **fields)

    async def _update(self, kind: type[UpdateWeights | FromMemory], module: str, source: Replay | str,
                      timeout_s: float | None = None, **fields) -> dict:
        if timeout_s is not None:
            fields["timeout_s"] = timeout_s
        async with self.versioned.lock:
            version = self.version + 1
            t0 = time.perf_counter()
            replies: list[WeightsReply] = await self.versioned.change(module, source, kind, module=module,
                                                                    version=version, **fields)
            self.version = version
        return {
            "weight_version": version,
            "module": module,
            "sha256": _only({r.sha256 for r in replies}),
            "seconds": time.perf_counter() - t0,
            "workers": [{"index": r.index, **r.body()} for r in replies],
        }

    async def reset(self, modules: list[str], run: Callable[[int], Awaitable[list]]) -> list:
        """``modules`` back to the model directory's weights by ``run(version)`` (a resume from disk): a new
        weight version, and nothing to replay for them on a restarted worker, which loads the same."""
        async with self.versioned.lock:
            version = self.version + 1
            replies = await run(version)
            self.version = version
            for module in modules:
                self.versioned.forget(module)
            return replies

    async def replay(self, worker: WorkerSpec) -> set[str]:
        """A restarted worker loaded the model directory's weights: give it the updates since, at this version.
        Returns the modules whose latest update came from the trainer's memory, which it cannot be given."""
        return await self.versioned.replay(worker, lambda module: self.version)

    async def checksum(self, module: str, scheme: str = "engine") -> dict:
        """``scheme``: which digest (common/diffusion/checksums.py)."""
        replies: list[ChecksumReply] = await self.versioned.send(Checksum, module=module, scheme=scheme)
        sums = {r.sha256 for r in replies}
        versions = {r.weight_version for r in replies}
        consistent = len(sums) == 1 and len(versions) == 1
        return {
            "module": module,
            "sha256": _only(sums) if consistent else None,
            "weight_version": _only(versions) if consistent else None,
            "consistent": consistent,
            "workers": [{"index": r.index, **r.body()} for r in replies],
        }
