"""Starts the worker processes, watches them, and restarts one that dies.

A restarted worker binds the same endpoint, so its peers' sockets reconnect
by themselves. ``on_exit`` is told at once (from the watch thread) so the
router can fail the requests that died with the process instead of waiting
for a timeout.

Processes are local children by default; ``spawn`` starts them elsewhere
(``launch.py --ray``: on Ray nodes) and returns anything with the part of
:class:`subprocess.Popen` used here (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from common.config.engine import EngineConfig, WorkerSpec

log = logging.getLogger("disagg.supervisor")

ROOT = Path(__file__).resolve().parents[2]


def child_env() -> dict[str, str]:
    """The environment a worker process starts with: this one, with the repository first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def worker_command(config_path: str | Path, w: WorkerSpec) -> list[str]:
    return [sys.executable, "-m", f"{w.role}_worker", "--config", str(config_path), "--index", str(w.index)]


def start_local(config_path: str | Path, w: WorkerSpec) -> subprocess.Popen:
    return subprocess.Popen(worker_command(config_path, w), cwd=ROOT, env=child_env())


POLL_S = 0.1
QUICK_DEATH_S = 10.0  # a worker that dies this soon after starting is restarted with backoff
MAX_BACKOFF_S = 30.0


class Supervisor:
    def __init__(self, config: EngineConfig, config_path: Path, restart: bool = True,
                 on_exit: Callable[[str, int, int | None], None] | None = None,
                 spawn: Callable[[WorkerSpec], Any] | None = None):
        self.config, self.config_path = config, config_path
        self.restart = restart
        self.on_exit = on_exit
        self.spawn = spawn or (lambda w: start_local(config_path, w))
        self.procs: dict[tuple[str, int], Any] = {}
        self.started_at: dict[tuple[str, int], float] = {}
        self.restarts: dict[tuple[str, int], int] = {}
        self._backoff: dict[tuple[str, int], float] = {}
        self.stopping = threading.Event()
        self._lock = threading.Lock()

    def _spawn(self, w: WorkerSpec) -> None:
        key = (w.role, w.index)
        self.procs[key] = self.spawn(w)
        self.started_at[key] = time.monotonic()

    def start(self) -> None:
        for w in self.config.workers:
            self._spawn(w)
        threading.Thread(target=self._watch, name="supervisor", daemon=True).start()

    def pids(self) -> dict[tuple[str, int], int]:
        return {k: p.pid for k, p in self.procs.items()}

    def _watch(self) -> None:
        due: dict[tuple[str, int], float] = {}  # dead workers waiting for their restart time
        while not self.stopping.wait(POLL_S):
            with self._lock:
                for w in self.config.workers:
                    key = (w.role, w.index)
                    proc = self.procs[key]
                    if key not in due and proc.poll() is not None:
                        log.error("%s worker %d (pid %d) exited with code %s", *key, proc.pid, proc.returncode)
                        if self.on_exit is not None:
                            self.on_exit(w.role, w.index, proc.returncode)
                        if not self.restart:
                            due[key] = float("inf")
                            continue
                        quick = time.monotonic() - self.started_at[key] < QUICK_DEATH_S
                        backoff = min(MAX_BACKOFF_S, self._backoff.get(key, 0.5) * 2) if quick else 0.0
                        self._backoff[key] = backoff if quick else 0.5
                        due[key] = time.monotonic() + backoff
                    if key in due and time.monotonic() >= due[key] and not self.stopping.is_set():
                        del due[key]
                        try:
                            self._spawn(w)
                        except Exception as e:  # e.g. no Ray node has the worker's resources yet: try again
                            log.error("could not restart %s worker %d: %s", *key, e)
                            self._backoff[key] = min(MAX_BACKOFF_S, self._backoff.get(key, 0.5) * 2)
                            due[key] = time.monotonic() + self._backoff[key]
                            continue
                        self.restarts[key] = self.restarts.get(key, 0) + 1
                        log.warning("restarted %s worker %d as pid %d", *key, self.procs[key].pid)

    def stop(self, grace_s: float = 10.0) -> None:
        self.stopping.set()
        with self._lock:
            procs = list(self.procs.values())
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
