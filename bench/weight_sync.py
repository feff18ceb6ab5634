"""Time a weight sync into every denoise worker by each path, side by side, against this machine's memcpy.

    python bench/weight_sync.py [--models small wan2.1-1.3b] [--repeats 3] [--bucket-mb 256]
                                [--denoise 1] [--json PATH]

For each model: loads a trainer-side copy of the transformer (``small`` in
float32, ``wan2.1-1.3b`` -- Wan2.1-T2V-1.3B's shape, random weights -- in
bfloat16, 2.8 GB), starts one engine (``encoder=1,denoise=N,decode=1``, with
``--weight-root``, ``--weight-sync-from-memory`` and the model's ``--dtype``)
and opens a gloo weights group with it. After one untimed warm-up update by
each path (a worker's first write into the weights it loaded at start costs
page faults no later update pays; its times are printed apart), per repeat, in
turn (interleaved, so that a noisy machine weighs on every path alike):

- ``disk``: ``save_weights`` into a file below the weight root, then
  ``update_weights_from_disk`` (timed as save + load, and each separately);
- ``shared memory``: one ``update_weights_from_tensors`` call (write the
  buckets into /dev/shm, every worker copies from them);
- ``CUDA IPC`` (only on a machine with a GPU, where the denoise workers run on
  GPUs): the same call with the trainer's copy on the GPU; the client packs GPU
  buckets and hands over CUDA IPC handles, each worker copies device to device;
- ``distributed (gloo)``: one ``WeightsGroup.push`` (pack and broadcast each
  bucket, every worker receives and applies);
- ``memcpy``: ``dst.copy_(src)`` of two pre-touched uint8 CPU tensors of the
  model's byte size, torch's default threads (median of a few): what this
  machine's memory can do in the same run.

Before each timed update the machine settles (untimed: ``os.sync()`` and a
second's pause), so that the disk path's writeback does not land on the path
after it. Before each update the trainer's copy is perturbed in place (seeded noise), so
every update really changes the weights; after it, untimed, the engine's
``/weights_checksum`` must equal ``state_dict_checksum`` of the trainer's copy.
Updates are sent with ``checksum=False``. Bytes are the state dict's
(numel x element size); GB = 1e9 bytes.

Prints, per model, a table (median seconds per update, the best repeat's,
and from the medians GB/s, disk / path, fraction of memcpy GB/s), where each path's time goes (the bench times the
library calls it makes: bucket allocation, packing, the engine call, the
broadcasts; ``worker`` is the slowest worker's own ``load_s``), the peak memory
in use on the machine, and whether the targets for the 1.3B shape are met:
shared memory at least 5x faster than disk and at least 30% of memcpy.
``--json PATH`` writes the medians and every raw timing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common.diffusion.weight_buckets as weight_buckets_module  # noqa: E402
from common.runtime.engine_process import EngineProcess, free_port  # noqa: E402
from common.transport.weight_segments import WrittenBuckets  # noqa: E402
from common.builtin import ensure_builtin  # noqa: E402
from common.diffusion.weights import save_weights, state_dict_checksum, validate_against  # noqa: E402
from rl import WeightsGroup  # noqa: E402
from router.client import EngineClient  # noqa: E402

DISK, SHM, CUDA, DIST, MEMCPY = "disk", "shared memory", "CUDA IPC", "distributed (gloo)", "memcpy"
# CUDA IPC only where there is a GPU: the trainer's copy on it, the denoise workers on GPUs.
UPDATES = (SHM, CUDA, DIST) if torch.cuda.is_available() else (SHM, DIST)
PATHS = (DISK, *UPDATES, MEMCPY)
# The dtype each model is served (and held by the trainer) in; others: float32, the engine's CPU default.
MODEL_DTYPES = {"wan2.1-1.3b": "bfloat16"}
TARGET_MODEL = "wan2.1-1.3b"
TARGET_SPEEDUP = 5.0  # shared memory vs disk
TARGET_MEMCPY_FRACTION = 0.30  # shared memory GB/s vs memcpy GB/s
MEMCPY_COPIES = 3  # per repeat; their median is the repeat's memcpy time
NOISE_POOL = 1 << 24  # float32 elements of seeded noise the perturbation draws from
NOISE_SCALE = 1e-3
GIB = 2**30
SETTLE_S = 1.0


# --------------------------------------------------------------------------
# Trainer side: the copy, its perturbation, memcpy
# --------------------------------------------------------------------------


def state_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


@torch.no_grad()
def perturb(module: torch.nn.Module, seed: int) -> None:
    """Add seeded noise in place to every floating-point tensor (cheap: slices of one noise pool)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(NOISE_POOL, generator=g) * NOISE_SCALE
    for t in module.state_dict().values():
        if not t.is_floating_point():
            continue
        flat = t.view(-1)
        n = flat.numel()
        start = int(torch.randint(0, max(NOISE_POOL - n, 0) + 1, (1,), generator=g))
        for s in range(0, n, NOISE_POOL):  # a tensor larger than the pool takes it several times
            k = min(NOISE_POOL, n - s)
            flat[s : s + k].add_(pool[start : start + k] if k == n else pool[:k])


