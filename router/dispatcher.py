"""The router's ZeroMQ side: worker registry, admission routing, result join.

One PULL socket receives heartbeats from every worker and final results or
errors from the last stage of each request. Requests enter the pipeline
through a PUSH socket per encoder. Tensors never pass through the router on
their way between stages; it only sees each request's final output.
"""

from __future__ import annotations

import asyncio
import json
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch
import zmq
import zmq.asyncio

from common.config.engine import EngineConfig, WorkerSpec
from common.protocol.messages import (
    PROTOCOL_VERSION,
    ROLES,
    ControlReply,
    ControlRequest,
    EncodeRequest,
    ErrorReply,
    GenerationParams,
    Heartbeat,
    Progress,
    Result,
    Route,
)
from common.transport.security import ROUTER, Security, bind_pull, connect_push
from common.transport.shm import ShmContext
from common.protocol.codec import WireError, decode, encode

log = logging.getLogger("disagg.router")


class EngineError(Exception):
    """A request failed; carries what the HTTP error body reports."""

    def __init__(self, status: int, type_: str, message: str, stage: str, request_id: str,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.stage, self.request_id = status, type_, message, stage, request_id
        self.headers = headers or {}


@dataclass
class WorkerState:
    spec: WorkerSpec
    state: str = "starting"
    pid: int | None = None
    last_seen: float | None = None
    outstanding: int = 0
    dead_pids: set[int] = field(default_factory=set)
    cuda_ipc: dict[str, int] = field(default_factory=lambda: {"sent": 0, "received": 0})

    def alive(self, timeout_s: float) -> bool:
        return self.last_seen is not None and time.monotonic() - self.last_seen < timeout_s

    def ready(self, timeout_s: float) -> bool:
        return self.state == "ready" and self.alive(timeout_s)


@dataclass
class Pending:
    future: asyncio.Future
    route: Route | None
    uses_decode: bool = True
    done_stage: int = -1  # index in ROLES of the last stage that handed the request on
    target: tuple[str, int] | None = None  # control requests: the one worker asked

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
    tensors: dict[str, torch.Tensor]  # "output" plus any rollout tensors
    timings: dict[str, float]
    info: dict
    route: Route | None


class Dispatcher:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.workers = {(w.role, w.index): WorkerState(w) for w in config.workers}
        self.pending: dict[str, Pending] = {}
        self._ctx = zmq.asyncio.Context()
        self.security = Security.load(config, ROUTER)  # CURVE keys on tcp topologies
        self.shm = ShmContext(config, ROUTER)  # results' large tensors arrive in /dev/shm (ipc); clears leftovers
        self._pull: zmq.asyncio.Socket | None = None
        self._encoders: dict[int, zmq.asyncio.Socket] = {}
        self._control: dict[tuple[str, int], zmq.asyncio.Socket] = {}
        self._task: asyncio.Task | None = None
        self._rr = itertools.count()
        self.weight_version = 0
        self.n_train = 1000  # flow-match training steps; read from the model's scheduler config at start
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task | None = None

    # --- lifecycle ---------------------------------------------------------
    async def start(self) -> None:
        sched_cfg = json.loads((Path(self.config.model) / "scheduler" / "scheduler_config.json").read_text())
        self.n_train = int(sched_cfg.get("num_train_timesteps", 1000))
        self._pull = bind_pull(self._ctx, self.config.router_endpoint, self.security, linger=0,
                               maxmsgsize=self.config.limits.max_message_bytes)
        for w in self.config.of_role("encoder"):
            self._encoders[w.index] = connect_push(self._ctx, w.endpoint, self.security, linger=0)
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._receive_loop())
        self._watchdog = asyncio.create_task(self._watch_heartbeats())

    async def stop(self) -> None:
        for task in (self._task, self._watchdog):
            if task:
                task.cancel()
        for p in self.pending.values():
            if not p.future.done():
                p.future.set_exception(EngineError(503, "shutting_down", "engine is shutting down", "router", ""))
        for s in [*self._encoders.values(), *self._control.values(), self._pull]:
            if s is not None:
                s.close()
        self.security.close()  # the ZAP handler's sockets must close before the context terminates
        self._ctx.term()

    # --- worker registry ---------------------------------------------------
    def health(self) -> tuple[bool, list[dict]]:
        timeout = self.config.heartbeat_timeout_s
        now = time.monotonic()
        rows = []
        for (role, index), w in sorted(self.workers.items(), key=lambda kv: (ROLES.index(kv[0][0]), kv[0][1])):
            if w.state == "dead":
                state = "dead"
            else:
                state = w.state if w.alive(timeout) else ("starting" if w.last_seen is None else "lost")
            rows.append(
                {
                    "role": role,
                    "index": index,
                    "device": w.spec.device,
                    "pid": w.pid,
                    "endpoint": w.spec.endpoint,
                    "socket_type": "PULL",
                    "state": state,
                    "outstanding": w.outstanding,
                    "seconds_since_heartbeat": None if w.last_seen is None else round(now - w.last_seen, 3),
                    "cuda_ipc": dict(w.cuda_ipc),
                }
            )
        return all(r["state"] == "ready" for r in rows), rows

    def _pick(self, role: str) -> WorkerState:
        """Least outstanding work among ready instances; ties broken round-robin."""
        ready = [w for (r, _), w in self.workers.items() if r == role and w.ready(self.config.heartbeat_timeout_s)]
        if not ready:
            raise EngineError(503, "unavailable", f"no ready {role} worker", role, "")
        low = min(w.outstanding for w in ready)
        ties = [w for w in ready if w.outstanding == low]
        return ties[next(self._rr) % len(ties)]

    def _on_heartbeat(self, hb: Heartbeat) -> None:
        w = self.workers.get((hb.role, hb.index))
        if w is None:
            log.warning("heartbeat from unknown worker %s-%d ignored", hb.role, hb.index)
            return
        if hb.pid in w.dead_pids:
            return  # a heartbeat the dead process sent before it died
        if w.pid is not None and hb.pid != w.pid and w.state != "dead":
            # A new process on this endpoint: whatever the old one held is gone.
            self.worker_lost(hb.role, hb.index, f"replaced by pid {hb.pid}")
        if w.state == "dead" and hb.state == "ready":
            log.info("%s worker %d is back (pid %d)", hb.role, hb.index, hb.pid)
        w.state, w.pid, w.last_seen = hb.state, hb.pid, time.monotonic()
        w.cuda_ipc = {"sent": hb.cuda_ipc_sent, "received": hb.cuda_ipc_received}

    def worker_lost(self, role: str, index: int, reason: str) -> None:
        """Fail at once every request still in (or queued for) this worker; stop routing to it."""
        w = self.workers.get((role, index))
        if w is None:
            return
        if w.pid is not None:
            w.dead_pids.add(w.pid)
        w.state = "dead"
        failed = 0
        for rid, p in list(self.pending.items()):
            if p.waits_on(role, index) and not p.future.done():
                p.future.set_exception(
                    EngineError(503, "worker_lost", f"{role} worker {index} {reason}", role, rid)
                )
                failed += 1
        log.error("%s worker %d %s; failed %d in-flight request(s)", role, index, reason, failed)

    def notify_exit(self, role: str, index: int, returncode: int | None) -> None:
        """Thread-safe: the supervisor saw a worker process exit."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.worker_lost, role, index, f"exited with code {returncode}")

    async def _watch_heartbeats(self) -> None:
        """A worker that stops heartbeating (hung or gone) is treated as lost."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            for (role, index), w in self.workers.items():
                if w.state not in ("dead", "starting") and not w.alive(self.config.heartbeat_timeout_s):
                    self.worker_lost(role, index, f"sent no heartbeat for {self.config.heartbeat_timeout_s}s")

    # --- requests ----------------------------------------------------------
    def admit(self, count: int) -> None:
        """Refuse work beyond the bound instead of queueing without limit."""
        if self.draining:
            raise EngineError(503, "shutting_down", "engine is shutting down", "router", "")
        limit = self.config.limits.max_pending
        if len(self.pending) + count > limit:
            raise EngineError(429, "overloaded", f"{len(self.pending)} requests in flight (limit {limit})",
                              "router", "", headers={"Retry-After": "1"})

    async def submit(self, params: GenerationParams, request_id: str | None = None,
                     timeout_s: float | None = None) -> Outcome:
        rid = request_id or uuid.uuid4().hex
        timeout_s = timeout_s or self.config.limits.request_timeout_s
        chosen = {role: self._pick(role) for role in ROLES}
        route = Route(**{role: w.spec.index for role, w in chosen.items()})
        fut = asyncio.get_running_loop().create_future()
        pending = Pending(fut, route, uses_decode=params.output_type != "latent")
        self.pending[rid] = pending
        for w in chosen.values():
            w.outstanding += 1
        try:
            params = msgspec.structs.replace(params, deadline=time.time() + timeout_s)
            msg = EncodeRequest(v=PROTOCOL_VERSION, request_id=rid, route=route, params=params)
            await self._encoders[route.encoder].send_multipart(encode(msg), copy=False)
            return await asyncio.wait_for(fut, timeout=timeout_s)
        except asyncio.TimeoutError:
            raise EngineError(
                504, "timeout", f"no answer within {timeout_s}s (request was in {pending.where()})",
                pending.where(), rid,
            ) from None
        finally:
            self.pending.pop(rid, None)
            for w in chosen.values():
                w.outstanding -= 1

    async def control(self, role: str, op: str, **fields) -> list[ControlReply | EngineError]:
        """Send one control request to every instance of ``role``; each answer or error, by index."""
        loop = asyncio.get_running_loop()
        waits = []
        for w in self.config.of_role(role):
            rid = f"ctl-{uuid.uuid4().hex}"
            fut = loop.create_future()
            self.pending[rid] = Pending(fut, None, target=(w.role, w.index))
            sock = self._control_socket(w)
            msg = ControlRequest(v=PROTOCOL_VERSION, request_id=rid, op=op, **fields)
            await sock.send_multipart(encode(msg), copy=False)
            waits.append((rid, fut))
        out: list[ControlReply | EngineError] = []
        for rid, fut in waits:
            try:
                out.append(await asyncio.wait_for(fut, timeout=self.config.limits.request_timeout_s))
            except EngineError as e:
                out.append(e)
            except asyncio.TimeoutError:
                out.append(EngineError(504, "timeout", f"no answer to {op}", role, rid))
            finally:
                self.pending.pop(rid, None)
        return out

    def _control_socket(self, w: WorkerSpec) -> zmq.asyncio.Socket:
        key = (w.role, w.index)
        sock = self._control.get(key)
        if sock is None:
            sock = connect_push(self._ctx, w.endpoint, self.security, linger=0)
            self._control[key] = sock
        return sock

    def _resolve(self, msg: Result | ErrorReply | ControlReply, tensors: dict[str, torch.Tensor]) -> None:
        p = self.pending.get(msg.request_id)
        if p is None or p.future.done():
            log.warning("answer for unknown or finished request %s dropped", msg.request_id)
            return
        if isinstance(msg, ErrorReply):
            p.future.set_exception(EngineError(msg.status, msg.type, msg.message, msg.stage, msg.request_id))
        elif isinstance(msg, ControlReply):
            p.future.set_result(msg)
        elif "output" not in tensors:
            p.future.set_exception(EngineError(502, "bad_result", "result without output", msg.stage, msg.request_id))
        else:
            p.future.set_result(Outcome(tensors, dict(msg.timings), dict(msg.info), p.route))

    async def _receive_loop(self) -> None:
        assert self._pull is not None
        while True:
            frames = await self._pull.recv_multipart(copy=False)
            try:
                msg, tensors = decode(frames, shm=self.shm.receiver)
            except WireError as e:
                log.warning("dropped bad message at router: %s", e)
                continue
            if isinstance(msg, Heartbeat):
                self._on_heartbeat(msg)
            elif isinstance(msg, Progress):
                p = self.pending.get(msg.request_id)
                if p is not None and msg.stage in ROLES:
                    p.done_stage = max(p.done_stage, ROLES.index(msg.stage))
            elif isinstance(msg, (Result, ErrorReply, ControlReply)):
                self._resolve(msg, tensors)
            else:
                log.warning("router does not take %s messages", type(msg).__name__)
