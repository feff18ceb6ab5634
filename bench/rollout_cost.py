"""Cost of one rollout step (common/diffusion/sde.py) compared with a plain Euler step.

    python bench/rollout_cost.py [--repeats N] [--threads N] [--device cpu] [--json PATH]

For three latent sizes (the tiny test model, a mid size, Wan 480p / 81 frames) it times:

- ``euler``:      ``x + dt * v`` (what a deterministic flow-match step costs);
- ``sde``:        ``sde_step`` drawing its noise (CPU generator) and computing the log-prob;
- ``sde_eval``:   ``sde_step(prev_sample=...)``, the trainer's recompute (no noise drawn);
- ``cps``:        ``sde_step(sde_type="cps")`` drawing its noise;
- ``ode_fn``:     ``sde_step(sde_type="ode")``, the Euler step through the same function.

Each number is the median over many repeats, in microseconds per step, with torch's default thread count
unless ``--threads`` is given. The load average is printed too: on a busy machine, multi-threaded element-wise
ops on large tensors wait for the slowest thread and the numbers say more about the machine than the code.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.diffusion.sde import sde_step  # noqa: E402

SHAPES = {
    "tiny": (1, 16, 2, 4, 4),
    "mid": (1, 16, 3, 16, 16),
    "wan480p": (1, 16, 21, 60, 104),
}
SIGMA, SIGMA_NEXT, SIGMA_MAX = 0.8, 0.75, 0.99


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_us(fn: Callable[[], object], device: torch.device, repeats: int, budget_s: float) -> float:
    """Median wall time of ``fn`` in microseconds: a few warm-up calls, then up to ``repeats`` timed calls
    (at least 5, fewer than ``repeats`` only when the time budget runs out)."""
    for _ in range(3):
        fn()
    _sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats and (len(times) < 5 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def bench_shape(shape: tuple[int, ...], device: torch.device, repeats: int, budget_s: float) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(device)
    v = torch.randn(shape, generator=g).to(device)
    dt = SIGMA_NEXT - SIGMA
    gen = torch.Generator().manual_seed(1)
    taken = sde_step(v, x, SIGMA, SIGMA_NEXT, SIGMA_MAX, generator=gen).prev_sample

    cases: dict[str, Callable[[], object]] = {
        "euler": lambda: x + dt * v,
        "sde": lambda: sde_step(v, x, SIGMA, SIGMA_NEXT, SIGMA_MAX, generator=gen),
        "sde_eval": lambda: sde_step(v, x, SIGMA, SIGMA_NEXT, SIGMA_MAX, prev_sample=taken),
        "cps": lambda: sde_step(v, x, SIGMA, SIGMA_NEXT, SIGMA_MAX, sde_type="cps", noise_level=0.8,
                                generator=gen),
        "ode_fn": lambda: sde_step(v, x, SIGMA, SIGMA_NEXT, SIGMA_MAX, sde_type="ode"),
    }
    with torch.no_grad():
        return {name: time_us(fn, device, repeats, budget_s) for name, fn in cases.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=200, help="timed calls per case (upper bound)")
    ap.add_argument("--budget-s", type=float, default=3.0, help="time budget per case once 5 calls are done")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    results: dict[str, dict] = {}
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
          f"cores {os.cpu_count()}, load average {load:.2f}")
    header = f"{'shape':<32}{'case':<10}{'us/step':>12}{'x euler':>10}"
    print(header)
    print("-" * len(header))
    for name, shape in SHAPES.items():
        us = bench_shape(shape, device, args.repeats, args.budget_s)
        results[name] = {"shape": list(shape), "us_per_step": us,
                         "ratio_to_euler": {k: t / us["euler"] for k, t in us.items()}}
        label = f"{name} {list(shape)}"
        for case, t in us.items():
            print(f"{label:<32}{case:<10}{t:>12.1f}{t / us['euler']:>10.2f}")
            label = ""
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "device": str(device), "threads": torch.get_num_threads(),
                "cores": os.cpu_count(), "load_average_at_start": load,
                "sigma": SIGMA, "sigma_next": SIGMA_NEXT, "sigma_max": SIGMA_MAX}
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
