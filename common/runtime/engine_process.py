"""Run a whole engine (``launch.py`` and its workers) as a child process.

Used by the tests, the benchmarks and the examples: start a topology on a free
loopback port, wait until ``/health`` says every worker is ready, stop it and
everything it started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcess:
    def __init__(self, model: str = "tiny", topology: str = "encoder=1,denoise=1,decode=1",
                 extra: list[str] | None = None, workdir: str | Path | None = None, ready_timeout_s: float = 300,
                 env: dict[str, str] | None = None, port: int | None = None, own_data_dir: bool = True):
        """``env``: variables added to the launcher's environment (e.g. ``DISAGG_API_KEY``); ``port``: the
        one to serve on (default: a free one); ``own_data_dir=False``: launch.py's default data dir."""
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="disagg-engine-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.workdir / "engine.log"
        self.runtime = self.workdir / "rt"
        extra = list(extra or [])
        if own_data_dir and not any(a == "--data-dir" or a.startswith("--data-dir=") for a in extra):
            extra += ["--data-dir", str(self.workdir / "jobs")]  # never another engine's, nor the user's
        cmd = [sys.executable, str(ROOT / "launch.py"), "--model", model, "--topology", topology,
               "--port", str(self.port), "--runtime-dir", str(self.runtime), *extra]
        self._log = open(self.log_path, "wb")
        # Own session: a stop can reach every descendant even if the launcher is gone.
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **(env or {})})
        self.http = httpx.Client(base_url=self.url, timeout=600)
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:  # Ctrl-C or a timeout while waiting: the engine has its own session, so stop it
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited early:\n{self.log()}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"engine not ready in {timeout_s}s:\n{self.log()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log(self) -> str:
        return self.log_text()[-5000:]

    def worker_pids(self) -> list[int]:
        return [w["pid"] for w in self.http.get("/health").json()["workers"] if w["pid"]]

    def stop(self, timeout_s: float = 30) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
