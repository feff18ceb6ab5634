"""Bring a whole disaggregated topology up: workers as child processes plus the router.

    python launch.py [--model DIR|tiny|tiny-sd3|...] [--topology SPEC] [--host H] [--port P] [--dtype D]
                     [--ray [ADDRESS]]

Each worker is its own OS process with an ``ipc://`` input socket in a private runtime directory; the router
(HTTP front door) runs in this process. Ctrl-C or SIGTERM stops everything (workers that exit with it are no
crash); a child that dies is reported and restarted. With ``--ray`` the workers run on the nodes of a Ray
cluster instead (common/placement/), linked by tcp + CURVE; the router stays here.

The HTTP port is bound first, so a taken one ends the launcher at once in one
line; then it says which model it loads and how many workers it starts, and
logs ``stopped: all workers exited`` once everything is down.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import uvicorn

from common.config.engine import CONFIG_NAME, DTYPE_CHOICES, EngineConfig, Limits, default_data_dir
from common.runtime.http_sockets import bind_http_or_exit
from common.runtime.memory_flags import add_memory_flags, check_memory_flags, memory_settings
from common.runtime.exit_now import exit_now
from common.runtime.supervisor import Supervisor
from common.protocol.messages import ROLES
from common.families import read_model
from common.families.checkpoints import checkpoint_problem
from common.families.layouts import layout_problem
from common.builtin import BUILTINS, ModelNotFound, resolve as resolve_builtin_or_dir
from common.diffusion.step_cache import cli_flag as cache_flag
from common.builtin.cache import cache_root
from common.transport.security import provision_curve, remove_secrets
from common.diffusion.weights import resolve_weight_roots
from common.transport.shm import DEFAULT_SPARE_BYTES, DEFAULT_THRESHOLD, engine_prefix, remove_engine_segments
from common.config.topology import TRANSPORTS, parse_topology, port_picker, router_endpoint
from router.api.app import create_app
from router.core.engine import Engine
from router.link.dispatcher import Dispatcher
from router.api.auth import ADMIN_KEY_ENV, API_KEY_ENV, keys_from_environment
from router.core.job_store import JobStore, open_or_exit as open_job_store
from router.peers.flags import add_peer_flags, peer_settings

ROOT = Path(__file__).resolve().parent
log = logging.getLogger("disagg.launch")


def _serving_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="a diffusers model directory (Wan, SD3), or a built-in random-weight model: "
                   + ", ".join(BUILTINS))
    p.add_argument("--topology", default="encoder=1,denoise=1,decode=1", help="ROLE=N,... or a YAML/JSON file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", choices=sorted(DTYPE_CHOICES), default=None, help="default: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--transformer-file", type=os.path.abspath, metavar="FILE", help="the transformer's weights from one "
                   ".safetensors or .gguf checkpoint; its config and the other components from --model")
    p.add_argument("--runtime-dir", default=None, help="where ipc sockets and the config go (default: a fresh temp dir)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run the workers on a Ray cluster: 'auto' (the cluster this node belongs to), HOST:PORT, "
                        "or no value (a local Ray); implies --transport tcp")


def _security_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", choices=TRANSPORTS, default="ipc",
                   help="ipc: one host, sockets in the 0700 runtime dir; tcp: tcp://HOST:PORT links, CURVE on")
    p.add_argument("--no-curve", action="store_true",
                   help="tcp without CURVE: anyone who reaches a port can inject messages (loopback only, unsafe)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' (visible in ps: prefer ${API_KEY_ENV})")
    p.add_argument("--admin-key", default=None, metavar="KEY",
                   help=f"key for weight updates (visible in ps: prefer ${ADMIN_KEY_ENV})")
    p.add_argument("--weight-root", action="append", default=[], metavar="DIR",
                   help="weight updates may read only below DIR (repeatable); without one, updates are refused")
    p.add_argument("--weight-sync-from-memory", action="store_true",
                   help="accept weight updates from the trainer's memory (shared memory, torch.distributed)")


def _limit_flags(p: argparse.ArgumentParser) -> None:
    d = Limits()
    p.add_argument("--max-height", type=int, default=d.max_height)
    p.add_argument("--max-width", type=int, default=d.max_width)
    p.add_argument("--max-num-frames", type=int, default=d.max_num_frames)
    p.add_argument("--max-steps", type=int, default=d.max_steps)
    p.add_argument("--max-n", type=int, default=d.max_n, help="most samples one request may ask for")
    p.add_argument("--max-jobs", type=int, default=d.max_jobs,
                   help="/v1/videos jobs held at once (queued, running or finished and not yet expired)")
    p.add_argument("--job-ttl", type=float, default=d.job_ttl_s,
                   help="seconds a finished /v1/videos job (and its MP4) is kept")
    p.add_argument("--data-dir", help="where jobs outlive a restart; one engine per dir (default: one per HOST-PORT)")
    p.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s, help="seconds before a request gets 504")
    p.add_argument("--max-attempts", type=int, default=d.max_attempts,
                   help="runs a request gets when workers die holding it (1: it fails with the worker)")
    p.add_argument("--worker-wait", type=float, default=d.worker_wait_s,
                   help="seconds a request waits for a ready worker of a role that has none (restarting)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for every worker to load")
    p.add_argument("--max-pending", type=int, default=d.max_pending, help="samples in flight before 429")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="larger request bodies get 413")
    p.add_argument("--max-image-bytes", type=int, default=d.max_image_bytes,
                   help="image-to-video: the largest encoded image (image, last_image) a request may carry")
    p.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels,
                   help="image-to-video: larger images are refused from their header, before decoding")
    p.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes,
                   help="largest ZeroMQ message part a socket accepts")
    p.add_argument("--max-loras", type=int, default=d.max_loras, help="LoRA adapters each denoise worker holds")
    p.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank, help="largest LoRA rank accepted")
    p.add_argument("--max-lora-bytes", type=int, default=d.max_lora_bytes,
                   help="largest adapter sent from memory (HTTP body of /v1/load_lora_adapter)")


def _worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-batch-size", type=int, default=8,
                   help="requests per batched forward (denoise), text-encoder call and VAE call")
    p.add_argument("--prompt-cache-bytes", type=int, default=256 << 20,
                   help="encoder: bytes of recently encoded prompts kept (0: off)")
    p.add_argument("--grace-period", type=float, default=30.0, help="seconds SIGTERM waits for in-flight requests")
    p.add_argument("--no-restart", action="store_true", help="do not restart workers that die")
    p.add_argument("--shm-threshold", type=int, default=None, metavar="BYTES",
                   help=f"ipc only: tensors of at least BYTES travel in /dev/shm instead of ZeroMQ frames "
                        f"(default {DEFAULT_THRESHOLD}; 0: off; ignored with tcp)")
    p.add_argument("--shm-spare-bytes", type=int, default=DEFAULT_SPARE_BYTES, metavar="BYTES",
                   help="per process: most bytes of shared-memory segments prepared ahead of time for tensor "
                        f"sizes sent repeatedly (default {DEFAULT_SPARE_BYTES}; 0: none)")
    p.add_argument("--compile", action="store_true",
                   help="denoise workers run each expert through torch.compile, warmed up at the model's default "
                        "request shape before they report ready")
    p.add_argument("--cache", default=None, metavar="METHOD[:THRESHOLD]", type=cache_flag,
                   help="step caching for requests that leave out cache: teacache or first_block, at THRESHOLD "
                        "(default: the method's); a request's cache (null: off) overrides it")
    p.add_argument("--no-cuda-ipc", action="store_true",
                   help="stage CUDA tensors between GPU workers through host memory instead of CUDA IPC")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Serve a diffusion model (Wan, SD3) as a disaggregated "
                                            "encoder/denoise/decode pipeline.")
    for add_flags in (_serving_flags, _security_flags, add_peer_flags, _limit_flags, _worker_flags, add_memory_flags):
        add_flags(p)
    args = p.parse_args(argv)
    if args.ray is not None:
        args.transport = "tcp"  # the workers' nodes are other machines
    for bad, why in ((args.shm_threshold is not None and args.shm_threshold < 0, "--shm-threshold must be >= 0"),
                     (args.max_attempts < 1, "--max-attempts must be >= 1"), (args.worker_wait < 0, "--worker-wait "
                     "must be >= 0"), (args.shm_spare_bytes < 0, "--shm-spare-bytes must be >= 0")):
        if bad:
            p.error(why)
    check_memory_flags(p, args)
    return args


def model_info(model: Path, transformer_file: str | None = None):
    """The model's facts (its family's binding); weights that would not load end the launcher in one line."""
    if problem := checkpoint_problem(model, transformer_file):  # an unknown pipeline class, a broken file, ...
        sys.exit(f"launch.py: error: {problem}")
    return read_model(model, transformer_file)


class EngineServer(uvicorn.Server):
    """uvicorn server that calls each ``on_shutdown_signal`` hook the moment a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, *on_shutdown_signal: Callable[[], None]):
        super().__init__(config)
        self.on_shutdown_signal = on_shutdown_signal

    def handle_exit(self, sig, frame) -> None:
        for hook in self.on_shutdown_signal:
            hook()
        super().handle_exit(sig, frame)


