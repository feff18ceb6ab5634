"""Control requests: fan one out to every instance of a role and combine the replies.

Weight updates and checksums must reach every denoise worker: a reply set is
only a success when all of them succeeded. No sockets here: the dispatcher
passes the function that sends one control request to one worker.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable

from common.config.engine import WorkerSpec
from common.protocol.control import (Checksum, ChecksumReply, ControlReply, ControlRequest, FromMemory,
                                     UpdateWeights, WeightsReply, kind_of)
from common.protocol.messages import PROTOCOL_VERSION
from router.core.errors import EngineError
from router.link.join import Pending, PendingTable

Reply = ControlReply | EngineError
FROM_MEMORY = "<memory>"  # the source of an update a restarted worker cannot be given again
SendControl = Callable[[WorkerSpec, ControlRequest, dict | None], Awaitable[None]]
# Dispatcher.control(role, kind, **fields): every instance's reply to a ``kind`` message with ``fields``, by index.
ControlCall = Callable[..., Awaitable[list[Reply]]]


async def fan_out(workers: Iterable[WorkerSpec], kind: type[ControlRequest], fields: dict, pending: PendingTable,
                  send: SendControl, timeout_s: float, tensors: dict | None = None) -> list[Reply]:
    """Ask every worker at once (a ``kind`` message with ``fields``; each gets ``tensors`` too), then collect
    each answer (or its error, or a 504) in order. An answer of a kind that does not answer ``kind`` is a 502."""
    loop = asyncio.get_running_loop()
    waits = []
    for w in workers:
        rid = f"ctl-{uuid.uuid4().hex}"
        fut = loop.create_future()
        pending.add(rid, Pending(fut, None, target=(w.role, w.index)))
        await send(w, kind(v=PROTOCOL_VERSION, request_id=rid, **fields), tensors)
        waits.append((w, rid, fut))
    out: list[Reply] = []
    for w, rid, fut in waits:
        try:
            reply = await asyncio.wait_for(fut, timeout=timeout_s)
            out.append(reply if isinstance(reply, kind.replies) else EngineError(
                502, "bad_result", f"a {kind_of(reply)} does not answer {kind_of(kind)}", w.role, rid))
        except EngineError as e:
            out.append(e)
        except asyncio.TimeoutError:
            out.append(EngineError(504, "timeout", f"no answer to {kind_of(kind)}", w.role, rid))
        finally:
            pending.discard(rid)
    return out


def control_failure(replies: list[Reply], stage: str) -> EngineError | None:
    """``None`` when every worker succeeded. When all refused the request (4xx), their refusal;
    otherwise the workers may now disagree: 500 ``inconsistent_workers`` naming each failure."""
    errors = [r for r in replies if isinstance(r, EngineError)]
    if not errors:
        return None
    # Every worker refused (4xx), or every one failed the same way (a weight transfer that broke off: 504;
    # weights released: 503 sleeping): their answer, not a disagreement.
    if len(errors) == len(replies) and (all(400 <= e.status < 500 for e in errors)
                                         or len({(e.status, e.type) for e in errors}) == 1
                                         and errors[0].status in (503, 504)):
        e = errors[0]
        return EngineError(e.status, e.type, e.message, e.stage, "")
    detail = "; ".join(f"{e.stage}: {e.message}" for e in errors)
    return EngineError(500, "inconsistent_workers", f"{len(errors)}/{len(replies)} workers failed: {detail}",
                       stage, "")


def _only(values: set):
    """The one value every worker reported, else ``None``."""
    return next(iter(values)) if len(values) == 1 else None


class WeightControl:
    """Weight updates and checksums across every denoise worker; one update at a time."""

    role = "denoise"

    def __init__(self, control: ControlCall):
        self._control = control
        self.version = 0  # the last version every worker loaded
        self._lock = asyncio.Lock()
        # module -> the path of its last update, for a restarted worker; FROM_MEMORY: it cannot be replayed
        self._loaded: dict[str, str] = {}
        self.on_supplied: Callable[[str], None] | None = None  # every worker holds this module's latest weights

    async def _all(self, kind: type[ControlRequest], timeout_s: float | None = None, **fields) -> list[ControlReply]:
        if timeout_s is not None:
            fields["timeout_s"] = timeout_s
        replies = await self._control(self.role, kind, **fields)
        failure = control_failure(replies, self.role)
        if failure is not None:
            raise failure
        return replies

    async def update(self, module: str, path: str, checksum: bool = True) -> dict:
        return await self._update(UpdateWeights, module, path, path=path, checksum=checksum)

    async def update_from_memory(self, kind: type[FromMemory], module: str, timeout_s: float | None = None,
                                 **fields) -> dict:
        """An update whose tensors come from the trainer's memory (shared memory or a broadcast)."""
        return await self._update(kind, module, FROM_MEMORY, timeout_s=timeout_s, **fields)

    async def _update(self, kind: type[UpdateWeights | FromMemory], module: str, source: str,
                      timeout_s: float | None = None, **fields) -> dict:
        async with self._lock:
            version = self.version + 1
            t0 = time.perf_counter()
            replies: list[WeightsReply] = await self._all(kind, module=module, version=version, timeout_s=timeout_s,
                                                          **fields)
            self.version = version
            self._loaded[module] = source
            if self.on_supplied is not None:
                self.on_supplied(module)
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
        async with self._lock:
            version = self.version + 1
            replies = await run(version)
            self.version = version
            for module in modules:
                self._loaded.pop(module, None)
                if self.on_supplied is not None:
                    self.on_supplied(module)
            return replies

    async def replay(self, worker: WorkerSpec) -> set[str]:
        """A restarted worker loaded the model directory's weights: give it the updates since, at this version.
        Returns the modules whose latest update came from the trainer's memory, which it cannot be given."""
        async with self._lock:
            missing = set()
            for module, path in sorted(self._loaded.items()):
                if path == FROM_MEMORY:
                    missing.add(module)
                    continue
                replies = await self._control(self.role, UpdateWeights, only=worker, module=module, path=path,
                                              version=self.version)
                failure = control_failure(replies, self.role)
                if failure is not None:
                    raise failure
            return missing

    async def checksum(self, module: str) -> dict:
        replies: list[ChecksumReply] = await self._all(Checksum, module=module)
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
