"""Releasing and resuming the workers' weights, so that a colocated trainer can use their devices.

Components by tag (SGLang's ``tags``): ``transformer`` (every expert, on the denoise workers),
``text_encoder`` (with the image encoder of an image-to-video model, on the encoder workers) and ``vae`` (the
decode workers); ``weights`` or no tags: all three. Level 1 moves the weights to host memory and brings the
same bytes back; level 2 drops them: a push (any weight-sync path) gives the transformer's back, ``reload:
"disk"`` any component's from the model directory.

While a component sleeps its workers are not routed to (``/health``: ``sleeping``); a request that needs
them waits up to ``--worker-wait`` like one whose worker restarts, then gets 503 ``sleeping``. A release
first lets the work in flight on those workers finish (``mode: "abort"``: answers it 503 at once).
"""

from __future__ import annotations

import asyncio
import time

from common.protocol.control import ControlRequest, ReleaseMemory, ReleaseReply, ResumeMemory, ResumeReply
from common.protocol.messages import MEMORY_TAGS, TAG_ROLES
from router.control.fanout import control_failure
from router.control.weights import WeightControl
from router.core.errors import EngineError, FieldError

ALL = "weights"  # every component's tag
POLL_S = 0.02


def components_of(tags: list[str] | None, field: str = "tags") -> list[str]:
    """The components ``tags`` name, in pipeline order (none, or ``weights``: all)."""
    if not tags:
        return list(MEMORY_TAGS)
    chosen = set()
    for tag in tags:
        if tag == ALL:
            chosen.update(MEMORY_TAGS)
        elif tag in MEMORY_TAGS:
            chosen.add(tag)
        else:
            raise FieldError(field, f"unknown tag {tag!r}: one of {', '.join((*MEMORY_TAGS, ALL))}")
    return [t for t in MEMORY_TAGS if t in chosen]


class SleepControl:
    """Which components sleep, at which level; their workers' releases and resumes."""

    def __init__(self, dispatcher, weights: WeightControl, experts: tuple[str, ...]):
        self.dispatcher, self.weights, self.experts = dispatcher, weights, experts
        self.levels: dict[str, int] = {}  # sleeping components and their level
        self.pushed: set[str] = set()  # experts pushed since the transformer's weights were dropped
        self._lock = asyncio.Lock()

    def status(self) -> dict:
        components = {}
        for tag in MEMORY_TAGS:
            level = self.levels.get(tag)
            weights = "device" if level is None else "host" if level == 1 else "dropped"
            if tag == "transformer" and level == 2 and self.pushed:
                weights = "pushed" if self.pushed >= set(self.experts) else "partly pushed"
            components[tag] = {"sleeping": level is not None, "level": level, "weights": weights}
        return {"is_sleeping": bool(self.levels), "components": components}

    async def _control(self, tag: str, kind: type[ControlRequest], **fields) -> list:
        replies = await self.dispatcher.control(TAG_ROLES[tag], kind, **fields)
        failure = control_failure(replies, TAG_ROLES[tag])
        if failure is not None:
            raise failure
        return replies

    async def release(self, tags: list[str], level: int, mode: str = "wait") -> dict:
        async with self._lock:
            t0 = time.perf_counter()
            registry = self.dispatcher.registry
            for tag in tags:
                registry.set_sleeping(TAG_ROLES[tag], True)  # from now on no new work reaches them
            await asyncio.gather(*(self._quiet(TAG_ROLES[tag], mode == "abort") for tag in tags))
            replies = await asyncio.gather(*(self._control(tag, ReleaseMemory, level=level, abort=mode == "abort")
                                             for tag in tags), return_exceptions=True)
            for tag, reply in zip(tags, replies):
                if not isinstance(reply, BaseException):
                    self.levels[tag] = max(level, self.levels.get(tag, 0))
                    if tag == "transformer" and level == 2:
                        self.pushed = set()
                registry.set_sleeping(TAG_ROLES[tag], tag in self.levels)  # a failed one serves again
            failed = [r for r in replies if isinstance(r, BaseException)]
            if failed:
                raise failed[0]
            released: list[ReleaseReply] = [r for rs in replies for r in rs]
            workers = [{"role": r.role, "index": r.index, "released_bytes": r.released_bytes,
                        "memory_before": r.before, "memory_after": r.after} for r in released]
            return {"tags": tags, "level": level, "seconds": time.perf_counter() - t0, "workers": workers,
                    **self.status()}

    async def _quiet(self, role: str, abort: bool) -> None:
        """Until no request is in (or queued for) ``role``'s workers; with ``abort``, each answered 503 now."""
        workers = self.dispatcher.config.of_role(role)
        pending = self.dispatcher.pending
        if abort:
            for w in workers:
                pending.fail_waiting_on(role, w.index, "released its weights (release_memory_occupation, mode abort)",
                                        type_="sleeping", controls=False)
            return
        deadline = time.monotonic() + self.dispatcher.config.limits.request_timeout_s
        while any(pending.waiting_on(role, w.index) for w in workers) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)

    async def resume(self, tags: list[str], reload: str | None = None) -> dict:
        async with self._lock:
            t0 = time.perf_counter()
            asleep = [t for t in tags if t in self.levels]
            reloads = {t: self._dropped(t) for t in asleep}
            missing = [f"{t} ({', '.join(names)})" for t, names in reloads.items() if names and reload != "disk"]
            if missing:
                raise EngineError(409, "weights_missing", f"dropped at level 2 and not pushed since: "
                                  f"{'; '.join(missing)}; push the weights first, or resume with reload: disk",
                                  "router", "")
            replies: list[ResumeReply] = []
            for tag in asleep:
                if tag == "transformer" and reloads[tag]:  # the model directory's weights: a new weight version
                    replies += await self.weights.reset(reloads[tag], lambda version: self._control(
                        tag, ResumeMemory, reload=reload, version=version))
                else:
                    replies += await self._control(tag, ResumeMemory, reload=reload)
                del self.levels[tag]
                if tag == "transformer":
                    self.pushed = set()
                self.dispatcher.registry.set_sleeping(TAG_ROLES[tag], False)
            return {"tags": tags, "resumed": asleep, "seconds": time.perf_counter() - t0,
                    "weight_version": self.weights.version,
                    "workers": [{"role": r.role, "index": r.index, "memory_after": r.after}
                                for r in replies], **self.status()}

    def _dropped(self, tag: str) -> list[str]:
        """What a resume of ``tag`` must reload: its modules dropped at level 2 and not pushed since."""
        if self.levels.get(tag) != 2:
            return []
        if tag != "transformer":
            return [tag]
        return [e for e in self.experts if e not in self.pushed]

    def supplied(self, module: str) -> None:
        """Every denoise worker now holds the latest push of ``module``."""
        if module in self.experts and self.levels.get("transformer") == 2:
            self.pushed.add(module)

    async def worker_back(self, worker) -> None:
        """A worker restarted while its component sleeps goes back to sleep before anything is routed to it."""
        for tag, level in self.levels.items():
            if TAG_ROLES[tag] == worker.role:
                replies = await self.dispatcher.control(worker.role, ReleaseMemory, only=worker, level=level)
                failure = control_failure(replies, worker.role)
                if failure is not None:
                    raise failure