def _wait_ready(url: str, timeout_s: float, supervisor: Supervisor, server: uvicorn.Server) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not supervisor.stop_begun.is_set():
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                body = json.loads(r.read())
            break
        except Exception:
            time.sleep(0.25)
    else:
        if not supervisor.stop_begun.is_set():
            log.error("workers not ready within %.0fs; stopping", timeout_s)
            server.should_exit = True
        return
    rows = [("ROLE", "IDX", "DEVICE", "PID", "ENDPOINT", "NODE", "STATE")]
    rows += [(w["role"], str(w["index"]), w["device"], str(w["pid"]), w["endpoint"], w["node"][:12] or "-", w["state"])
             for w in body["workers"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(n) for c, n in zip(r, widths)) for r in rows)
    print(f"\n{table}\n\ndisagg-diffusion serving {body['model']} ({body['pipeline']}) at {url}\n", flush=True)


def engine_config(args: argparse.Namespace, model: Path, runtime: Path, weight_roots: list[str]) -> EngineConfig:
    """The configuration every process of this engine reads, from the parsed flags (before CURVE keys)."""
    shm_threshold = DEFAULT_THRESHOLD if args.shm_threshold is None else args.shm_threshold
    if args.transport != "ipc":
        if args.shm_threshold:
            log.warning("--shm-threshold is ignored with --transport %s (shared memory is same-host only)",
                        args.transport)
        shm_threshold = 0
    # With --ray the nodes pick the ports (common/placement/); until then each endpoint gets a distinct stand-in.
    pick_port = port_picker() if args.ray is None else (lambda host, n=itertools.count(1): next(n))
    return EngineConfig(
        model=str(model),
        workers=parse_topology(args.topology, runtime, args.transport, pick_port),
        router_endpoint=router_endpoint(runtime, args.transport, pick_port=pick_port),
        runtime_dir=str(runtime),
        dtype=args.dtype,
        transformer_file=args.transformer_file,
        max_batch_size=args.max_batch_size,
        prompt_cache_bytes=args.prompt_cache_bytes,
        transport=args.transport,
        shm_threshold_bytes=shm_threshold,
        shm_spare_bytes=args.shm_spare_bytes if shm_threshold else 0,
        cuda_ipc=args.transport == "ipc" and not args.no_cuda_ipc,
        weight_roots=weight_roots,
        **peer_settings(args),
        weight_sync_from_memory=args.weight_sync_from_memory,
        compile=args.compile,
        cache=args.cache,
        **memory_settings(args),
        limits=Limits(
            max_height=args.max_height, max_width=args.max_width,
            max_num_frames=args.max_num_frames,
            max_steps=args.max_steps,
            max_n=args.max_n,
            max_jobs=args.max_jobs, job_ttl_s=args.job_ttl, data_dir=args.data_dir,  # /v1/videos jobs
            max_prompt_chars=args.max_prompt_chars,
            request_timeout_s=args.request_timeout,
            max_pending=args.max_pending,
            max_attempts=args.max_attempts,
            worker_wait_s=args.worker_wait,
            max_body_bytes=args.max_body_bytes,
            max_image_bytes=args.max_image_bytes,
            max_image_pixels=args.max_image_pixels,
            max_message_bytes=args.max_message_bytes,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            max_lora_bytes=args.max_lora_bytes,
        ),
    )


