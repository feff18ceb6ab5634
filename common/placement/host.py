"""What runs on a Ray node for one worker (``launch.py --ray``): a host that owns the worker's process.

Ray places one :class:`WorkerHost` actor in each worker's placement-group bundle. On its node it makes
everything that belongs to that node only: a private runtime directory (0700), the worker's CURVE key pair
(the secret goes into a 0600 file there and never leaves the node; only the public key is returned), and
the port the worker's socket will bind, picked on the node's own address. Then it runs exactly the local
launcher's worker command (``python -m <role>_worker``) as its child and reports when it exits.

The worker is a process the actor owns, not the worker loop inside the actor: it is then the same program
as on one host (its signal handlers, its threads, its follower processes, torch's process-wide settings),
and when it crashes (a segfault, the OOM killer) the host survives to report it and start it again in
place, on the same port with the same key, so no peer has anything to learn.
"""

from __future__ import annotations

import os
import shutil
import stat
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import msgspec

from common.config.engine import CONFIG_NAME, EngineConfig
from common.config.topology import free_tcp_port
from common.runtime.supervisor import start_local
from common.transport.security import KEY_DIR, fresh_key_dir, new_key_pair
from common.builtin import BUILTINS, ensure_builtin


class Placement(msgspec.Struct):
    """Where a host put its worker: the facts the launcher writes into the engine config."""

    node: str  # the Ray node id
    ip: str  # the node's address: the worker's socket binds it, the others connect to it
    port: int
    public_key: str  # z85; empty without CURVE
    secret_file: str  # the path of the secret key file on that node; empty without CURVE


class WorkerHost:
    def __init__(self, engine: str, role: str, index: int, curve: bool):
        self.role, self.index = role, index
        # Every host of one engine on this machine under one parent, which close() removes: that also takes
        # the directory of a host whose actor died here (its key no longer admitted anywhere).
        self.engine_dir = Path(tempfile.gettempdir()) / f"disagg-ray-{engine}"
        self.engine_dir.mkdir(mode=0o700, exist_ok=True)
        st = self.engine_dir.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PermissionError(f"{self.engine_dir} is not a private directory of this user")
        self.runtime = Path(tempfile.mkdtemp(prefix=f"{role}-{index}-", dir=self.engine_dir))  # mode 0700
        self.public, self.secret_file = "", ""
        if curve:
            self.public, self.secret_file = new_key_pair(fresh_key_dir(self.runtime / KEY_DIR), f"{role}-{index}")
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def place(self) -> bytes:
        import ray

        ip = ray.util.get_node_ip_address()
        placement = Placement(node=ray.get_runtime_context().get_node_id(), ip=ip, port=free_tcp_port(ip),
                              public_key=self.public, secret_file=self.secret_file)
        return msgspec.json.encode(placement)

    def start(self, config_json: bytes, model_name: str) -> int:
        """Start the worker from the engine config (this node's runtime dir in it); returns its pid."""
        config = msgspec.json.decode(config_json, type=EngineConfig)
        model = Path(config.model)
        if model_name in BUILTINS:
            model = ensure_builtin(model_name)  # generated on this node, the same seeded weights
        elif not model.is_dir():
            raise FileNotFoundError(f"model directory {model} is not on this node (every node needs it at the "
                                    "same path, e.g. on shared storage)")
        config = msgspec.structs.replace(config, runtime_dir=str(self.runtime), model=str(model))
        path = self.runtime / CONFIG_NAME
        config.save(path)
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                raise RuntimeError(f"{self.role} worker {self.index} is still running (pid {self._proc.pid})")
            self._proc = start_local(path, config.worker(self.role, self.index))
            return self._proc.pid

    def wait(self, pid: int) -> int:
        """Blocks until process ``pid`` (started here) exits; its exit code."""
        proc = self._proc
        if proc is None or proc.pid != pid:
            raise ValueError(f"no process {pid} started by this host")
        return proc.wait()

    def signal(self, pid: int, signum: int) -> None:
        proc = self._proc
        if proc is not None and proc.pid == pid and proc.poll() is None:
            proc.send_signal(signum)

    def close(self, grace_s: float = 10.0) -> None:
        """Stop the worker if it still runs; remove the engine's runtime dirs on this node (secret keys too)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.engine_dir, ignore_errors=True)
