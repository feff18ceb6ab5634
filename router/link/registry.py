"""The worker registry: every worker of the topology and its state, from its heartbeats.

No sockets here: the dispatcher feeds in heartbeats and exits, asks which
instance of a role should take the next request, and which workers went quiet.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from common.config.engine import WorkerSpec
from common.protocol.messages import ROLES, Heartbeat
from router.core.errors import EngineError

log = logging.getLogger("disagg.router")


@dataclass
class WorkerState:
    spec: WorkerSpec
    state: str = "starting"
    pid: int | None = None
    last_seen: float | None = None
    outstanding: int = 0
    dead_pids: set[int] = field(default_factory=set)
    cuda_ipc: dict[str, int] = field(default_factory=lambda: {"sent": 0, "received": 0})
    shm: dict[str, int] = field(default_factory=lambda: {"sent": 0, "received": 0})
    new_process: bool = False  # a process replaced the one before it and has not been synced yet
    syncing: bool = False  # the router is giving a new process what the old one held (LoRA adapters)
    # What a restarted denoise worker lacks that only the trainer's memory held (an expert's weights, "lora:"
    # and an adapter's name): not routed to until each is pushed again (or, for weights, loaded from disk).
    missing: set[str] = field(default_factory=set)
    sleeping: bool = False  # its weights are released (router/control/sleep.py): not routed to until resumed

    def alive(self, now: float, timeout_s: float) -> bool:
        return self.last_seen is not None and now - self.last_seen < timeout_s

    def ready(self, now: float, timeout_s: float) -> bool:
        return (self.state == "ready" and not self.syncing and not self.missing and not self.sleeping
                and self.alive(now, timeout_s))

    def reported_state(self, now: float, timeout_s: float) -> str:
        """The state ``/health`` shows: a quiet worker is ``lost`` (or still ``starting``)."""
        if self.syncing and self.state == "ready":
            return "syncing"
        if self.sleeping and self.state == "ready" and self.alive(now, timeout_s):
            return "sleeping"
        if self.missing and self.state == "ready":
            return "stale"
        if self.state == "dead" or self.alive(now, timeout_s):
            return self.state
        return "starting" if self.last_seen is None else "lost"


class WorkerRegistry:
    def __init__(self, specs: Iterable[WorkerSpec], heartbeat_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.workers = {(w.role, w.index): WorkerState(w) for w in specs}
        self.timeout_s = heartbeat_timeout_s
        self._clock = clock
        # One round-robin counter per role: a shared one would advance by the number of roles a request
        # reserves, and with two of them (a latent answer skips decode) always land on the same instance.
        self._rr = {role: itertools.count() for role in ROLES}

    def heartbeat(self, hb: Heartbeat) -> str | None:
        """Record a heartbeat. Returns why the worker's previous process is lost when a new
        process took its place (the caller fails what the old one held), else ``None``."""
        w = self.workers.get((hb.role, hb.index))
        if w is None:
            log.warning("heartbeat from unknown worker %s-%d ignored", hb.role, hb.index)
            return None
        if hb.pid in w.dead_pids:
            return None  # a heartbeat the dead process sent before it died
        replaced = None
        if w.pid is not None and hb.pid != w.pid and w.state != "dead":
            replaced = f"replaced by pid {hb.pid}"
            self.lost(hb.role, hb.index)
        if w.state == "dead" and hb.state == "ready":
            log.info("%s worker %d is back (pid %d)", hb.role, hb.index, hb.pid)
        if w.pid is not None and hb.pid != w.pid:
            w.new_process = True
        w.state, w.pid, w.last_seen = hb.state, hb.pid, self._clock()
        w.cuda_ipc = {"sent": hb.cuda_ipc_sent, "received": hb.cuda_ipc_received}
        w.shm = {"sent": hb.shm_sent, "received": hb.shm_received}
        return replaced

    def lacks(self, role: str, index: int, items: set[str]) -> None:
        """One worker lacks ``items`` (stale: not routed to until each is supplied)."""
        self.workers[(role, index)].missing |= items

    def supplied(self, role: str, item: str) -> None:
        """Every worker of ``role`` now holds ``item`` (or it no longer exists)."""
        for (r, _), w in self.workers.items():
            if r == role:
                w.missing.discard(item)

    def set_sleeping(self, role: str, sleeping: bool) -> None:
        for (r, _), w in self.workers.items():
            if r == role:
                w.sleeping = sleeping

    def asleep(self, role: str) -> bool:
        return any(r == role and w.sleeping for (r, _), w in self.workers.items())

    def outstanding(self, role: str) -> int:
        """Samples routed to ``role``'s workers and not answered yet."""
        return sum(w.outstanding for (r, _), w in self.workers.items() if r == role)

    def take_new_ready(self, w: WorkerState) -> bool:
        """True once for a replacing process that is now ready: it starts syncing (not routed to)."""
        if not (w.new_process and w.state == "ready"):
            return False
        w.new_process, w.syncing = False, True
        return True

    def lost(self, role: str, index: int) -> bool:
        """Mark a worker dead (its current pid's late heartbeats are ignored); False if unknown."""
        w = self.workers.get((role, index))
        if w is None:
            return False
        if w.pid is not None:
            w.dead_pids.add(w.pid)
        w.state = "dead"
        return True

    def expired(self, now: float | None = None) -> list[tuple[str, int]]:
        """Workers that were up but sent no heartbeat within the timeout (hung or gone)."""
        now = self._clock() if now is None else now
        return [key for key, w in self.workers.items()
                if w.state not in ("dead", "starting") and not w.alive(now, self.timeout_s)]

    def coming_back(self, role: str) -> bool:
        """Whether a worker of ``role`` that is not ready now will be without anyone's help: it is restarting,
        loading or being synced (not stale: that one waits for the trainer)."""
        return any(r == role and not w.missing and (w.state in ("dead", "starting", "loading") or w.syncing)
                   for (r, _), w in self.workers.items())

    def pick(self, role: str) -> WorkerState:
        """Least outstanding work among ready instances; ties broken round-robin."""
        now = self._clock()
        ready = [w for (r, _), w in self.workers.items() if r == role and w.ready(now, self.timeout_s)]
        if not ready:
            raise EngineError(503, "unavailable", f"no ready {role} worker", role, "")
        low = min(w.outstanding for w in ready)
        ties = [w for w in ready if w.outstanding == low]
        return ties[next(self._rr[role]) % len(ties)]

    def reserve(self, roles: Iterable[str] = ROLES, samples: int = 1) -> dict[str, WorkerState]:
        """One instance per role for a new request, each counted as holding its ``samples`` until
        :meth:`release` (the least loaded is the one with the fewest samples in flight)."""
        chosen = {role: self.pick(role) for role in roles}
        for w in chosen.values():
            w.outstanding += samples
        return chosen

    def release(self, chosen: dict[str, WorkerState], samples: int = 1) -> None:
        for w in chosen.values():
            w.outstanding -= samples

    def health(self) -> tuple[bool, list[dict]]:
        """Whether every worker is ready (or asleep on purpose), and one ``/health`` row per worker in pipeline
        order."""
        now = self._clock()
        ordered = sorted(self.workers.items(), key=lambda kv: (ROLES.index(kv[0][0]), kv[0][1]))
        rows = [self._row(w, now) for _, w in ordered]
        return all(r["state"] in ("ready", "sleeping") for r in rows), rows

    def _row(self, w: WorkerState, now: float) -> dict:
        return {
            "role": w.spec.role,
            "index": w.spec.index,
            "device": w.spec.device,
            "devices": w.spec.devices or [w.spec.device],  # a multi-device denoise worker: every rank's
            "ulysses": w.spec.ulysses,
            "ring": w.spec.ring,
            "cfg_parallel": w.spec.cfg_parallel,
            "pid": w.pid,
            "endpoint": w.spec.endpoint,
            "node": w.spec.node,  # the Ray node id (launch.py --ray); empty on one host
            "socket_type": "PULL",
            "state": w.reported_state(now, self.timeout_s),
            "outstanding": w.outstanding,
            "weights": "stale" if w.missing else "current",
            "missing": sorted(w.missing),
            "seconds_since_heartbeat": None if w.last_seen is None else round(now - w.last_seen, 3),
            "cuda_ipc": dict(w.cuda_ipc),
            "shm": dict(w.shm),
        }