def keys_and_roots(args: argparse.Namespace) -> tuple[str | None, str | None, list[str]]:
    """The API/admin keys and the weight roots; a bad one ends the launcher with one line."""
    # Before any child starts: the key variables leave the environment the workers inherit.
    try:
        api_key, admin_key = keys_from_environment(args.api_key, args.admin_key)
        return api_key, admin_key, resolve_weight_roots(args.weight_root)
    except ValueError as e:
        sys.exit(f"launch.py: error: {e}")


def load_model(name: str) -> Path:
    if name in BUILTINS:
        log.info("loading model %s (built in; the first run generates it into %s, a few seconds)", name, cache_root())
    try:
        return resolve_builtin_or_dir(name)
    except ModelNotFound as e:
        sys.exit(f"launch.py: error: {e}")


def _private_runtime_dir(path: str | None) -> Path:
    runtime = Path(path or tempfile.mkdtemp(prefix="disagg-"))
    runtime.mkdir(parents=True, exist_ok=True)
    os.chmod(runtime, 0o700)  # ipc sockets are files: keep other users out
    return runtime


def _warn_about_keys(args: argparse.Namespace, api_key: str | None) -> None:
    if args.api_key or args.admin_key:
        log.warning("a key given on the command line is visible to local users in ps; prefer $%s / $%s",
                    API_KEY_ENV, ADMIN_KEY_ENV)
    if api_key is None and args.host not in ("127.0.0.1", "localhost"):
        log.warning("HTTP on %s without an API key: anyone who reaches it can use the engine", args.host)


