"""torch.compile of the transformer: one request's denoise, diffusers' eager calls next to our policy eager and
compiled (common/diffusion/compiled.py).

    python bench/compile.py                          # small, 5 rounds
    python bench/compile.py --preset tiny small --rounds 7
    python bench/compile.py --mode max-autotune-no-cudagraphs --freezing --json bench/results/compile.json

Per preset (its model's default request: ``small`` 128x128, 9 frames, 10 steps, guidance 5; ``tiny`` 32x32,
5 frames, 4 steps), float32 on the CPU, ``torch.set_num_threads(--threads)`` (default: every core), random
text embeddings ([1, 512, D]: a forward's cost does not depend on their values), under ``torch.no_grad`` as
the denoise worker runs:

1. Three copies of the transformer: diffusers' model called as ``WanPipeline`` calls it (per step a
   conditional and an unconditional pass of batch 1 in ``cache_context``, then ``u + g (c - u)``); a
   ``Policy`` taking ``velocity`` eagerly; a ``Policy`` whose expert went through ``compile_experts``
   and ``warm_up`` (timed: the compile).
2. One untimed run of each row, then ``--rounds`` rounds; a round runs every row once (one whole denoise of
   the request: ``steps`` guided steps and a plain Euler update), in an order that rotates per round, so
   that the machine's noise hits them alike. Medians are reported, and the CPU other processes took (/proc).
3. Checks: max |compiled - diffusers| over the final latents (float32: expected <= 1e-4), and the graphs
   compiled after the warm-up (dynamo's counters: expected 0).

Prints per row the median seconds per denoise and per forward and the ratio to diffusers', the warm-up
(compile) time, and the target: compiled <= 0.8x diffusers eager.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve import CpuMeter  # noqa: E402
from common.diffusion.compiled import compile_experts, warm_up  # noqa: E402
from common.diffusion.model_info import ModelInfo  # noqa: E402
from common.families.wan.text import MAX_SEQUENCE_LENGTH  # noqa: E402
from common.families import read_model  # noqa: E402
from common.diffusion.policy import ModelInput, Policy  # noqa: E402
from common.builtin import ensure_builtin  # noqa: E402

TARGET = 0.8  # compiled / diffusers eager
TOLERANCE = 1e-4
ROW_DIFF, ROW_EAGER, ROW_COMPILED = "diffusers eager (WanPipeline's calls)", "policy eager", "policy compiled"


class Request:
    """The preset model's default request: initial latents, timesteps, text embeddings, guidance."""

    def __init__(self, info: ModelInfo, text_dim: int):
        d = info.defaults
        g = torch.Generator().manual_seed(0)
        self.latents = torch.randn(info.latent_shape(d["height"], d["width"], d["num_frames"]), generator=g)
        self.steps, self.guidance = d["num_inference_steps"], d["guidance_scale"]
        self.timesteps = torch.linspace(info.num_train_timesteps - 1, 0, self.steps)
        self.cond, self.uncond = (torch.randn(1, MAX_SEQUENCE_LENGTH, text_dim, generator=g) for _ in range(2))
        self.describe = (f"{d['height']}x{d['width']}, {d['num_frames']} frames, {self.steps} steps, guidance "
                         f"{self.guidance}: latents {list(self.latents.shape)}")

    def denoise(self, velocity) -> torch.Tensor:
        """``steps`` guided steps with a plain Euler update (the same for every row)."""
        x = self.latents
        for t in self.timesteps:
            x = x - velocity(x, t) / self.steps
        return x


def diffusers_velocity(model, req: Request):
    def velocity(x, t):
        ts = t.expand(x.shape[0])
        with model.cache_context("cond"):
            c = model(hidden_states=x, timestep=ts, encoder_hidden_states=req.cond, return_dict=False)[0]
        with model.cache_context("uncond"):
            u = model(hidden_states=x, timestep=ts, encoder_hidden_states=req.uncond, return_dict=False)[0]
        return u + req.guidance * (c - u)
    return velocity


def policy_velocity(policy: Policy, req: Request):
    return lambda x, t: policy.velocity(ModelInput(x, t, req.cond, req.uncond, req.guidance))


