"""The router's ZeroMQ side: sockets, the receive loop, submitting requests.

One PULL socket receives heartbeats from every worker and final results or
errors from the last stage of each request. Requests enter the pipeline
through a PUSH socket per encoder. Tensors never pass through the router on
their way between stages; it only sees each request's final output.

What to do with what arrives is decided by the socket-free pieces composed
here: the :class:`~router.link.registry.WorkerRegistry`, the
:class:`~router.link.admission.Admission` bound, the :class:`~router.link.join.PendingTable`
and the control fan-out of :mod:`router.control.fanout`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
import logging
import time
import uuid

import msgspec
import torch
import zmq
import zmq.asyncio

from common.config.engine import EngineConfig, WorkerSpec
from common.protocol.codec import WireError, decode, encode
from common.protocol.contracts import SHARED, WireContract
from common.protocol.control import CONTROL_REPLIES, ControlRequest
from common.protocol.messages import (
    PROTOCOL_VERSION, ROLES, Cancel, EncodeRequest, ErrorReply, GenerationParams, Heartbeat, PeerMoved, Progress,
    Result, Route, SampleDone, StepProgress,
)
from common.transport.security import ROUTER, Security, bind_pull, connect_push, process_name
from common.transport.shm import ShmContext
from router.link.admission import Admission, shutting_down
from router.link.attempts import Versions, attempt_id, with_attempts
from router.control.fanout import Reply, fan_out
from router.core.errors import EngineError
from router.link.join import Outcome, Pending, PendingTable
from router.link.registry import WorkerRegistry

log = logging.getLogger("disagg.router")

__all__ = ["Dispatcher", "EngineError", "Outcome"]


class Dispatcher:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.registry = WorkerRegistry(config.workers, config.heartbeat_timeout_s)
        self.admission = Admission(config.limits.max_pending)
        self.pending = PendingTable()
        self._ctx: zmq.asyncio.Context | None = None  # the sockets' (start)
        self.security = Security.load(config, ROUTER)  # CURVE keys on tcp topologies
        self.shm = ShmContext(config, ROUTER)  # results' large tensors arrive in /dev/shm (ipc); clears leftovers
        self._pull: zmq.asyncio.Socket | None = None
        self._encoders: dict[int, zmq.asyncio.Socket] = {}
        self._control: dict[tuple[str, int], zmq.asyncio.Socket] = {}
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # Called for a process that replaced a worker, once it is ready, before requests are routed to it:
        # it gets what its predecessor held (the LoRA adapters; see router/control/lora.py).
        self.on_worker_back: Callable[[WorkerSpec], Awaitable[None]] | None = None
        self.workers_restart = True  # the supervisor restarts dead workers (launch.py without --no-restart)
        # Whether a request (by its client's id) was cancelled: it must not run again (router/link/cancel.py).
        self.cancelled: Callable[[str], bool] = lambda request_id: False
        # What the workers' answers may carry: the served family's contracts (set by the engine that serves it).
        self.contract: WireContract = SHARED

    # --- lifecycle ---------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pull = bind_pull(self._ctx, self.config.router_endpoint, self.security, linger=0,
                               maxmsgsize=self.config.limits.max_message_bytes)
        for w in self.config.of_role("encoder"):
            self._encoders[w.index] = connect_push(self._ctx, w.endpoint, self.security, linger=0)
        self._loop = asyncio.get_running_loop()
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._watch_heartbeats())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.pending.fail_all(shutting_down())
        for s in [*self._encoders.values(), *self._control.values(), self._pull]:
            if s is not None:
                s.close()
        self.security.close()  # the ZAP handler's sockets must close before the context terminates
        if self._ctx is not None:
            self._ctx.term()

    # --- workers -----------------------------------------------------------
    def health(self) -> tuple[bool, list[dict]]:
        return self.registry.health()

    def worker_lost(self, role: str, index: int, reason: str) -> None:
        """Fail at once every request still in (or queued for) this worker; stop routing to it."""
        if self.registry.lost(role, index):
            self._fail_requests_in(role, index, reason)

    def _fail_requests_in(self, role: str, index: int, reason: str) -> None:
        if self.admission.draining:  # the engine stops, its workers with it: what they held ends, never runs again
            failed = self.pending.fail_waiting_on(role, index, reason, type_="shutting_down")
            log.info("%s worker %d %s as the engine stops; failed %d in-flight request(s)", role, index, reason,
                     failed)
            return
        failed = self.pending.fail_waiting_on(role, index, reason)
        log.error("%s worker %d %s; failed %d in-flight request(s)", role, index, reason, failed)

    def notify_exit(self, role: str, index: int, returncode: int | None) -> None:
        """Thread-safe: the supervisor saw a worker process exit."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.worker_lost, role, index, f"exited with code {returncode}")

    def notify_moved(self, w: WorkerSpec) -> None:
        """Thread-safe: ``w`` was replaced on another node (``launch.py --ray``); its spec already says where."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: self._tasks.append(asyncio.create_task(self._moved(w))))

    async def _moved(self, w: WorkerSpec) -> None:
        name = process_name(w.role, w.index)
        public_key = self.config.curve_public.get(name, "")
        self.security.move(name, w.endpoint, public_key)
        for sock in (self._control.pop((w.role, w.index), None),
                     self._encoders.pop(w.index, None) if w.role == "encoder" else None):
            if sock is not None:
                sock.close(linger=0)
        if w.role == "encoder":
            self._encoders[w.index] = connect_push(self._ctx, w.endpoint, self.security, linger=0)
        moved = PeerMoved(v=PROTOCOL_VERSION, request_id="", role=w.role, index=w.index, endpoint=w.endpoint,
                          public_key=public_key, node=w.node)
        for peer in self.config.workers:  # a peer that is down gets it when it is back (the socket queues)
            if peer is not w:
                await self._send_control(peer, moved, None)

    async def _watch_heartbeats(self) -> None:
        """A worker that stops heartbeating (hung or gone) is treated as lost."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            for role, index in self.registry.expired():
                self.worker_lost(role, index, f"sent no heartbeat for {self.config.heartbeat_timeout_s}s")

    # --- requests ----------------------------------------------------------
    def admit(self, count: int) -> None:
        """Refuse work beyond the bound (``count`` samples more) instead of queueing without limit."""
        self.admission.check(self.pending.samples, count)

    async def submit(self, params: GenerationParams, request_id: str | None = None,
                     timeout_s: float | None = None, versions: Versions | None = None,
                     images: dict[str, torch.Tensor] | None = None,
                     on_sample: Callable[[int, Outcome], None] | None = None) -> Outcome:
        """One request, its ``params.n`` samples as one unit through the stages; its answer. A worker that dies
        holding it makes it run again (router/link/attempts.py): ``outcome.info["attempts"]`` says how many runs.
        ``images``: an image-to-video request's pixels (``image``, ``last_image``), sent to the encoder;
        ``on_sample``: a streaming request's samples as each is decoded (any run's: a re-run repeats them)."""
        rid = request_id or uuid.uuid4().hex
        timeout_s = timeout_s or self.config.limits.request_timeout_s
        params = msgspec.structs.replace(params, deadline=time.time() + timeout_s)
        admitted = versions() if versions is not None and params.rollout is not None else None

        def unchanged() -> None:  # a rollout that waited for sleeping workers must not run on other weights
            if admitted is not None and (now := versions()) != admitted:
                raise EngineError(409, "weights_changed", f"the weights or adapter changed while this rollout "
                                  f"waited (versions {admitted} -> {now}); it is not run on other weights",
                                  "router", rid)

        base = self._wire_base(rid)
        try:
            outcome, attempts = await with_attempts(
                lambda attempt: self._attempt(params, base, attempt, timeout_s, images or {}, unchanged, rid,
                                              on_sample),
                rid, self.config.limits.max_attempts, versions, rollout=params.rollout is not None,
                cancelled=lambda: self.cancelled(rid))
        except EngineError as e:
            e.request_id = e.request_id and rid  # the client's id, not a run's wire id
            raise
        outcome.info["attempts"] = attempts
        return outcome

    def _wire_base(self, request_id: str) -> str:
        """The id a request's runs travel under (``<id>``, then ``<id>.2``, ...): its client's, unless a run of that
        id ended unanswered (cancelled, 504) while its late answers may still come; then ``<id>~k``."""
        base, k, attempts = request_id, 0, range(1, self.config.limits.max_attempts + 1)
        while any(self.pending.fenced(attempt_id(base, a)) for a in attempts):
            k += 1
            base = f"{request_id}~{k}"
        return base

    async def _attempt(self, params: GenerationParams, request_id: str, attempt: int, timeout_s: float,
                       images: dict[str, torch.Tensor], unchanged: Callable[[], None], client_id: str,
                       on_sample: Callable[[int, Outcome], None] | None = None) -> Outcome:
        rid = attempt_id(request_id, attempt)
        chosen = await self._reserve(params)
        try:
            unchanged()
        except EngineError:
            self.registry.release(chosen, params.n)
            raise
        route = Route(**{"decode": 0, **{role: w.spec.index for role, w in chosen.items()}})
        future = asyncio.get_running_loop().create_future()
        pending = self.pending.add(rid, Pending(future, route, uses_decode=params.output_type != "latent",
                                                samples=params.n, client_id=client_id, on_sample=on_sample))
        try:
            msg = EncodeRequest(v=PROTOCOL_VERSION, request_id=rid, route=route, params=params)
            await self.to_encoder(route.encoder, msg, images)
            return await asyncio.wait_for(future, timeout=max(0.0, params.deadline - time.time()))
        except asyncio.CancelledError:  # cancelled (router/link/cancel.py): the workers drop it too
            self._send_cancel(rid, pending)
            raise
        except asyncio.TimeoutError:
            self.pending.fence(rid)  # the workers drop it at its deadline; a late answer is not this id's
            raise EngineError(
                504, "timeout", f"no answer within {timeout_s}s (request was in {pending.where()})",
                pending.where(), request_id,
            ) from None
        finally:
            self.pending.discard(rid)
            self.registry.release(chosen, params.n)

    def cancel_partial(self, client_id: str) -> bool:
        """Ask the workers holding request ``client_id`` for what it has so far (a rollout's steps done: the
        denoise worker answers with them; elsewhere it is dropped, 499); False when no run of it is out."""
        run = self.pending.latest(client_id)
        if run is None or run[1].future.done():
            return False
        self._send_cancel(*run, partial=True)
        return True

    def _send_cancel(self, rid: str, p: Pending, partial: bool = False) -> None:
        """A ``Cancel`` for run ``rid`` to its encoder, on the socket its request went by (it cannot overtake
        it); each stage passes it on behind the request. Unless ``partial``, its answers are no longer awaited."""
        if not partial:
            self.pending.fence(rid)
        self.cancel_to_encoder(p.route.encoder,
                               Cancel(v=PROTOCOL_VERSION, request_id=rid, route=p.route, decode=p.uses_decode,
                                      partial=partial))

    # --- what goes to the workers: the only socket writes (an in-process link, local_engine/, replaces them) ----
    async def to_encoder(self, index: int, msg: EncodeRequest, tensors: dict[str, torch.Tensor]) -> None:
        frames = encode(msg, tensors, shm=self.shm.sender(process_name("encoder", index)))
        await self._encoders[index].send_multipart(frames, copy=False)

    def cancel_to_encoder(self, index: int, msg: Cancel) -> None:
        """Without waiting: on the socket its request went by, so that it cannot overtake it."""
        sock = self._encoders.get(index)
        if sock is None:
            return
        sent = sock.send_multipart(encode(msg), copy=False)
        sent.add_done_callback(lambda f: f.cancelled() or f.exception() is None
                               or log.warning("could not send the cancel of %s: %s", msg.request_id, f.exception()))

    async def _reserve(self, params: GenerationParams):
        """A ready instance of each role the request needs (a latent answer skips the decode worker). While
        a role has none but one of its workers is on its way back (restarting, loading, syncing, asleep),
        wait for it up to ``--worker-wait`` seconds within the request's deadline; else 503 ``unavailable``
        (``sleeping``) at once."""
        give_up = min(params.deadline, time.time() + self.config.limits.worker_wait_s)
        roles = ROLES if params.output_type != "latent" else tuple(r for r in ROLES if r != "decode")
        while True:
            try:
                return self.registry.reserve(roles, params.n)
            except EngineError as e:
                asleep = self.registry.asleep(e.stage)
                returns = asleep or self.workers_restart and self.registry.coming_back(e.stage)
                if time.time() >= give_up or not returns:
                    if asleep:
                        raise EngineError(503, "sleeping", f"the {e.stage} workers' weights are released "
                                          "(release_memory_occupation); resume_memory_occupation wakes them",
                                          e.stage, "") from None
                    raise
                await asyncio.sleep(0.05)

    async def control(self, role: str, kind: type[ControlRequest], tensors: dict | None = None,
                      only: WorkerSpec | None = None, timeout_s: float | None = None, **fields) -> list[Reply]:
        """Send one control message of ``kind`` with ``fields`` (and ``tensors``) to every instance of ``role``
        (or ``only`` that one); each answer or error, waited for ``timeout_s`` (default: the request timeout)."""
        workers = [only] if only is not None else self.config.of_role(role)
        return await fan_out(workers, kind, fields, self.pending, self._send_control,
                             timeout_s or self.config.limits.request_timeout_s, tensors)

    async def _send_control(self, w: WorkerSpec, msg: ControlRequest | PeerMoved, tensors: dict | None) -> None:
        key = (w.role, w.index)
        sock = self._control.get(key)
        if sock is None:
            sock = self._control[key] = connect_push(self._ctx, w.endpoint, self.security, linger=0)
        frames = encode(msg, tensors, shm=self.shm.sender(process_name(w.role, w.index)))  # large: /dev/shm
        await sock.send_multipart(frames, copy=False)

    # --- receiving -----------------------------------------------------------
    async def _receive_loop(self) -> None:
        assert self._pull is not None
        while True:
            frames = await self._pull.recv_multipart(copy=False)
            try:
                msg, tensors = decode(frames, shm=self.shm.receiver, contract=self.contract)
            except WireError as e:
                log.warning("dropped bad message at router: %s", e)
                if e.request_id:
                    self.pending.reject(e.request_id, str(e))
                continue
            self._dispatch(msg, tensors)

    async def _sync(self, w) -> None:
        try:
            if self.on_worker_back is not None:
                await self.on_worker_back(w.spec)
        except Exception:
            log.exception("could not give %s worker %d what its predecessor held", w.spec.role, w.spec.index)
        finally:
            w.syncing = False

    def _dispatch(self, msg, tensors) -> None:
        if isinstance(msg, Heartbeat):
            replaced = self.registry.heartbeat(msg)
            if replaced is not None:
                self._fail_requests_in(msg.role, msg.index, replaced)
            w = self.registry.workers.get((msg.role, msg.index))
            if w is not None and self.registry.take_new_ready(w):
                self._tasks.append(asyncio.create_task(self._sync(w)))
        elif isinstance(msg, Progress):
            self.pending.progress(msg)
        elif isinstance(msg, StepProgress):
            self.pending.step_progress(msg)
        elif isinstance(msg, SampleDone):
            self.pending.sample_done(msg, tensors)
        elif isinstance(msg, (Result, ErrorReply, *CONTROL_REPLIES)):
            self.pending.resolve(msg, tensors)
        else:
            log.warning("router does not take %s messages", type(msg).__name__)
