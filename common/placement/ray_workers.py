"""The launcher's side of ``launch.py --ray``: one placement-group bundle per worker, a host in each.

:class:`RayWorkers` reserves the bundles (each worker's CPUs, GPUs and custom resources), puts a
:class:`~common.placement.host.WorkerHost` actor in each, and writes where they landed (node, address,
port, public key) into the engine config. Its :meth:`RayWorkers.spawn` is the supervisor's way to start a
worker, so watching and restarting stay the supervisor's, as on one host. A host whose node (or actor) died
is replaced in the same bundle, which Ray moves to a node that has the resources; the worker then has a new
address and key, and ``on_moved`` tells the router, which tells the other workers.
"""

from __future__ import annotations

import logging
import os
import subprocess
import uuid
from collections.abc import Callable

import msgspec

from common.config.engine import EngineConfig, WorkerSpec
from common.config.topology import free_tcp_port
from common.placement.host import Placement, WorkerHost
from common.transport.security import ROUTER, fresh_key_dir, key_dir, new_key_pair, process_name

log = logging.getLogger("disagg.ray")

HOST_LOST = -1  # the exit code reported for a worker whose host (its actor, or its node) is gone
CALL_TIMEOUT_S = 120.0
INSTALL_HINT = "--ray needs Ray: pip install -e '.[ray]'"


def import_ray():
    try:
        import ray
    except ImportError:
        raise SystemExit(f"launch.py: error: {INSTALL_HINT}") from None
    return ray


def gpus_of(w: WorkerSpec) -> int:
    return len({d for d in (w.devices or [w.device]) if d.startswith("cuda")})


def bundle(w: WorkerSpec) -> dict[str, float]:
    """The resources a worker's bundle reserves: its threads as CPUs, its GPUs, its custom resources."""
    gpus = gpus_of(w)
    return {"CPU": float(w.threads or 1), **({"GPU": float(gpus)} if gpus else {}), **w.resources}


def on_its_gpus(w: WorkerSpec) -> WorkerSpec:
    """Ray gives a host exactly its bundle's GPUs (``CUDA_VISIBLE_DEVICES``): there, they are ``cuda:0..n-1``."""
    n = gpus_of(w)
    if not n:
        return w
    devices = [f"cuda:{i}" for i in range(n)] if w.devices else []
    return msgspec.structs.replace(w, device="cuda:0", devices=devices)


def _placed(w: WorkerSpec, p: Placement) -> WorkerSpec:
    return msgspec.structs.replace(on_its_gpus(w), endpoint=f"tcp://{p.ip}:{p.port}", host=p.ip, node=p.node)


class RemoteProcess:
    """A worker's process on a Ray node, seen through its host with the part of Popen the supervisor uses."""

    def __init__(self, ray, host, pid: int, name: str, on_lost: Callable[[], None]):
        self._ray, self.host, self.pid, self.name = ray, host, pid, name
        self.on_lost = on_lost
        self.returncode: int | None = None
        self._exit = host.wait.remote(pid)

    def _settle(self, ref) -> int:
        try:
            self.returncode = self._ray.get(ref)
        except self._ray.exceptions.RayActorError as e:
            log.error("%s: its host is gone (its node or actor died): %s", self.name, type(e).__name__)
            self.returncode = HOST_LOST
            self.on_lost()
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _ = self._ray.wait([self._exit], timeout=0)
            if ready:
                self._settle(ready[0])
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            ready, _ = self._ray.wait([self._exit], timeout=timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.name, timeout)
            self._settle(ready[0])
        return self.returncode

    def send_signal(self, signum: int) -> None:
        try:
            self._ray.get(self.host.signal.remote(self.pid, int(signum)), timeout=CALL_TIMEOUT_S)
        except self._ray.exceptions.RayError:
            pass  # a host that is gone has no process left to signal

    def kill(self) -> None:
        self.send_signal(9)


