"""The local engine (local_engine/: one process) against the launched one (launch.py: processes, ZeroMQ, HTTP).

Per model: the start-up time (to the first answer's readiness) and a small request's latency at c=1 (median of
``--repeats`` after ``--warmup``), for ``/generate`` (latents) and a rollout group, both engines side by side in
one run, with the ratio local / launched. Run: ``python bench/local_vs_launched.py [--models tiny tiny-sd3]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.runtime.engine_process import EngineProcess  # noqa: E402
from local_engine import LocalEngine  # noqa: E402
from router.client import EngineClient  # noqa: E402

REQUESTS = {
    "generate": ("generate", dict(prompt="a fox in the snow", seed=1, num_inference_steps=4, output_type="latent")),
    "rollout n=4": ("rollout", dict(prompt="a fox in the snow", seed=1, n=4, num_inference_steps=4,
                                    return_trajectory=True, output_type="latent")),
}


def _latency(client, method: str, fields: dict, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        getattr(client, method)(**fields)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        getattr(client, method)(**fields)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(model: str, warmup: int, repeats: int) -> dict[str, tuple[float, float]]:
    out = {}
    t0 = time.perf_counter()
    local = LocalEngine(model)
    local_start = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        engine = EngineProcess(model, "encoder=1,denoise=1,decode=1", workdir=Path(tmp))
        launched_start = time.perf_counter() - t0
        try:
            with EngineClient(engine.url) as launched:
                out["start-up (s)"] = (local_start, launched_start)
                for name, (method, fields) in REQUESTS.items():
                    out[f"{name} c=1 (ms)"] = (1e3 * _latency(local, method, fields, warmup, repeats),
                                               1e3 * _latency(launched, method, fields, warmup, repeats))
        finally:
            engine.stop()
            local.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "tiny-sd3"])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    print("| model | measure | local | launched | local / launched |\n|---|---|---|---|---|")
    for model in args.models:
        for measure_name, (local, launched) in measure(model, args.warmup, args.repeats).items():
            print(f"| {model} | {measure_name} | {local:.2f} | {launched:.2f} | {local / launched:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
