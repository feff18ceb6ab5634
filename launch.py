"""Bring a whole disaggregated topology up: workers as child processes plus the router.

    python launch.py [--model DIR|tiny|tiny-alt|tiny-moe] [--topology SPEC] [--host H] [--port P] [--dtype D]

Each worker is its own OS process with an ``ipc://`` input socket in a private
runtime directory; the router (HTTP front door) runs in this process. Ctrl-C
or SIGTERM stops everything; a child that dies is reported.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import uvicorn

from common.config import DTYPE_CHOICES, EngineConfig, Limits
from common.tiny_model import SPECS, ensure_tiny_model
from common.topology import parse_topology
from router.app import create_app

ROOT = Path(__file__).resolve().parent
log = logging.getLogger("disagg.launch")


def parse_args(argv=None) -> argparse.Namespace:
    d = Limits()
    p = argparse.ArgumentParser(description="Serve a Wan model as a disaggregated encoder/denoise/decode pipeline.")
    p.add_argument("--model", default="tiny", help="diffusers Wan directory, or a built-in tiny model: " + ", ".join(SPECS))
    p.add_argument("--topology", default="encoder=1,denoise=1,decode=1", help="ROLE=N,... or a YAML/JSON file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", choices=sorted(DTYPE_CHOICES), default=None, help="default: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--runtime-dir", default=None, help="where ipc sockets and the config go (default: a fresh temp dir)")
    p.add_argument("--max-height", type=int, default=d.max_height)
    p.add_argument("--max-width", type=int, default=d.max_width)
    p.add_argument("--max-num-frames", type=int, default=d.max_num_frames)
    p.add_argument("--max-steps", type=int, default=d.max_steps)
    p.add_argument("--max-n", type=int, default=d.max_n, help="most samples one request may ask for")
    p.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s, help="seconds before a request gets 504")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for every worker to load")
    return p.parse_args(argv)


def resolve_model(name: str) -> Path:
    return ensure_tiny_model(name) if name in SPECS else Path(name).resolve()


class Supervisor:
    """Starts the worker processes and reports any that exits unexpectedly."""

    def __init__(self, config: EngineConfig, config_path: Path):
        self.config, self.config_path = config, config_path
        self.procs: dict[tuple[str, int], subprocess.Popen] = {}
        self.stopping = threading.Event()

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        for w in self.config.workers:
            cmd = [sys.executable, "-m", f"{w.role}_worker", "--config", str(self.config_path), "--index", str(w.index)]
            self.procs[(w.role, w.index)] = subprocess.Popen(cmd, cwd=ROOT, env=env)
        threading.Thread(target=self._watch, name="supervisor", daemon=True).start()

    def _watch(self) -> None:
        reported = set()
        while not self.stopping.wait(0.5):
            for key, proc in self.procs.items():
                if proc.poll() is not None and key not in reported:
                    reported.add(key)
                    log.error("%s worker %d (pid %d) exited with code %s", *key, proc.pid, proc.returncode)

    def stop(self, grace_s: float = 10.0) -> None:
        self.stopping.set()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(url: str, timeout_s: float, supervisor: Supervisor, server: uvicorn.Server) -> None:
    import json

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not supervisor.stopping.is_set():
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                body = json.loads(r.read())
            break
        except Exception:
            time.sleep(0.25)
    else:
        if not supervisor.stopping.is_set():
            log.error("workers not ready within %.0fs; stopping", timeout_s)
            server.should_exit = True
        return
    rows = [("ROLE", "IDX", "DEVICE", "PID", "ENDPOINT", "STATE")]
    rows += [(w["role"], str(w["index"]), w["device"], str(w["pid"]), w["endpoint"], w["state"]) for w in body["workers"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(n) for c, n in zip(r, widths)) for r in rows)
    print(f"\n{table}\n\ndisagg-diffusion serving {body['model']} at {url}\n", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=os.environ.get("DISAGG_LOG_LEVEL", "INFO"), format="%(asctime)s launch %(levelname)s %(message)s")
    model = resolve_model(args.model)
    own_runtime = args.runtime_dir is None
    runtime = Path(args.runtime_dir or tempfile.mkdtemp(prefix="disagg-"))
    runtime.mkdir(parents=True, exist_ok=True)
    os.chmod(runtime, 0o700)  # ipc sockets are files: keep other users out
    config = EngineConfig(
        model=str(model),
        workers=parse_topology(args.topology, runtime),
        router_endpoint=f"ipc://{runtime / 'router.sock'}",
        runtime_dir=str(runtime),
        dtype=args.dtype,
        limits=Limits(
            max_height=args.max_height,
            max_width=args.max_width,
            max_num_frames=args.max_num_frames,
            max_steps=args.max_steps,
            max_n=args.max_n,
            max_prompt_chars=args.max_prompt_chars,
            request_timeout_s=args.request_timeout,
        ),
    )
    config_path = runtime / "engine.json"
    config.save(config_path)
    supervisor = Supervisor(config, config_path)
    server = uvicorn.Server(uvicorn.Config(create_app(config), host=args.host, port=args.port, log_level="warning"))
    # uvicorn re-raises the signal that stopped it once it has shut down; with
    # these handlers in place that lands here instead of killing the process
    # before the workers are stopped below.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    supervisor.start()
    url = f"http://{args.host}:{args.port}"
    threading.Thread(target=_wait_ready, args=(url, args.ready_timeout, supervisor, server), daemon=True).start()
    try:
        server.run()
    finally:
        supervisor.stop()
        if own_runtime:
            shutil.rmtree(runtime, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