def run_preset(name: str, args) -> dict:
    from diffusers import WanTransformer3DModel

    info = read_model(ensure_builtin(name))
    diff_model = WanTransformer3DModel.from_pretrained(info.path / "transformer", dtype=torch.float32).eval()
    eager, compiled = (Policy.load(info, torch.float32, "cpu") for _ in range(2))
    req = Request(info, diff_model.config.text_dim)
    params = sum(p.numel() for p in diff_model.parameters())
    print(f"\n== preset {name}: {params / 1e6:.2f}M parameters, {req.describe}", flush=True)
    if args.freezing:
        torch._inductor.config.freezing = True
    compile_experts(compiled.experts, mode=args.mode, log_recompiles=False)
    with torch.no_grad():
        compile_s = sum(warm_up(compiled, batch=1).values())
    print(f"warm-up (compile) {compile_s:.1f}s", flush=True)
    rows = {ROW_DIFF: diffusers_velocity(diff_model, req), ROW_EAGER: policy_velocity(eager, req),
            ROW_COMPILED: policy_velocity(compiled, req)}
    names = list(rows)
    times: dict[str, list[float]] = {r: [] for r in names}
    other: dict[str, list[float]] = {r: [] for r in names}
    outs: dict[str, torch.Tensor] = {}
    meter = CpuMeter([])
    graphs_before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for r in range(args.rounds + 1):
            order = names[r % len(names):] + names[: r % len(names)]
            for row in order:
                meter.start()
                t0 = time.perf_counter()
                outs[row] = req.denoise(rows[row])
                seconds = time.perf_counter() - t0
                cpu = meter.stop()
                if r > 0:
                    times[row].append(seconds)
                    other[row].append(cpu.get("cpu_cores_other", 0.0))
                print(f"  {'(warm-up) ' if r == 0 else ''}{row:<40} {seconds:8.3f}s", flush=True)
    recompiled = counters["stats"]["unique_graphs"] - graphs_before  # the warm-up compiled them all: 0 expected
    med = {row: statistics.median(v) for row, v in times.items()}
    forwards = 2 * req.steps
    result_rows = [{"row": row, "seconds": med[row], "per_forward_s": med[row] / forwards,
                    "vs_diffusers": med[row] / med[ROW_DIFF], "runs_s": times[row],
                    "other_cores_per_run": other[row]} for row in names]
    diff = (outs[ROW_COMPILED] - outs[ROW_DIFF]).abs().max().item()
    ratio = med[ROW_COMPILED] / med[ROW_DIFF]
    return {"preset": name, "request": req.describe, "parameters": params, "rows": result_rows,
            "compile_s": compile_s, "graphs_compiled_after_warm_up": recompiled,
            "max_diff_compiled_vs_diffusers": diff, "tolerance": TOLERANCE,
            "target": {"ratio": ratio, "limit": TARGET, "met": ratio <= TARGET},
            "settings": {"mode": args.mode, "freezing": args.freezing, "threads": torch.get_num_threads(),
                         "rounds": args.rounds, "torch": torch.__version__, "cpu_count": os.cpu_count()}}


def print_report(res: dict) -> None:
    s = res["settings"]
    print(f"\npreset {res['preset']} ({res['parameters'] / 1e6:.2f}M parameters): {res['request']}; float32, CPU, "
          f"{s['threads']} threads, mode {s['mode'] or 'default'}{', freezing' if s['freezing'] else ''}; "
          f"median of {s['rounds']} rounds")
    head = f"{'row':<40} {'s / denoise':>12} {'ms / forward':>13} {'x diffusers':>12}"
    print(head)
    print("-" * len(head))
    for r in res["rows"]:
        print(f"{r['row']:<40} {r['seconds']:>12.3f} {1000 * r['per_forward_s']:>13.1f} {r['vs_diffusers']:>12.2f}")
    busy = [(r["row"], max(r["other_cores_per_run"])) for r in res["rows"] if max(r["other_cores_per_run"]) > 0.2]
    if busy:
        print("WARNING: other processes used CPU during " + ", ".join(f"{n} ({c:.2f} cores)" for n, c in busy))
    t, diff = res["target"], res["max_diff_compiled_vs_diffusers"]
    for line in (f"warm-up (compile) {res['compile_s']:.1f}s; graphs compiled after it: "
                 f"{res['graphs_compiled_after_warm_up']}",
                 f"max |compiled - diffusers| {diff:.1e}: {'OK' if diff <= res['tolerance'] else 'MISMATCH'}",
                 f"target compiled <= {t['limit']}x diffusers eager: {t['ratio']:.2f}x, "
                 f"{'MET' if t['met'] else 'NOT MET'}"):
        print(line)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", choices=["tiny", "small"], default=["small"])
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds, median reported")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads")
    ap.add_argument("--mode", help="torch.compile mode, e.g. max-autotune-no-cudagraphs (default: the default)")
    ap.add_argument("--freezing", action="store_true", help="torch._inductor.config.freezing (weights as constants)")
    ap.add_argument("--json", type=Path, help="write every number here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    torch.set_num_threads(args.threads)
    results = [run_preset(name, args) for name in args.preset]
    for res in results:
        print_report(res)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