def _secured(config: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    if args.transport == "tcp" and not args.no_curve:
        return provision_curve(config)  # public keys into the config, secret keys into 0600 files
    if args.transport == "tcp":
        log.warning("--no-curve: the tcp links are neither authenticated nor encrypted; loopback only")
    return config


def _check_placement_keys(config: EngineConfig, ray: bool) -> None:
    for w in config.workers:
        if ray and w.host != "127.0.0.1":
            sys.exit(f"launch.py: error: {w.role} worker {w.index}: with --ray, Ray places the workers; pin one "
                     "to nodes with 'resources', not 'host'")
        if not ray and w.resources:
            sys.exit(f"launch.py: error: {w.role} worker {w.index}: 'resources' are Ray's; they need --ray")


def _place_workers(args: argparse.Namespace, config: EngineConfig) -> tuple[EngineConfig, "RayWorkers | None"]:
    """``config`` secured, and with ``--ray`` placed on the cluster's nodes (then also its Ray workers)."""
    _check_placement_keys(config, args.ray is not None)
    if args.ray is None:
        return _secured(config, args), None
    from common.placement.ray_workers import RayWorkers

    if args.no_curve:
        log.warning("--no-curve with --ray: the links between nodes are neither authenticated nor encrypted")
    ray_workers = RayWorkers(args.ray, args.model, args.ready_timeout)
    try:
        return ray_workers.place(config, curve=not args.no_curve), ray_workers
    except RuntimeError as e:
        ray_workers.close()
        sys.exit(f"launch.py: error: {e}")


def _serve(args: argparse.Namespace, config: EngineConfig, config_path: Path, sockets: list[socket.socket],
           api_key: str | None, admin_key: str | None, ray_workers: "RayWorkers | None", store: JobStore) -> None:
    """Start the workers and serve HTTP until a signal (or a failed start) stops the server."""
    dispatcher = Dispatcher(config)
    dispatcher.workers_restart = not args.no_restart
    app = create_app(Engine(config, dispatcher, store=store), api_key=api_key, admin_key=admin_key)
    supervisor = Supervisor(config, config_path, restart=not args.no_restart, on_exit=dispatcher.notify_exit,
                            spawn=ray_workers.spawn if ray_workers else None)
    if ray_workers is not None:
        ray_workers.on_moved = dispatcher.notify_moved  # a worker replaced on another node: tell the others
    # At a shutdown signal new requests get 503, and workers that exit (the signal reached them too) are no crash.
    server = EngineServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                         timeout_graceful_shutdown=args.grace_period),
                          dispatcher.admission.start_draining, supervisor.begin_stop)
    # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers in place that lands
    # here instead of killing the process before the workers are stopped below.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: server.handle_exit(signum, frame))
    url = f"http://{args.host}:{args.port}"
    counts = ", ".join(f"{role}={len(config.of_role(role))}" for role in ROLES)
    log.info("starting %d workers (%s); %s answers once each has loaded the model (--ready-timeout %.0fs)",
             len(config.workers), counts, url, args.ready_timeout)
    supervisor.start()
    threading.Thread(target=_wait_ready, args=(url, args.ready_timeout, supervisor, server), daemon=True).start()
    try:
        server.run(sockets=sockets)
    finally:
        supervisor.stop()
        if ray_workers is not None:
            ray_workers.close()


