"""A multi-device denoise worker's processes: the leader starts its followers, joins their group, watches them.

The leader is the worker the supervisor started (rank 0, the ZeroMQ socket,
the requests); it starts one follower process per further device
(``python -m denoise_worker.follower``), and all of them meet in a
torch.distributed group (NCCL on GPUs, gloo on CPUs) through a file in the
private runtime directory. Any death takes the whole worker down, so that the
supervisor restarts it as it restarts any worker and the router answers the
requests it held: a follower that exits makes the leader exit at once (a
watch thread), and a leader that exits takes its followers with it (the
kernel's parent-death signal, and a check of the parent).
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from common.config.engine import CONFIG_NAME, EngineConfig, WorkerSpec
from common.runtime.supervisor import ROOT, child_env

log = logging.getLogger("disagg.ranks")

# A follower waits for the leader's next call for as long as the engine is idle: no practical limit.
# (A follower that dies is noticed by the watch thread, not by a timeout.)
GROUP_TIMEOUT = datetime.timedelta(days=7)
WATCH_S = 0.2
FOLLOWER_DIED = 70  # the leader's exit code when a follower died


def rendezvous(config: EngineConfig, spec: WorkerSpec) -> str:
    return str(Path(config.runtime_dir) / f"denoise-{spec.index}.ranks")


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def join_group(config: EngineConfig, spec: WorkerSpec, rank: int) -> None:
    """This rank into its worker's group (every rank calls it; the leader first removes a stale file)."""
    dist.init_process_group(backend_for(spec.devices[rank]), init_method=f"file://{rendezvous(config, spec)}",
                            rank=rank, world_size=spec.ranks, timeout=GROUP_TIMEOUT)


class FollowerProcesses:
    """The leader's followers: started before the leader loads its model (they load meanwhile)."""

    def __init__(self, config: EngineConfig, spec: WorkerSpec):
        self.config, self.spec = config, spec
        self.procs: list[subprocess.Popen] = []
        self._stopping = threading.Event()

    def start(self) -> None:
        Path(rendezvous(self.config, self.spec)).unlink(missing_ok=True)  # a file store must start empty
        env = child_env()
        config_path = str(Path(self.config.runtime_dir) / CONFIG_NAME)
        for rank in range(1, self.spec.ranks):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "denoise_worker.follower", "--config", config_path,
                 "--index", str(self.spec.index), "--rank", str(rank)], cwd=ROOT, env=env))
        threading.Thread(target=self._watch, name="followers", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_S):
            for p in self.procs:
                if p.poll() is not None and not self._stopping.is_set():
                    self.abandon(f"follower pid {p.pid} exited with code {p.returncode}")

    def abandon(self, why: str) -> None:
        """The group cannot go on (a rank died, or a forward failed half-way through its collectives): the
        whole worker exits, and the supervisor restarts it; the router answers the requests it held."""
        log.error("%s: the worker stops, to be restarted whole", why)
        self.kill()
        os._exit(FOLLOWER_DIED)  # not sys.exit: the leader may be inside a collective that will never finish

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def stop(self, say_stop: Callable[[], None], grace_s: float = 10.0) -> None:
        """Tell the followers to leave (``say_stop``: the leader's stop call), kill those that do not."""
        self._stopping.set()  # first: their exit is expected now
        say_stop()
        for p in self.procs:
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def die_with_parent() -> None:
    """On a follower: the kernel kills it when the leader dies (Linux), and a thread checks besides."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    parent = os.getppid()

    def check() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            threading.Event().wait(1.0)

    threading.Thread(target=check, name="parent", daemon=True).start()
