"""Starts the worker processes, watches them, and restarts one that dies.

A restarted worker binds the same endpoint, so its peers' sockets reconnect
by themselves. ``on_exit`` is told at once (from the watch thread) so the
router can fail the requests that died with the process instead of waiting
for a timeout.

A stop is no crash. Once the engine begins to stop (:meth:`Supervisor.begin_stop`: the launcher got SIGTERM
or SIGINT, which a terminal's Ctrl-C or a container's stop sends the workers too), a worker that exits is
logged as stopped and not restarted. A worker that exits 0 was told to stop: the supervisor waits
``CLEAN_EXIT_SETTLE_S`` for the engine's stop (the signal may reach the launcher's handler after the worker
has gone) before it takes the exit as a worker stopped alone, and starts it again.

Processes are local children by default; ``spawn`` starts them elsewhere
(``launch.py --ray``: on Ray nodes) and returns anything with the part of
:class:`subprocess.Popen` used here (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``).
"""

from __future__ import annotations

import logging
import math
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
CLEAN_EXIT_SETTLE_S = 2.0  # how long a worker that exited 0 waits to be part of the engine's stop
Key = tuple[str, int]  # (role, index)


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
        self.stop_begun = threading.Event()  # the engine stops: a worker that exits is not restarted
        self.stopping = threading.Event()  # stop() runs: the watch ends
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

    def begin_stop(self) -> None:
        """The engine begins to stop: workers that exit from now on stop with it (no error, no restart)."""
        self.stop_begun.set()

    def _watch(self) -> None:
        due: dict[Key, float] = {}  # dead workers waiting for their restart time (inf: none)
        settling: dict[Key, float] = {}  # workers that exited 0, until they are part of a stop or CLEAN_EXIT_SETTLE_S
        while not self.stopping.wait(POLL_S):
            with self._lock:
                for w in self.config.workers:
                    key = (w.role, w.index)
                    proc = self.procs[key]
                    if key not in due and key not in settling and proc.poll() is not None:
                        if self.on_exit is not None:
                            self.on_exit(w.role, w.index, proc.returncode)
                        if self.stop_begun.is_set() or proc.returncode == 0:
                            settling[key] = time.monotonic() + CLEAN_EXIT_SETTLE_S
                        else:
                            due[key] = self._crashed(key, proc)
                    if key in settling and (self.stop_begun.is_set() or time.monotonic() >= settling[key]):
                        del settling[key]
                        due[key] = self._stopped(key, proc)
                    if key in due and time.monotonic() >= due[key] and not self.stop_begun.is_set():
                        del due[key]
                        self._restart(w, due)

    def _crashed(self, key: Key, proc: Any) -> float:
        """A worker that died on its own: an error; when to start it again (with backoff if it died quickly)."""
        log.error("%s worker %d (pid %d) exited with code %s", *key, proc.pid, proc.returncode)
        if not self.restart:
            return math.inf
        quick = time.monotonic() - self.started_at[key] < QUICK_DEATH_S
        backoff = min(MAX_BACKOFF_S, self._backoff.get(key, 0.5) * 2) if quick else 0.0
        self._backoff[key] = backoff if quick else 0.5
        return time.monotonic() + backoff

    def _stopped(self, key: Key, proc: Any) -> float:
        """A worker that was told to stop: part of the engine's stop (never restarted), or stopped alone while
        the engine runs (started again at once)."""
        if self.stop_begun.is_set():
            log.info("%s worker %d (pid %d) stopped with the engine (code %s)", *key, proc.pid, proc.returncode)
            return math.inf
        log.warning("%s worker %d (pid %d) stopped (code 0) while the engine runs", *key, proc.pid)
        return time.monotonic() if self.restart else math.inf

    def _restart(self, w: WorkerSpec, due: dict[Key, float]) -> None:
        key = (w.role, w.index)
        try:
            self._spawn(w)
        except Exception as e:  # e.g. no Ray node has the worker's resources yet: try again
            log.error("could not restart %s worker %d: %s", *key, e)
            self._backoff[key] = min(MAX_BACKOFF_S, self._backoff.get(key, 0.5) * 2)
            due[key] = time.monotonic() + self._backoff[key]
            return
        self.restarts[key] = self.restarts.get(key, 0) + 1
        log.warning("restarted %s worker %d as pid %d", *key, self.procs[key].pid)

    def stop(self, grace_s: float = 10.0) -> None:
        self.stop_begun.set()
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