def _clean_up(config: EngineConfig, shm_prefix: str, own_runtime: bool) -> None:
    remove_secrets(config)
    if remove_engine_segments(shm_prefix):  # messages that never reached their receiver
        log.info("removed leftover shared-memory segments %s*", shm_prefix)
    if own_runtime:
        shutil.rmtree(config.runtime_dir, ignore_errors=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=os.environ.get("DISAGG_LOG_LEVEL", "INFO"), format="%(asctime)s launch %(levelname)s %(message)s")
    api_key, admin_key, weight_roots = keys_and_roots(args)
    sockets = bind_http_or_exit(args.host, args.port)  # before anything slow
    args.port = sockets[0].getsockname()[1]  # --port 0: the one it was given
    args.data_dir = args.data_dir or default_data_dir(args.host, args.port)
    store = open_job_store(args.data_dir)  # locked until this process exits
    model = load_model(args.model)
    info = model_info(model, args.transformer_file)
    log.info("model family: %s (%s)", info.family.family, info.family.pipeline)
    runtime = _private_runtime_dir(args.runtime_dir)
    _warn_about_keys(args, api_key)
    config = engine_config(args, model, runtime, weight_roots)
    if problem := layout_problem(info, config.workers, config.cache):
        if args.runtime_dir is None:
            shutil.rmtree(runtime, ignore_errors=True)
        sys.exit(f"launch.py: error: {problem}")
    config, ray_workers = _place_workers(args, config)
    shm_prefix = engine_prefix(config.runtime_dir)
    remove_engine_segments(shm_prefix)  # a previous engine on this runtime dir may have died unclean
    config_path = runtime / CONFIG_NAME
    config.save(config_path)
    try:
        _serve(args, config, config_path, sockets, api_key, admin_key, ray_workers, store)
    finally:
        _clean_up(config, shm_prefix, own_runtime=args.runtime_dir is None)
        store.close()
        log.info("stopped: all workers exited")
    return 0


if __name__ == "__main__":
    exit_now(main())  # everything is closed by now: skip the interpreter's teardown
