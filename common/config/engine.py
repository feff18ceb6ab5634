"""Engine configuration shared by the launcher, the router and every worker.

The launcher writes one :class:`EngineConfig` as JSON into the private runtime
directory; each process reads it back, so every process agrees on the same
topology (which workers exist and where their input sockets are).
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import torch

from common.protocol.messages import ROLES, CacheParams

CONFIG_NAME = "engine.json"  # the config's file in the runtime directory, which followers read too
# Where /v1/videos jobs outlive the router (router/core/job_store.py): by default one dir per address the engine
# listens on, below a root that the variable overrides (so that tests keep engines away from the user's). Two
# engines on one host (other ports) never share a dir; the same flags after a restart find the same one.
DEFAULT_DATA_ROOT, DATA_DIR_ENV = "~/.cache/disagg-diffusion/jobs", "DISAGG_DATA_DIR"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


def default_data_dir(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> str:
    root = Path(os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_ROOT).expanduser()
    return str(root / f"{host}-{port}")

DTYPE_CHOICES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WorkerSpec(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    index: int
    device: str = "cpu"
    endpoint: str = ""
    threads: int = 0  # 0: share the machine's cores evenly between co-located workers
    host: str = "127.0.0.1"  # the address a tcp endpoint binds to and others connect to (ipc: unused)
    # A multi-device denoise worker (denoise_worker/ranks.py): the device of every rank, the leader's
    # (``device``) first; its Ulysses and ring degrees; CFG parallel.
    # len(devices) == ulysses * ring * (2 if cfg_parallel else 1).
    devices: list[str] = []
    ulysses: int = 1
    ring: int = 1
    cfg_parallel: bool = False
    # Ray (launch.py --ray, common/ray/): custom resources that pin the worker's bundle to nodes, and the
    # id of the Ray node it runs on (empty without Ray).
    resources: dict[str, float] = {}
    node: str = ""

    @property
    def ranks(self) -> int:
        return max(1, len(self.devices))


class Limits(msgspec.Struct, forbid_unknown_fields=True):
    """Bounds the router enforces on requests (flags of ``launch.py``)."""

    max_height: int = 2048
    max_width: int = 2048
    max_num_frames: int = 129
    max_steps: int = 1000
    max_n: int = 32  # GRPO groups are 12 to 24 samples of one prompt
    max_prompt_chars: int = 4096
    request_timeout_s: float = 600.0
    max_pending: int = 256  # samples in flight before the router answers 429
    max_body_bytes: int = 1 << 20
    # Image-to-video: the largest encoded image a request may carry (each of image and last_image; its body
    # may exceed max_body_bytes by their base64) and the most pixels one may declare (refused before decoding).
    max_image_bytes: int = 32 << 20
    max_image_pixels: int = 8192 * 8192
    # LoRA adapters: how many each denoise worker holds, their largest rank, the largest adapter body.
    max_loras: int = 16
    max_lora_rank: int = 128
    max_lora_bytes: int = 1 << 30
    # ZeroMQ disconnects a peer that sends a larger message part (bounds hostile frames).
    max_message_bytes: int = 1 << 30
    # /v1/videos jobs the router holds at once (queued, running or finished), and how long a finished one's
    # MP4 stays downloadable.
    max_jobs: int = 64
    job_ttl_s: float = 3600.0
    data_dir: str = msgspec.field(default_factory=default_data_dir)  # the jobs' rows and files; one engine each
    # A request held by a worker that died runs again, up to this many runs in all (router/link/attempts.py);
    # while a role has no ready worker, a request waits this long (within its deadline) for one.
    max_attempts: int = 3
    worker_wait_s: float = 60.0


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    workers: list[WorkerSpec]
    router_endpoint: str
    runtime_dir: str
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on GPU
    # The transformer's weights from this one checkpoint file (a .safetensors or a .gguf: launch.py
    # --transformer-file), its config and every other component from ``model``; None: the directory's own.
    transformer_file: str | None = None
    # Requests that share one forward (denoise), one text-encoder or one VAE call.
    max_batch_size: int = 8
    prompt_cache_bytes: int = 256 << 20  # encoder: recently encoded prompts kept (0: no cache)
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 10.0
    limits: Limits = msgspec.field(default_factory=Limits)
    # Weight updates may only read below these directories; empty: weight updates are refused.
    weight_roots: list[str] = []
    # Files a request may name by path (SGLang's image_path) lie below these directories; empty: none.
    image_roots: list[str] = []
    # Which protocol answers the root's routes that the native API and a peer's share with bodies alike
    # (router/peers/): "native", or "sglang" (its bare release keeps the weights). The peers' prefixed routes
    # and bodies in a peer's own shape are answered whatever this says.
    peer_api: str = "native"
    # SGLang's answers carry each tensor as safetensors bytes ("bytes", sglang 0.5.23) or their base64 ("base64").
    sglang_tensors: str = "bytes"
    # Weight updates from the trainer's memory (shared memory, a torch.distributed group); off by default.
    weight_sync_from_memory: bool = False
    # Denoise workers: each expert through torch.compile (common/diffusion/compiled.py), warmed up before ready.
    compile: bool = False
    # Step caching for requests that leave out ``cache`` (common/diffusion/step_cache.py); None: off.
    cache: CacheParams | None = None
    # VAE calls (decode; image-to-video's image encode) tiled: "auto" above vae_tiling_pixels (one sample's
    # frames x height x width; None: common/diffusion/vae_tiling.py's default), "on", "off".
    vae_tiling: str = "auto"
    vae_tiling_pixels: int | None = None
    # Encoder workers: the device of the text encoder(s) ("cpu", "cuda", "cuda:N"); None: the worker's own.
    text_encoder_device: str | None = None
    # CPU intra-op threads: "invariant" computes at one thread, so outputs do not follow the topology's threads,
    # the cores or the batch; "threaded" uses them, outputs round with them (common/diffusion/thread_invariance.py).
    cpu_numerics: str = "invariant"
    transport: str = "ipc"  # "ipc" (one host, sockets in the 0700 runtime dir) or "tcp"
    # ipc only: tensors of at least this many bytes travel in /dev/shm segments, not frames (common/transport/shm.py).
    # 0: off (always 0 with tcp). Segment names start with common.transport.shm.engine_prefix(runtime_dir).
    shm_threshold_bytes: int = 0
    # Most bytes of segments each process prepares ahead of time for sizes it sends repeatedly (0: none).
    shm_spare_bytes: int = 0
    # ipc only: CUDA tensors between two GPU workers travel as CUDA IPC handles, not through host memory
    # (common/transport/cuda_ipc.py).
    cuda_ipc: bool = True
    # CURVE (tcp only; empty: off). Public keys of every process ("router", "encoder-0", ...) and the
    # path of each process's secret key file (mode 0600, in the runtime dir). Never the secret keys.
    curve_public: dict[str, str] = {}
    curve_secret_files: dict[str, str] = {}

    def worker(self, role: str, index: int) -> WorkerSpec:
        for w in self.workers:
            if w.role == role and w.index == index:
                return w
        raise KeyError(f"no {role} worker with index {index} in the topology")

    def of_role(self, role: str) -> list[WorkerSpec]:
        return [w for w in self.workers if w.role == role]

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(self)))

    @classmethod
    def load(cls, path: str | Path) -> "EngineConfig":
        return msgspec.json.decode(Path(path).read_bytes(), type=cls)


def validate_workers(workers: list[WorkerSpec]) -> None:
    for role in ROLES:
        if not any(w.role == role for w in workers):
            raise ValueError(f"topology needs at least one {role} worker")
    for w in workers:
        if w.role not in ROLES:
            raise ValueError(f"unknown worker role {w.role!r} (expected one of {ROLES})")


def torch_dtype_for(device: str, dtype: str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"unknown dtype {dtype!r} (expected one of {sorted(DTYPE_CHOICES)})")
    return DTYPE_CHOICES[dtype]


CPU_NUMERICS = ("invariant", "threaded")


def worker_threads(config: "EngineConfig", spec: WorkerSpec) -> int:
    """torch's intra-op threads for a worker: one with ``cpu_numerics`` "invariant" (kernels that split their
    work by the thread count round by the split: common/diffusion/thread_invariance.py), else the topology's,
    else :func:`default_threads`."""
    if config.cpu_numerics == "invariant":
        return 1
    return spec.threads or default_threads(config, spec)


def default_threads(config: "EngineConfig", spec: WorkerSpec) -> int:
    """CPU threads for a worker when the topology does not say.

    The transformer is where the compute goes: denoise workers split the
    machine's cores among themselves; encoder and decode workers take one
    thread each (their models are small next to it, and they run between the
    denoiser's steps rather than instead of them).
    """
    cores = os.cpu_count() or 1
    if spec.role != "denoise":
        return 1
    ranks = sum(w.ranks for w in config.of_role("denoise"))  # on the CPU, a worker's ranks share its cores
    return max(1, cores // max(1, ranks))
