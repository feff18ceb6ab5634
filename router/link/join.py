"""The table of requests waiting for their answer, and the join of answers onto them.

The receive loop hands every Result, ErrorReply, ControlReply, Progress, StepProgress and SampleDone here;
a lost worker fails exactly the requests still in (or queued for) it. No sockets here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.protocol.control import CONTROL_REPLIES, ControlReply
from common.protocol.messages import (
    PER_SAMPLE, ROLES, ErrorReply, Progress, Result, Route, SampleDone, StepProgress,
)
from router.core.errors import EngineError

log = logging.getLogger("disagg.router")
# A result's info entries that hold one value per sample (the denoise worker's pass counts).
PER_SAMPLE_INFO = frozenset({"transformer_passes", "cached_steps"})
LOG_EVERY_S = 5.0  # a request still denoising after this long is logged, and again every as long
FENCED = 4096  # how many runs that ended unanswered (cancelled, 504) are remembered: their late answers are dropped


@dataclass
class Pending:
    future: asyncio.Future
    route: Route | None
    uses_decode: bool = True
    done_stage: int = -1  # index in ROLES of the last stage that handed the request on
    target: tuple[str, int] | None = None  # control requests: the one worker asked
    client_id: str = ""  # a generation: the id its client knows (the wire id may differ: router/link/dispatcher.py)
    samples: int = 1  # a request's n samples travel as one unit
    step: int = 0  # denoising steps taken, as the denoise worker last reported (StepProgress)
    steps: int | None = None
    created: float = field(default_factory=time.monotonic)
    logged_at: float = 0.0
    # A streaming request: called with (index, the sample's Outcome) as each sample is decoded (SampleDone).
    on_sample: Callable[[int, "Outcome"], None] | None = None

    def waits_on(self, role: str, index: int) -> bool:
        """Whether this request is still in (or queued for) worker ``role``-``index``."""
        if self.target is not None:
            return self.target == (role, index)
        if self.route is None or getattr(self.route, role) != index:
            return False
        if role == "decode" and not self.uses_decode:
            return False
        return self.done_stage < ROLES.index(role)

    def where(self) -> str:
        if self.target is not None:
            return self.target[0]
        return ROLES[min(self.done_stage + 1, len(ROLES) - 1)]


@dataclass
class Outcome:
    tensors: dict[str, torch.Tensor]  # as Result.carries declares: the output plus any rollout tensors
    timings: dict[str, float]
    info: dict
    route: Route | None
    peak_memory: dict[str, int] = field(default_factory=dict)  # each stage's, by role (Result.peak_memory)

    def sample(self, i: int, row: int | None = None) -> "Outcome":
        """Sample ``i`` alone: its row of every per-sample tensor (``row``, when they hold only some samples'
        rows: a streamed sample's 0), its entry of per-sample facts, the shared ones as they are."""
        rows = {f.name for f in PER_SAMPLE}
        tensors = {k: v[i if row is None else row] if k in rows else v for k, v in self.tensors.items()}
        info = {k: v[i] if k in PER_SAMPLE_INFO and isinstance(v, list) else v for k, v in self.info.items()}
        return Outcome(tensors, self.timings, info, self.route, self.peak_memory)


def sample_count_problem(tensors: dict[str, torch.Tensor], n: int) -> str | None:
    """Why a result's per-sample tensors do not hold one row per sample of the request, or None."""
    for f in PER_SAMPLE:
        t = tensors.get(f.name)
        if t is not None and t.shape[0] != n:
            return f"{f.name} holds {t.shape[0]} samples, the request asked for {n}"
    return None


class PendingTable:
    def __init__(self):
        self._by_id: dict[str, Pending] = {}
        self._fenced: OrderedDict[str, None] = OrderedDict()

    def fence(self, request_id: str) -> None:
        """The run ``request_id`` ended before its answer came (cancelled, 504): what still comes for it is
        dropped quietly, and its wire id is not used again while remembered."""
        self._fenced[request_id] = None
        while len(self._fenced) > FENCED:
            self._fenced.popitem(last=False)

    def fenced(self, request_id: str) -> bool:
        return request_id in self._fenced

    def latest(self, client_id: str) -> tuple[str, Pending] | None:
        """The latest run (its wire id, its entry) of the generation its client calls ``client_id``, if one is
        in flight."""
        runs = [(rid, p) for rid, p in self._by_id.items() if p.target is None and p.client_id == client_id]
        return max(runs, key=lambda run: run[1].created, default=None)

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def samples(self) -> int:
        """Samples in flight (what admission bounds): a request counts its n."""
        return sum(p.samples for p in self._by_id.values())

    def get(self, request_id: str) -> Pending | None:
        return self._by_id.get(request_id)

    def add(self, request_id: str, pending: Pending) -> Pending:
        self._by_id[request_id] = pending
        return pending

    def discard(self, request_id: str) -> None:
        self._by_id.pop(request_id, None)

    def progress(self, msg: Progress) -> None:
        """A stage handed the request on: from now on it no longer dies with that stage."""
        p = self._by_id.get(msg.request_id)
        if p is not None and msg.stage in ROLES:
            p.done_stage = max(p.done_stage, ROLES.index(msg.stage))

    def step_progress(self, msg: StepProgress) -> None:
        """The denoise worker's step count; a long request also gets a log line every ``LOG_EVERY_S``."""
        p = self._by_id.get(msg.request_id)
        if p is None:
            return
        p.step, p.steps = msg.step, msg.steps
        now = time.monotonic()
        if now - max(p.created, p.logged_at) >= LOG_EVERY_S:
            p.logged_at = now
            log.info("request %s: denoise step %d/%d, %.0f s since it arrived", msg.request_id, msg.step,
                     msg.steps, now - p.created)

    def sample_done(self, msg: SampleDone, tensors: dict[str, torch.Tensor]) -> None:
        """A streaming request's sample, decoded: handed to its stream (none any more: dropped)."""
        p = self._by_id.get(msg.request_id)
        if p is None or p.on_sample is None or msg.index >= p.samples:
            return
        p.on_sample(msg.index, Outcome(tensors, msg.timings, msg.info, p.route).sample(msg.index, row=0))

    def resolve(self, msg: Result | ErrorReply | ControlReply, tensors: dict[str, torch.Tensor]) -> bool:
        """Settle the request ``msg`` answers; False (and dropped) if it is unknown or already settled."""
        p = self._by_id.get(msg.request_id)
        if p is None or p.future.done():
            if not self.fenced(msg.request_id):
                log.warning("answer for unknown or finished request %s dropped", msg.request_id)
            return False
        if isinstance(msg, ErrorReply):
            p.future.set_exception(EngineError(msg.status, msg.type, msg.message, msg.stage, msg.request_id))
        elif isinstance(msg, CONTROL_REPLIES):
            p.future.set_result(msg)
        elif (problem := sample_count_problem(tensors, p.samples)) is not None:
            p.future.set_exception(EngineError(502, "bad_result", f"malformed answer: {problem}", msg.stage,
                                               msg.request_id))
        else:  # the codec checked the Result's tensors against its contract (OUTPUT is required)
            p.future.set_result(Outcome(tensors, dict(msg.timings), dict(msg.info), p.route, dict(msg.peak_memory)))
        return True

    def reject(self, request_id: str, reason: str) -> bool:
        """An answer for this request arrived malformed (the codec refused it): fail it with 502 at once
        rather than let it wait for its deadline. False if the request is unknown or already settled."""
        p = self._by_id.get(request_id)
        if p is None or p.future.done():
            return False
        p.future.set_exception(EngineError(502, "bad_result", f"malformed answer: {reason}", p.where(), request_id))
        return True

    def waiting_on(self, role: str, index: int) -> int:
        """Generation requests still in (or queued for) that worker (control requests aside)."""
        return sum(1 for p in self._by_id.values() if p.target is None and p.waits_on(role, index))

    def fail_waiting_on(self, role: str, index: int, reason: str, type_: str = "worker_lost",
                        controls: bool = True) -> int:
        """Fail (503 ``type_``) every unsettled request still in that worker (``controls``: control requests
        too); how many."""
        failed = 0
        for rid, p in list(self._by_id.items()):
            if p.waits_on(role, index) and not p.future.done() and (controls or p.target is None):
                p.future.set_exception(EngineError(503, type_, f"{role} worker {index} {reason}", role, rid))
                failed += 1
        return failed

    def fail_all(self, error: EngineError) -> None:
        """At the router's stop: whoever still waits gets ``error``; a future nobody awaits any more (its waiter
        was cancelled) is marked seen, so that asyncio does not log it as never retrieved."""
        for p in self._by_id.values():
            if not p.future.done():
                p.future.set_exception(error)
                p.future.exception()
