"""The worker loop every stage shares: receive, validate, process, forward.

:class:`WorkerRuntime` owns the sockets around one :class:`~common.runtime.stage.Stage`:
it binds the stage's PULL input, pushes results to the next stage or to the
router, turns every failure into an :class:`ErrorReply` for that request, and
heartbeats to the router from a separate thread so that a long forward pass
does not look like a dead worker.
"""

from __future__ import annotations

import argparse
import collections
import functools
import logging
import os
import signal
import threading
import time
from typing import Any

import torch
import zmq

from common.config.engine import EngineConfig, worker_threads
from common.families import family_of
from common.protocol.contracts import WireContract
from common.protocol.codec import WireError, decode, encode
from common.protocol.control import CONTROL_REQUESTS, ControlRequest, ReleaseMemory, kind_of
from common.protocol.errors import Cancelled, DeadlineExceeded, Sleeping, check_deadline
from common.protocol.messages import (
    PROTOCOL_VERSION,
    REQUEST_KINDS,
    ROLES,
    Cancel,
    ErrorReply,
    Heartbeat,
    PeerMoved,
    Progress,
)
from common.runtime.exit_now import exit_now
from common.runtime.peak_memory import PeakMemory
from common.runtime.stage import Forward, Stage
from common.transport.cuda_ipc import CudaIpcContext
from common.transport.security import ROUTER, Security, bind_pull, connect_push, process_name
from common.transport.shm import ShmContext

log = logging.getLogger("disagg.worker")

POLL_MS = 100
# Fault injection for tests and bench/chaos.py: "<role>:<text>" makes that role's workers exit at once on a
# request whose prompt contains the text, as a worker that a particular input crashes would (a poison request).
FAULT_ENV = "DISAGG_FAULT_EXIT_ON_PROMPT"
FAULT_EXIT_CODE = 86
MAX_DRAIN = 256


