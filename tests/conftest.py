"""Fixtures that start real engines (launch.py in a child process) on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.tiny_model import ensure_tiny_model  # noqa: E402

READY_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """One running topology: ``python launch.py ...`` plus its workers."""

    def __init__(self, tmp: Path, model: str, topology: str, extra: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "engine.log"
        self.runtime = tmp / "rt"
        cmd = [sys.executable, str(ROOT / "launch.py"), "--model", model, "--topology", topology,
               "--port", str(self.port), "--runtime-dir", str(self.runtime), *(extra or [])]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.http = httpx.Client(base_url=self.url, timeout=300)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited early:\n{self.log()}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"engine not ready in {READY_TIMEOUT_S}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_text()[-5000:]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_pids(self) -> list[int]:
        return [w["pid"] for w in self.http.get("/health").json()["workers"] if w["pid"]]

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return ensure_tiny_model("tiny")


@pytest.fixture(scope="session")
def alt_dir() -> Path:
    return ensure_tiny_model("tiny-alt")


@pytest.fixture(scope="module")
def engine_factory(tmp_path_factory):
    started: list[Engine] = []

    def start(model: str = "tiny", topology: str = "encoder=1,denoise=1,decode=1", extra=None) -> Engine:
        e = Engine(tmp_path_factory.mktemp("engine"), model, topology, extra)
        started.append(e)
        return e

    yield start
    for e in started:
        e.stop()


_PIPES: dict[str, object] = {}


def diffusers_pipe(model_dir: Path):
    """diffusers' own WanPipeline on the same directory, cached per directory."""
    from diffusers import WanPipeline

    key = str(model_dir)
    if key not in _PIPES:
        _PIPES[key] = WanPipeline.from_pretrained(model_dir, dtype=torch.float32)
        _PIPES[key].set_progress_bar_config(disable=True)
    return _PIPES[key]


def diffusers_generate(model_dir: Path, *, prompt, seed, height, width, num_frames, num_inference_steps,
                       guidance_scale, negative_prompt="", output_type="np", sigmas=None, guidance_scale_2=None):
    """Reference output; custom sigmas go to the pipeline's own scheduler as diffusers would take them."""
    import numpy as np

    pipe = diffusers_pipe(model_dir)
    original = pipe.scheduler.set_timesteps
    if sigmas is not None:
        pipe.scheduler.set_timesteps = lambda n, device=None: original(
            sigmas=np.asarray(sigmas, dtype=np.float64), device=device)
    try:
        kw = {} if guidance_scale_2 is None else {"guidance_scale_2": guidance_scale_2}
        out = pipe(prompt=prompt, negative_prompt=negative_prompt, height=height, width=width,
                   num_frames=num_frames, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                   generator=torch.Generator("cpu").manual_seed(seed), output_type=output_type, **kw).frames
    finally:
        pipe.scheduler.set_timesteps = original
    if output_type == "np":
        return torch.from_numpy(out[0])
    return out[0]