def settle() -> None:
    """Untimed, before each timed update: the disk path's writeback and freed pages would otherwise land on
    whichever path runs next (measured: the next shared-memory pack took 3x as long)."""
    os.sync()
    time.sleep(SETTLE_S)


def memcpy_seconds(nbytes: int, copies: int = MEMCPY_COPIES) -> list[float]:
    """``dst.copy_(src)`` of two uint8 tensors of ``nbytes``, both touched first (no page faults timed)."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    out = []
    for _ in range(copies):
        t0 = time.perf_counter()
        dst.copy_(src)
        out.append(time.perf_counter() - t0)
    del src, dst
    return out


# --------------------------------------------------------------------------
# Where the time goes: the library calls a timed update makes, timed from outside
# --------------------------------------------------------------------------


class Phases:
    """Seconds spent in named calls during one update: wraps them for the duration, then puts them back."""

    def __init__(self):
        self.s: dict[str, float] = defaultdict(float)

    def add(self, label: str, seconds: float) -> None:
        self.s[label] += seconds

    def _wrap(self, fn, label: str):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.add(label, time.perf_counter() - t0)
        return timed

    @contextlib.contextmanager
    def timing(self, *targets: tuple[object, str, str]):
        """``targets``: (owner, attribute, label); the owner is a module or a class."""
        saved = []
        try:
            for owner, attr, label in targets:
                fn = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
                saved.append((owner, attr, fn))
                setattr(owner, attr, self._wrap(fn, label))
            yield self
        finally:
            for owner, attr, fn in reversed(saved):
                setattr(owner, attr, fn)


class _TimedBroadcasts:
    """Stands in for a WeightsGroup's process group: times each broadcast until its ``wait()`` returns."""

    def __init__(self, pg, phases: Phases):
        self._pg, self._phases = pg, phases

    def broadcast(self, tensors, opts):
        t0 = time.perf_counter()
        work = self._pg.broadcast(tensors, opts)
        phases = self._phases

        class _Work:
            def wait(self):
                try:
                    return work.wait()
                finally:
                    phases.add("broadcast", time.perf_counter() - t0)
        return _Work()


@contextlib.contextmanager
def timed_broadcasts(group: WeightsGroup, phases: Phases):
    pg = group.pg
    group.pg = _TimedBroadcasts(pg, phases)
    try:
        yield
    finally:
        group.pg = pg


# --------------------------------------------------------------------------
# Memory in use on the machine, sampled while the bench runs
# --------------------------------------------------------------------------


def memory_in_use() -> tuple[int, int]:
    """(bytes in use: MemTotal - MemAvailable, MemTotal); shared memory in /dev/shm counts as in use."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"], info["MemTotal"]


class PeakMemory:
    def __init__(self, interval_s: float = 0.1):
        self.interval_s, self.peak = interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, memory_in_use()[0])
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def estimated_peak_bytes(model_dir: Path, nbytes: int, denoise: int) -> int:
    """A rough upper bound: trainer copy, each denoise worker's weights plus one transient copy (a read
    file or received buckets), the shared-memory buckets, the two memcpy buffers, the encoder and VAE."""
    others = sum(p.stat().st_size for sub in ("text_encoder", "vae") for p in (model_dir / sub).glob("*.safetensors"))
    return nbytes * (1 + 2 * denoise + 1 + 2) + others


# --------------------------------------------------------------------------
# One model
# --------------------------------------------------------------------------


def _worker_load_s(reply: dict) -> float:
    return max(w["load_s"] for w in reply["workers"])


class Checker:
    """After each update: the engine holds exactly the trainer's weights, and they changed since the last one."""

    def __init__(self, client: EngineClient, trainer: torch.nn.Module, denoise: int):
        self.client, self.trainer, self.denoise = client, trainer, denoise
        self.version = client.weights_checksum()["weight_version"]
        self.last = None

    def __call__(self, what: str, reply: dict) -> None:
        if len(reply["workers"]) != self.denoise:
            raise SystemExit(f"{what}: {len(reply['workers'])} workers answered, expected {self.denoise}")
        if reply["weight_version"] != self.version + 1:
            raise SystemExit(f"{what}: weight_version {reply['weight_version']}, expected {self.version + 1}")
        self.version = reply["weight_version"]
        remote = self.client.weights_checksum()
        local = state_dict_checksum(self.trainer)
        if remote["sha256"] != local or remote["weight_version"] != self.version:
            raise SystemExit(f"{what}: the engine's weights ({remote}) are not the trainer's ({local})")
        if local == self.last:
            raise SystemExit(f"{what}: the perturbation left the weights unchanged")
        self.last = local