class RayWorkers:
    def __init__(self, address: str, model_name: str, ready_timeout_s: float):
        self.ray = import_ray()
        self.model_name = model_name
        self.engine = uuid.uuid4().hex[:12]  # names this engine's directories on the nodes
        self.ready_timeout_s = ready_timeout_s
        self.config: EngineConfig | None = None
        self.curve = False
        self.hosts: dict[tuple[str, int], object] = {}
        self.pg = None
        self.on_moved: Callable[[WorkerSpec], None] | None = None
        self._lost: set[tuple[str, int]] = set()  # workers whose host is gone: their next spawn replaces it
        # DISAGG_* settings (log level, model cache) reach the hosts, hence the workers, as here.
        self._env = {k: v for k, v in os.environ.items() if k.startswith("DISAGG_")}
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # each worker's own lines, even when two say the same
        self.ray.init(address=address or None, log_to_driver=True, include_dashboard=False,
                      runtime_env={"env_vars": self._env})
        self.ip = self.ray.util.get_node_ip_address()

    # --- placement -----------------------------------------------------------
    def reserve(self, workers: list[WorkerSpec]) -> None:
        from ray.util.placement_group import placement_group

        bundles = [bundle(w) for w in workers]
        self.pg = placement_group(bundles, strategy="PACK")
        ready, _ = self.ray.wait([self.pg.ready()], timeout=self.ready_timeout_s)
        if not ready:
            raise RuntimeError(f"Ray could not reserve the workers' bundles within {self.ready_timeout_s:.0f}s: "
                               f"asked {bundles}; the cluster has {self.ray.cluster_resources()}")

    def _new_host(self, i: int, w: WorkerSpec):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        b = bundle(w)
        host_cls = self.ray.remote(WorkerHost)
        return host_cls.options(
            num_cpus=b["CPU"], num_gpus=b.get("GPU", 0), resources=w.resources, max_concurrency=8,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
        ).remote(self.engine, w.role, w.index, self.curve)

    def _place(self, host) -> Placement:
        ref = host.place.remote()
        ready, _ = self.ray.wait([ref], timeout=self.ready_timeout_s)
        if not ready:
            raise RuntimeError(f"a worker's host did not start within {self.ready_timeout_s:.0f}s")
        return msgspec.json.decode(self.ray.get(ref), type=Placement)

    def place(self, config: EngineConfig, curve: bool) -> EngineConfig:
        """Reserve, start a host per worker, and return ``config`` with where each worker runs (and its key)."""
        self.curve = curve
        self.reserve(config.workers)
        self.hosts = {(w.role, w.index): self._new_host(i, w) for i, w in enumerate(config.workers)}
        placements = {key: self._place(h) for key, h in self.hosts.items()}
        workers = [_placed(w, placements[(w.role, w.index)]) for w in config.workers]
        public, files = {}, {}
        if curve:  # the router's key here; each worker's was made on its node
            public[ROUTER], files[ROUTER] = new_key_pair(fresh_key_dir(key_dir(config)), ROUTER)
            for (role, index), p in placements.items():
                public[process_name(role, index)], files[process_name(role, index)] = p.public_key, p.secret_file
        self.config = msgspec.structs.replace(
            config, workers=workers, router_endpoint=f"tcp://{self.ip}:{free_tcp_port(self.ip)}",
            curve_public=public, curve_secret_files=files)
        return self.config

    def _replace_host(self, w: WorkerSpec):
        """A new host for ``w`` in its bundle (which Ray has moved off a dead node); ``w`` learns where."""
        key = (w.role, w.index)
        i = self.config.workers.index(w)
        try:
            self.ray.kill(self.hosts[key])
        except Exception:
            pass
        host = self.hosts[key] = self._new_host(i, w)
        p = self._place(host)
        placed = _placed(w, p)
        w.endpoint, w.host, w.node = placed.endpoint, placed.host, placed.node
        if self.curve:
            name = process_name(w.role, w.index)
            self.config.curve_public[name], self.config.curve_secret_files[name] = p.public_key, p.secret_file
        log.warning("%s worker %d moved to node %s at %s", w.role, w.index, w.node, w.endpoint)
        if self.on_moved is not None:
            self.on_moved(w)
        return host

    # --- the supervisor's spawn ------------------------------------------------
    def spawn(self, w: WorkerSpec) -> RemoteProcess:
        key = (w.role, w.index)
        host = self.hosts[key]
        if key in self._lost:
            host = self._replace_host(w)
            self._lost.discard(key)
        ref = host.start.remote(msgspec.json.encode(self.config), self.model_name)
        try:
            pid = self.ray.get(ref, timeout=CALL_TIMEOUT_S)
        except self.ray.exceptions.RayActorError:
            self._lost.add(key)  # the host died before it could start the worker: the next spawn replaces it
            raise
        return RemoteProcess(self.ray, host, pid, process_name(*key), on_lost=lambda: self._lost.add(key))

    def close(self, grace_s: float = 10.0) -> None:
        """Remove every host's runtime dir (stopping what still runs), the hosts and the bundles."""
        refs = [h.close.remote(grace_s) for h in self.hosts.values()]
        self.ray.wait(refs, num_returns=len(refs), timeout=grace_s + 5)
        for h in self.hosts.values():
            self.ray.kill(h)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
        self.ray.shutdown()
