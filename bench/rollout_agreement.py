"""Rollout vs trainer recompute, and what a rollout request costs next to a serving one.

    python bench/rollout_agreement.py [--models tiny small] [--requests 4]

Per model: starts an engine, sends rollout requests (sde and cps, full and
windowed), recomputes every log-prob in-process with :class:`rl.TrainerPolicy`
and reports the max abs difference; then times the same request as ODE Euler
rollout (no log-probs), SDE rollout with log-probs, and serving UniPC, side by
side in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.runtime.engine_process import EngineProcess  # noqa: E402
from common.diffusion.model_info import ModelInfo  # noqa: E402
from common.families import read_model  # noqa: E402
from common.builtin import ensure_builtin  # noqa: E402
from rl import TrainerPolicy, Trajectory  # noqa: E402
from router.client import EngineClient  # noqa: E402

CASES = [
    ("sde", 0.7, None),
    ("sde", 0.7, [1, 2]),
    ("cps", 0.8, None),
]


def bench_model(name: str, requests: int, repeats: int) -> dict:
    model_dir = ensure_builtin(name)
    info = read_model(model_dir)
    d = info.defaults
    policy = TrainerPolicy(model_dir)
    # The model's own defaults, sent explicitly; guidance stays the model's (an image model without a guidance
    # embedding takes no guidance_scale), frames only where the model makes videos.
    base = dict(negative_prompt="", height=d["height"], width=d["width"], num_inference_steps=d["num_inference_steps"],
                **({"num_frames": d["num_frames"]} if info.family.video else {}))
    worst, count = 0.0, 0
    timing: dict[str, list[float]] = {"serving UniPC": [], "rollout ODE": [], "rollout SDE+logp": []}
    with EngineProcess(name) as eng, EngineClient(eng.url) as c:
        for sde_type, level, window in CASES:
            for i in range(requests):
                prompt = f"prompt {i} for {sde_type}"
                req = dict(seed=i, sde_type=sde_type, noise_level=level, sde_step_indices=window,
                           return_trajectory=True, **base)
                s = c.rollout(prompt, **req)["samples"][0]
                with torch.no_grad():
                    again = policy.log_probs(Trajectory.from_sample(s), s["log_prob_steps"],
                                             policy.params(prompt, **req))
                worst = max(worst, (again - s["log_probs"]).abs().max().item())
                count += again.numel()
        for _ in range(repeats):  # interleaved so that machine noise hits all three alike
            for label, kw in (("serving UniPC", dict(rollout=False)), ("rollout ODE", dict(sde_type="ode")),
                              ("rollout SDE+logp", dict(sde_type="sde"))):
                t0 = time.perf_counter()
                c.rollout("timing", seed=7, **kw, **base)
                timing[label].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in timing.items()}
    return {"model": name, "log_probs_compared": count, "max_abs_diff": worst, "latency_s": med,
            "steps": base["num_inference_steps"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--requests", type=int, default=4, help="rollouts per case")
    ap.add_argument("--repeats", type=int, default=5, help="timing repeats")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = [bench_model(m, args.requests, args.repeats) for m in args.models]
    print(f"\n{'model':<7} {'log-probs':>9} {'max |rollout - recompute|':>26} {'steps':>5} "
          f"{'serving s':>10} {'ODE s':>8} {'SDE+logp s':>11} {'SDE/ODE':>8}")
    for r in results:
        lat = r["latency_s"]
        print(f"{r['model']:<7} {r['log_probs_compared']:>9} {r['max_abs_diff']:>26.3e} {r['steps']:>5} "
              f"{lat['serving UniPC']:>10.4f} {lat['rollout ODE']:>8.4f} {lat['rollout SDE+logp']:>11.4f} "
              f"{lat['rollout SDE+logp'] / lat['rollout ODE']:>8.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