class Updates:
    """One update by each path (perturb, timed update, untimed check); each returns its timings."""

    def __init__(self, name: str, client: EngineClient, group: WeightsGroup, trainer: torch.nn.Module,
                 work: Path, denoise: int, bucket_bytes: int):
        self.name, self.client, self.group, self.trainer = name, client, group, trainer
        self.work, self.bucket_bytes = work, bucket_bytes
        self.check = Checker(client, trainer, denoise)
        self.seed, self.count = 0, 0
        self.trainer_gpu: torch.nn.Module | None = None

    def _perturb(self) -> None:
        self.seed += 1
        perturb(self.trainer, self.seed)

    def disk(self) -> dict:
        """Save below the weight root, then every worker reads the file."""
        self._perturb()
        self.count += 1
        target = self.work / f"u{self.count}"
        t0 = time.perf_counter()
        path = save_weights(self.trainer, target)
        t1 = time.perf_counter()
        reply = self.client.update_weights_from_disk(path, module="transformer", checksum=False)
        t2 = time.perf_counter()
        self.check(f"{self.name} disk", reply)
        shutil.rmtree(target)
        return {"s": t2 - t0, "save": t1 - t0, "load": t2 - t1, "worker": _worker_load_s(reply)}

    def shm(self) -> dict:
        self._perturb()
        return self._from_tensors(self.trainer, SHM)

    def cuda(self) -> dict:
        """The same update from a copy of the trainer's weights on the GPU: CUDA IPC handles to GPU buckets."""
        self._perturb()
        if self.trainer_gpu is None:
            self.trainer_gpu = copy.deepcopy(self.trainer).to("cuda")
        with torch.no_grad():  # untimed: the trainer's new weights, on its GPU
            for dst, src in zip(self.trainer_gpu.state_dict().values(), self.trainer.state_dict().values()):
                dst.copy_(src)
        torch.cuda.synchronize()
        return self._from_tensors(self.trainer_gpu, CUDA)

    def _from_tensors(self, model: torch.nn.Module, path: str) -> dict:
        """One timed ``update_weights_from_tensors`` of ``model`` (host buckets or, on a GPU, CUDA IPC)."""
        ph = Phases()
        with ph.timing((EngineClient, "weight_sync_info", "info"), (WrittenBuckets, "__init__", "alloc"),
                       (weight_buckets_module, "pack_into", "pack"), (EngineClient, "_post", "engine"),
                       (WrittenBuckets, "close", "unlink")):
            t0 = time.perf_counter()
            reply = self.client.update_weights_from_tensors(model, module="transformer",
                                                            bucket_bytes=self.bucket_bytes, checksum=False)
            t1 = time.perf_counter()
        self.check(f"{self.name} {path}", reply)
        return {"s": t1 - t0, "worker": _worker_load_s(reply), "phases": {**ph.s, "worker": _worker_load_s(reply)}}

    def dist(self) -> dict:
        self._perturb()
        ph = Phases()
        with ph.timing((weight_buckets_module, "pack_into", "pack")), timed_broadcasts(self.group, ph):
            t0 = time.perf_counter()
            reply = self.group.push(self.trainer, module="transformer", checksum=False)
            t1 = time.perf_counter()
        self.check(f"{self.name} distributed", reply)
        rest = (t1 - t0) - sum(ph.s.values())  # planning, the engine call's tail: the workers apply after the last bucket
        return {"s": t1 - t0, "worker": _worker_load_s(reply),
                "phases": {**ph.s, "rest": rest, "worker": _worker_load_s(reply)}}