class WorkerRuntime:
    def __init__(self, stage: Stage):
        self.stage = stage
        self.config = stage.config
        self.spec = stage.spec
        self.open_transport()
        self.state = "loading"
        self._stop = threading.Event()
        self._controls: collections.deque[tuple[ControlRequest, dict]] = collections.deque()
        self._held: collections.deque = collections.deque()
        self._push: dict[str, zmq.Socket] = {}
        self._parent = os.getppid()
        role, _, text = os.environ.get(FAULT_ENV, "").partition(":")
        self._exit_on = text if role == self.spec.role and text else None
        self.memory_meter = PeakMemory(self.spec.device)
        self._peaks: dict[str, int] = {}  # the requests held: the highest peak of the work done while held

    # --- sockets -----------------------------------------------------------
    def open_transport(self) -> None:
        """The worker's links: ZeroMQ sockets, shared memory and CUDA IPC for large tensors (an in-process worker,
        local_engine/, has none)."""
        self.ctx = zmq.Context.instance()
        self.security = Security.load(self.config, process_name(self.spec.role, self.spec.index))
        self.shm = ShmContext(self.config, process_name(self.spec.role, self.spec.index))  # clears leftovers for us
        self.cuda_ipc = CudaIpcContext(self.config, self.spec)  # GPU worker to GPU worker: tensors stay on GPUs

    def _push_socket(self, endpoint: str) -> zmq.Socket:
        sock = self._push.get(endpoint)
        if sock is None:
            sock = connect_push(self.ctx, endpoint, self.security, linger=2000)
            self._push[endpoint] = sock
        return sock

    def _endpoint_for(self, fwd: Forward) -> str:
        if fwd.to == "router":
            return self.config.router_endpoint
        index = getattr(fwd.msg.route, fwd.to)
        return self.config.worker(fwd.to, index).endpoint

    def send(self, fwd: Forward) -> None:
        endpoint = self._endpoint_for(fwd)  # first: a route outside the topology fails before any segment exists
        index = None if fwd.to == "router" else getattr(fwd.msg.route, fwd.to)
        dest = ROUTER if index is None else process_name(fwd.to, index)
        frames = encode(fwd.msg, fwd.tensors, shm=self.shm.sender(dest),  # large tensors: /dev/shm (ipc)
                        cuda=self.cuda_ipc.sender(fwd.to, index))  # CUDA tensors to a GPU worker: CUDA IPC
        self._push_socket(endpoint).send_multipart(frames, copy=False)

    def reply_error(self, request_id: str, exc: BaseException, status: int | None = None) -> None:
        err = ErrorReply(
            v=PROTOCOL_VERSION,
            request_id=request_id,
            stage=self.stage.role,
            type=getattr(exc, "error_type", None) or type(exc).__name__,
            message=str(exc) or type(exc).__name__,
            status=status or getattr(exc, "status", 500),
        )
        self.send(Forward("router", err))

    # --- heartbeats --------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        # sndhwm: stale heartbeats are worthless; never queue many
        sock = connect_push(self.ctx, self.config.router_endpoint, self.security, linger=0, sndhwm=4)
        try:
            while not self._stop.is_set():
                try:
                    sock.send_multipart(encode(self.heartbeat()), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
                if os.getppid() != self._parent:  # launcher gone: do not linger as an orphan
                    log.error("parent process exited; stopping")
                    self._stop.set()
                self._stop.wait(self.config.heartbeat_interval_s)
        finally:
            sock.close()

    def heartbeat(self) -> Heartbeat:
        shm = self.shm.counts()  # read from another thread: plain ints, a heartbeat may lag by one
        return Heartbeat(v=PROTOCOL_VERSION, request_id="", role=self.stage.role, index=self.spec.index,
                         pid=os.getpid(), device=self.spec.device, endpoint=self.spec.endpoint, socket_type="PULL",
                         state=self.state, cuda_ipc_sent=self.cuda_ipc.sent, cuda_ipc_received=self.cuda_ipc.received,
                         shm_sent=shm["sent"], shm_received=shm["received"])

    # --- main loop ---------------------------------------------------------
    @functools.cached_property
    def contract(self) -> WireContract:
        """The tensor contracts of this worker's family: what its messages may carry beside the shared tensors."""
        return family_of(self.config.model).contract

    def handle(self, frames: list[Any]) -> None:
        try:
            msg, tensors = decode(frames, shm=self.shm.receiver, cuda=self.cuda_ipc.receiver, contract=self.contract)
        except WireError as e:
            log.warning("dropped bad message: %s", e)
            if e.request_id:
                self.reply_error(e.request_id, e, status=400)
            return
        self.take(msg, tensors)

    def take(self, msg: Any, tensors: dict[str, torch.Tensor]) -> None:
        """A message that arrived: a request (admitted, or held until there is room or a control is applied), a
        control, a cancel."""
        expected = REQUEST_KINDS[self.stage.role]
        if isinstance(msg, PeerMoved):
            self.move_peer(msg)
            return
        if isinstance(msg, Cancel):
            self.cancel(msg)
            return
        if isinstance(msg, CONTROL_REQUESTS):
            if self.stage.applies_between_steps(msg) or (isinstance(msg, ReleaseMemory) and msg.abort):
                self.handle_control(msg, tensors)  # here, between two steps of the stage's work
            else:
                self._controls.append((msg, tensors))  # applied when no request is in flight
            return
        if not isinstance(msg, expected):
            log.warning("dropped %s message: this worker takes %s", type(msg).__name__, expected.__name__)
            if msg.request_id:
                err = WireError(f"{self.stage.role} worker does not take {type(msg).__name__} messages")
                self.reply_error(msg.request_id, err, status=400)
            return
        if self._controls or self._held or not self.stage.can_accept():
            # A weight update waits for a quiet moment, and so do these; or the stage is full. Held here, not
            # left on the socket, so that a cancel behind them is read at once.
            self._held.append((msg, tensors))
            return
        self.admit(msg, tensors)

    def admit(self, msg: Any, tensors: dict[str, torch.Tensor]) -> None:
        if self._exit_on and self._exit_on in msg.params.prompt:
            log.error("exiting on request %s: its prompt contains $%s's text", msg.request_id, FAULT_ENV)
            os._exit(FAULT_EXIT_CODE)
        try:
            check_deadline(msg.params)
            if self.stage.memory is not None and self.stage.memory.asleep:  # never a result from missing weights
                raise Sleeping(f"the {self.stage.role} worker's weights are released; resume_memory_occupation "
                               "wakes it")
            self.stage.accept(msg, tensors)
            self._peaks[msg.request_id] = 0
        except Exception as e:  # refused at the door (bad tensors, scheduler rebuild, deadline)
            self.finish(msg, e)

    def finish(self, msg: Any, outcome: "Forward | BaseException") -> None:
        """Send a request's result on (and tell the router it moved), or answer its failure."""
        peak = self._peaks.pop(msg.request_id, 0)
        if isinstance(outcome, DeadlineExceeded):
            log.info("request %s dropped in %s: deadline passed", msg.request_id, self.stage.role)
            return
        if isinstance(outcome, Cancelled):  # asked for: one line, no traceback
            log.info("request %s cancelled in %s", msg.request_id, self.stage.role)
            self.reply_error(msg.request_id, outcome)
            return
        if isinstance(outcome, BaseException):  # any failure answers this request; the worker lives on
            log.error("request %s failed in %s: %s: %s", msg.request_id, self.stage.role,
                      type(outcome).__name__, outcome, exc_info=outcome)
            self.reply_error(msg.request_id, outcome)
            return
        if hasattr(outcome.msg, "peak_memory"):  # the earlier stages' peaks, then this one's
            outcome.msg.peak_memory = {**getattr(msg, "peak_memory", {}), **outcome.msg.peak_memory,
                                       self.stage.role: peak}
        try:
            self.send(outcome)
            if outcome.to != "router":
                done = Progress(v=PROTOCOL_VERSION, request_id=msg.request_id, stage=self.stage.role)
                self.send(Forward("router", done))
        except Exception as e:
            log.exception("request %s failed in %s: could not send it on", msg.request_id, self.stage.role)
            self.reply_error(msg.request_id, e)

    def cancel(self, msg: Cancel) -> None:
        """Let go of the request if this worker holds it (waiting for a control, or in the stage); else pass the
        cancel on to the next stage of its route, behind the request on the same socket."""
        held = next((item for item in self._held if item[0].request_id == msg.request_id), None)
        if held is not None:
            self._held.remove(held)
            self.finish(held[0], Cancelled(f"request cancelled while waiting in the {self.stage.role} worker"))
            return
        let_go = self.stage.cancel(msg.request_id, msg.partial)
        if let_go is not None:
            self.finish(*let_go)
            return
        later = ROLES[ROLES.index(self.stage.role) + 1:]
        # Past the denoise worker a request has all its steps: a partial cancel lets its whole answer come.
        if later and (later[0] != "decode" or msg.decode and not msg.partial):
            try:
                self.send(Forward(later[0], msg))
            except Exception:  # e.g. a route outside the topology: nothing of the request can be there
                log.warning("could not pass the cancel of %s on to the %s worker", msg.request_id, later[0])

    def move_peer(self, msg: PeerMoved) -> None:
        """Another worker was replaced elsewhere: send to it there (a fresh socket), admit its new key."""
        if self.config.transport != "tcp":
            log.warning("dropped PeerMoved message: workers move only in tcp topologies (launch.py --ray)")
            return
        try:
            peer = self.config.worker(msg.role, msg.index)
        except KeyError:
            log.warning("dropped PeerMoved message: no %s worker %d in this topology", msg.role, msg.index)
            return
        old = self._push.pop(peer.endpoint, None)
        if old is not None:
            old.close(linger=0)  # what it still queued was for the dead process
        peer.endpoint, peer.host, peer.node = msg.endpoint, msg.endpoint[6:].rsplit(":", 1)[0], msg.node
        self.security.move(process_name(msg.role, msg.index), msg.endpoint, msg.public_key)
        log.info("%s worker %d moved to %s", msg.role, msg.index, msg.endpoint)

    def handle_control(self, msg: ControlRequest, tensors: dict[str, torch.Tensor]) -> None:
        """The stage's handler for the message's kind answers it; a failure, or a kind the stage does not
        handle, is answered with an error."""
        try:
            reply = self.stage.control(msg, tensors)
        except Exception as e:
            log.exception("%s %s failed", kind_of(msg), msg.request_id)
            self.reply_error(msg.request_id, e)
            return
        self.send(Forward("router", reply))

    def step(self, pull: zmq.Socket, poller: zmq.Poller) -> None:
        """One turn of the loop: take what has arrived, apply controls when quiet, advance held work."""
        self.receive(pull, poller)
        self.apply_controls_when_quiet()
        self.admit_held()
        self.advance()

    def receive(self, pull: zmq.Socket, poller: zmq.Poller) -> None:
        """Everything already queued on the socket, so that it can join the next batch."""
        waiting = self.stage.has_work() or self._controls or self._held
        if not poller.poll(0 if waiting else POLL_MS):
            if not waiting:
                self.stage.idle()
            return
        for _ in range(MAX_DRAIN):
            try:
                frames = pull.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self.handle(frames)

    def apply_controls_when_quiet(self) -> None:
        """Between requests: nothing in flight here, so an update never lands inside one."""
        if not self._controls or self.stage.has_work():
            return
        while self._controls:
            self.handle_control(*self._controls.popleft())

    def admit_held(self) -> None:
        """The held requests, in order, while the stage has room and no control waits."""
        while self._held and not self._controls and self.stage.can_accept():
            self.admit(*self._held.popleft())

    def advance(self) -> None:
        if self.stage.has_work():
            done = self._measured_work()
            for notice in self.stage.notices():  # first: a request's last streamed sample before its answer
                try:
                    self.send(notice)
                except Exception:  # a notice is informative: losing one fails nothing
                    log.debug("could not send a notice", exc_info=True)
            for msg, outcome in done:
                self.finish(msg, outcome)
            if not self.stage.has_work():
                self._peaks.clear()  # nothing held (requests a release dropped included)

    def _measured_work(self) -> list:
        """One turn of the stage's work; every request held during it gets the turn's peak memory if higher
        than its own so far (a denoise request: the highest of the turns from its arrival to its last step)."""
        self.memory_meter.reset()
        done = self.stage.work()
        peak = self.memory_meter.read()
        for request_id, before in self._peaks.items():
            self._peaks[request_id] = max(before, peak)
        return done

    def stop(self) -> None:
        """Leave the loop after the current turn (signal handlers call this)."""
        self._stop.set()

    def run(self) -> None:
        pull = bind_pull(self.ctx, self.spec.endpoint, self.security, linger=0,
                         maxmsgsize=self.config.limits.max_message_bytes)
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        t0 = time.perf_counter()
        self.stage.load()
        self.state = "ready"
        log.info("ready on %s in %.1fs", self.spec.endpoint, time.perf_counter() - t0)
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                self.step(pull, poller)
        finally:
            self._stop.set()
            self.stage.close()
            hb.join(timeout=2)
            pull.close()
            for s in self._push.values():
                s.close()
            self.security.close()


def main(stage_cls: type[Stage]) -> None:
    """Entry point of ``python -m <role>_worker --config FILE --index N``."""
    p = argparse.ArgumentParser(description=f"disagg-diffusion {stage_cls.role} worker")
    p.add_argument("--config", required=True, help="engine config JSON written by launch.py")
    p.add_argument("--index", type=int, required=True, help="this worker's index within its role")
    args = p.parse_args()
    config = EngineConfig.load(args.config)
    spec = config.worker(stage_cls.role, args.index)
    logging.basicConfig(
        level=os.environ.get("DISAGG_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {stage_cls.role}-{spec.index} %(levelname)s %(message)s",
    )
    # Progress bars from weight loading would interleave across processes.
    import diffusers.utils.logging as dlog
    import transformers.utils.logging as tlog

    dlog.disable_progress_bar()
    tlog.disable_progress_bar()
    torch.set_num_threads(worker_threads(config, spec))
    runtime = WorkerRuntime(stage_cls(config, spec))
    signal.signal(signal.SIGTERM, lambda *_: runtime.stop())
    signal.signal(signal.SIGINT, lambda *_: runtime.stop())
    runtime.run()
    exit_now(0)  # the stage, its sockets and its threads are closed by now