def bench_model(name: str, repeats: int, denoise: int, bucket_bytes: int) -> dict:
    model_dir = ensure_builtin(name)
    dtype_name = MODEL_DTYPES.get(name, "float32")
    dtype = getattr(torch, dtype_name)
    trainer = WanTransformer3DModel.from_pretrained(model_dir / "transformer", torch_dtype=dtype)
    trainer.requires_grad_(False)
    perturb(trainer, seed=0)  # every page of the copy is its own (not the file's mapping) before anything is timed
    params = sum(p.numel() for p in trainer.parameters())
    nbytes = state_bytes(trainer)
    used, total = memory_in_use()
    need = estimated_peak_bytes(model_dir, nbytes, denoise)
    print(f"[{name}] {params:,} parameters, {nbytes / 1e9:.3f} GB in {dtype_name}; memory in use "
          f"{used / GIB:.1f} of {total / GIB:.1f} GiB, this run needs about {need / GIB:.1f} GiB more at most",
          flush=True)
    if used + need > total:
        print(f"[{name}] warning: that may not fit", flush=True)

    # The worker's own check before it copies anything, measured here on the trainer's copy for reference.
    t0 = time.perf_counter()
    validate_against(trainer, trainer.state_dict())
    validate_s = time.perf_counter() - t0

    seconds: dict[str, list[float]] = {p: [] for p in PATHS}
    seconds.update({"disk save": [], "disk load": []})
    worker_s: dict[str, list[float]] = {p: [] for p in (DISK, *UPDATES)}
    phases: dict[str, list[dict[str, float]]] = {p: [] for p in UPDATES}
    warmup: dict[str, dict] = {}
    work = Path(tempfile.mkdtemp(prefix="wsync-"))  # the engine may read weights only below it
    extra = ["--weight-root", str(work), "--weight-sync-from-memory", "--dtype", dtype_name]
    topology = f"encoder=1,denoise={denoise},decode=1"
    t_start = time.perf_counter()
    with PeakMemory() as peak:
        eng = None
        try:
            t0 = time.perf_counter()
            eng = EngineProcess(name, topology, extra=extra, ready_timeout_s=900)
            start_s = time.perf_counter() - t0
            print(f"[{name}] engine up in {start_s:.1f}s", flush=True)
            with EngineClient(eng.url) as c:
                t0 = time.perf_counter()
                group = WeightsGroup(c, "127.0.0.1", free_port(), backend="gloo", timeout_s=600,
                                     bucket_bytes=bucket_bytes)
                group.open()
                group_open_s = time.perf_counter() - t0
                try:
                    u = Updates(name, c, group, trainer, work, denoise, bucket_bytes)
                    # Untimed warm-up, one update by each path: the first write into the weights a worker
                    # loaded at start costs far more than any later one (page faults on its first touch).
                    runs = {DISK: u.disk, SHM: u.shm, CUDA: u.cuda, DIST: u.dist}
                    for path in (DISK, *UPDATES):
                        warmup[path] = runs[path]()
                    print(f"[{name}] warm-up (untimed): " + ", ".join(
                        f"{p} {w['s']:.3f}s (worker {w['worker']:.3f}s)" for p, w in warmup.items()), flush=True)
                    for r in range(repeats):
                        settle()
                        m = u.disk()
                        seconds[DISK].append(m["s"])
                        seconds["disk save"].append(m["save"])
                        seconds["disk load"].append(m["load"])
                        worker_s[DISK].append(m["worker"])
                        for path in UPDATES:
                            settle()
                            m = runs[path]()
                            seconds[path].append(m["s"])
                            worker_s[path].append(m["worker"])
                            phases[path].append(m["phases"])
                        # memcpy of the same bytes, in the same run
                        seconds[MEMCPY].append(statistics.median(memcpy_seconds(nbytes)))
                        print(f"[{name}] repeat {r + 1}/{repeats}: " + ", ".join(
                            f"{p} {seconds[p][-1]:.3f}s" for p in PATHS), flush=True)
                finally:
                    group.close()
        finally:
            if eng is not None:
                eng.stop()
            shutil.rmtree(work, ignore_errors=True)
    run_s = time.perf_counter() - t_start

    med = {k: statistics.median(v) for k, v in seconds.items()}
    memcpy_gbs = nbytes / med[MEMCPY] / 1e9
    rows = []
    for p in (DISK, "disk save", "disk load", *UPDATES, MEMCPY):
        gbs = nbytes / med[p] / 1e9
        rows.append({"path": p, "seconds": med[p], "best_s": min(seconds[p]), "gb_per_s": gbs,
                     "disk_over_path": med[DISK] / med[p], "memcpy_fraction": gbs / memcpy_gbs,
                     "worker_load_s": statistics.median(worker_s[p]) if p in worker_s else None})
    breakdown = {p: {k: statistics.median(d.get(k, 0.0) for d in phases[p]) for k in phases[p][0]}
                 for p in phases}
    return {"model": name, "dtype": dtype_name, "params": params, "bytes": nbytes, "denoise_workers": denoise,
            "bucket_bytes": bucket_bytes, "repeats": repeats, "rows": rows, "breakdown": breakdown,
            "warmup": {p: {"s": w["s"], "worker_load_s": w["worker"]} for p, w in warmup.items()},
            "validate_against_s": validate_s, "engine_start_s": start_s, "group_open_s": group_open_s,
            "run_s": run_s, "peak_memory_in_use_bytes": peak.peak, "memory_total_bytes": total,
            "raw": {"seconds": seconds, "worker_load_s": worker_s, "phases": phases}}


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def targets(result: dict) -> list[tuple[str, bool]]:
    row = {r["path"]: r for r in result["rows"]}[SHM]
    return [(f"shared memory >= {TARGET_SPEEDUP:g}x faster than disk: {row['disk_over_path']:.1f}x",
             row["disk_over_path"] >= TARGET_SPEEDUP),
            (f"shared memory >= {TARGET_MEMCPY_FRACTION:.0%} of memcpy: {row['memcpy_fraction']:.0%}",
             row["memcpy_fraction"] >= TARGET_MEMCPY_FRACTION)]


def print_result(r: dict) -> None:
    print(f"\n{r['model']}: {r['params']:,} parameters, {r['bytes'] / 1e9:.3f} GB ({r['dtype']}), "
          f"{r['denoise_workers']} denoise worker(s), buckets of {r['bucket_bytes'] >> 20} MiB, "
          f"median of {r['repeats']}")
    print(f"  {'path':<20} {'s/update':>9} {'best s':>7} {'GB/s':>7} {'disk/path':>9} {'of memcpy':>9} "
          f"{'worker s':>9}")
    for row in r["rows"]:
        name = ("  " + row["path"].removeprefix("disk ")) if row["path"].startswith("disk ") else row["path"]
        worker = f"{row['worker_load_s']:>9.3f}" if row["worker_load_s"] is not None else f"{'':>9}"
        print(f"  {name:<20} {row['seconds']:>9.3f} {row['best_s']:>7.3f} {row['gb_per_s']:>7.2f} "
              f"{row['disk_over_path']:>8.1f}x "
              f"{row['memcpy_fraction']:>8.0%} {worker}")
    for path, parts in r["breakdown"].items():
        print(f"  {path} (s): " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
    print("  first update after the engine started (warm-up, not in the medians): " + ", ".join(
        f"{p} {w['s']:.3f}s (worker {w['worker_load_s']:.3f}s)" for p, w in r["warmup"].items()))
    print(f"  the workers' check before copying (weights.validate_against), run here on the trainer's copy: "
          f"{r['validate_against_s']:.3f}s")
    print(f"  engine start {r['engine_start_s']:.1f}s, group open {r['group_open_s']:.2f}s, "
          f"run {r['run_s']:.0f}s, peak memory in use {r['peak_memory_in_use_bytes'] / GIB:.1f} of "
          f"{r['memory_total_bytes'] / GIB:.1f} GiB")
    tag = "targets" if r["model"] == TARGET_MODEL else f"targets (set for {TARGET_MODEL}; here for information)"
    print(f"  {tag}:")
    for text, met in targets(r):
        print(f"    {'MET    ' if met else 'NOT MET'} {text}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["small", "wan2.1-1.3b"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=256, help="bucket size (MiB) for shared memory and gloo")
    ap.add_argument("--denoise", type=int, default=1, help="denoise workers to update")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.repeats < 1 or args.denoise < 1 or args.bucket_mb < 1:
        ap.error("--repeats, --denoise and --bucket-mb must be at least 1")
    results = []
    for m in args.models:
        results.append(bench_model(m, args.repeats, args.denoise, args.bucket_mb << 20))
        print_result(results[-1])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
