"""LoRA adapters: throughput with many adapters in one batch, next to diffusers' set_adapters, and push times.

    python bench/lora.py                                  # tiny and small, 16 concurrent requests, 8 adapters
    python bench/lora.py --models tiny --rounds 3         # more rounds on one model
    python bench/lora.py --push-ranks 4 16 64 --push-repeats 3 --json bench/results/lora.json

What it does, per model (``--models``):

1. Writes ``--adapters`` adapters (rank ``--rank``, alpha = rank, on the attention projections of every block,
   seeded random factors) as diffusers LoRA files (``WanPipeline.save_lora_weights``), starts an engine with a
   weight root holding them and loads them all.
2. Three scenarios, each ``--requests`` requests sent at once (16 by default: the same prompts, seeds, size,
   steps and guidance in each; latents out, so the VAE does not dilute the comparison):
   ``none`` (no adapter), ``one`` (all with the first adapter), ``8 adapters`` (request i takes adapter
   i mod 8, round robin). One untimed warm-up per scenario, then ``--rounds`` rounds in which the scenarios
   take turns (so drift from other work on the machine hits them alike); the median round counts.
3. diffusers' ``WanPipeline`` in this process, all adapters loaded with ``load_lora_weights``, the same
   requests one after another with ``set_adapters([name], [1.0])`` switched per request (what a user has
   today); ``torch.set_num_threads(os.cpu_count())`` as in bench/serve.py. Its output for request 0 is
   compared with the engine's in the round-robin scenario (max abs diff; both float32).
4. On ``--push-model`` (small): time to push an adapter of each ``--push-ranks`` rank into the engine from the
   trainer's memory (``EngineClient.load_lora_adapter_from_tensors``) and from disk (save with diffusers, then
   ``load_lora_adapter``), median of ``--push-repeats``; both loads of the same tensors must report the same
   sha256.

Prints tables (req/s, the ratio of 8 adapters to none: the target is at most 15% slower, i.e. >= 0.85, and
the CPU the phase took from this benchmark and the engine and from everything else on the machine, which on a
shared machine skews every figure); ``--json`` writes every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common.runtime.engine_process import EngineProcess  # noqa: E402
from common.diffusion.model_info import ModelInfo  # noqa: E402
from common.families import read_model  # noqa: E402
from common.builtin import ensure_builtin  # noqa: E402
from router.client import EngineClient  # noqa: E402
from serve import PROMPTS, CpuMeter  # noqa: E402

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # both attentions of every block, as peft matches them
# Per model: the request size (small: 64x64 instead of its default 128x128, to keep the run to minutes).
PRESETS = {
    "tiny": dict(height=32, width=32, num_frames=5, steps=4),
    "small": dict(height=64, width=64, num_frames=9, steps=5),
}
SCENARIOS = ("none", "one", "8 adapters")


# --------------------------------------------------------------------------
# Adapters
# --------------------------------------------------------------------------


def linear_shapes(model_dir: Path, targets=TARGETS) -> dict[str, tuple[int, int]]:
    """(in, out) of every Linear of the transformer whose path ends with a target (peft's rule)."""
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        config = WanTransformer3DModel.load_config(model_dir / "transformer")
        model = WanTransformer3DModel.from_config(config)
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)}


def lora_state(shapes: dict[str, tuple[int, int]], rank: int, seed: int, strength: float = 0.3):
    """A peft-style state dict (``blocks.0.attn1.to_q.lora_A.weight``) with seeded values."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (d_in, d_out) in sorted(shapes.items()):
        sd[f"{name}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in ** 0.5
        sd[f"{name}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * strength / rank ** 0.5
    return sd


def save_diffusers(out_dir: Path, sd: dict, rank: int) -> Path:
    from diffusers import WanPipeline

    WanPipeline.save_lora_weights(out_dir, transformer_lora_layers=sd,
                                  transformer_lora_adapter_metadata={"r": rank, "lora_alpha": rank,
                                                                     "target_modules": TARGETS})
    return out_dir


# --------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------


def bodies(model: str, args) -> list[dict]:
    p = {**PRESETS.get(model, {}), **{k: v for k, v in (("height", args.height), ("width", args.width),
                                                          ("num_frames", args.num_frames), ("steps", args.steps))
                                      if v is not None}}
    d = read_model(ensure_builtin(model)).defaults
    return [{"prompt": PROMPTS[i % len(PROMPTS)], "negative_prompt": "", "seed": 1000 + i,
             "height": p.get("height", d["height"]), "width": p.get("width", d["width"]),
             "num_frames": p.get("num_frames", d["num_frames"]),
             "num_inference_steps": p.get("steps", d["num_inference_steps"]), "guidance_scale": 5.0,
             "output_type": "latent"} for i in range(args.requests)]


def with_adapters(reqs: list[dict], scenario: str, names: list[str]) -> list[dict]:
    if scenario == "none":
        return reqs
    if scenario == "one":
        return [{**r, "lora_name": names[0]} for r in reqs]
    return [{**r, "lora_name": names[i % len(names)]} for i, r in enumerate(reqs)]


def burst(c: EngineClient, reqs: list[dict]) -> tuple[float, list[dict]]:
    """All requests at once; the wall time until the last answer, and the samples."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(reqs)) as pool:
        samples = list(pool.map(lambda b: c.generate(**b)["samples"][0], reqs))
    return time.perf_counter() - t0, samples


def engine_throughput(c: EngineClient, reqs, names, rounds: int, meter: CpuMeter) -> tuple[dict, dict]:
    per = {s: [] for s in SCENARIOS}
    batches, cpu, kept = {s: [] for s in SCENARIOS}, {}, {}
    for s in SCENARIOS:  # warm-up: the first forward with each adapter prepares its modules
        burst(c, with_adapters(reqs[: max(2, len(names))], s, names))
    meter.start()
    for _ in range(rounds):
        for s in SCENARIOS:
            wall, samples = burst(c, with_adapters(reqs, s, names))
            per[s].append(wall)
            batches[s].append(max(x["batch"] for x in samples))
            kept[s] = samples[0]["output"]
    cpu = meter.stop()
    rows = {s: {"req_s": len(reqs) / statistics.median(per[s]), "walls_s": per[s], "max_batch": max(batches[s])}
            for s in SCENARIOS}
    return rows, {"cpu": cpu, "outputs": kept}


def diffusers_throughput(model_dir: Path, reqs, paths: dict[str, Path], meter: CpuMeter) -> tuple[dict, torch.Tensor]:
    from diffusers import WanPipeline

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        pipe = WanPipeline.from_pretrained(model_dir, dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        for name, path in paths.items():
            pipe.load_lora_weights(str(path), adapter_name=name)
        names = list(paths)

        def run(i, body):
            pipe.set_adapters([names[i % len(names)]], [1.0])
            with torch.no_grad():
                return pipe(prompt=body["prompt"], negative_prompt=body["negative_prompt"], height=body["height"],
                            width=body["width"], num_frames=body["num_frames"],
                            num_inference_steps=body["num_inference_steps"], guidance_scale=body["guidance_scale"],
                            generator=torch.Generator("cpu").manual_seed(body["seed"]), output_type="latent").frames[0]

        run(0, reqs[0])  # warm-up, untimed
        meter.start()
        t0 = time.perf_counter()
        first = None
        for i, body in enumerate(reqs):
            out = run(i, body)
            first = out if first is None else first
        wall = time.perf_counter() - t0
        return {"req_s": len(reqs) / wall, "wall_s": wall, "cpu": meter.stop()}, first
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------
# Push
# --------------------------------------------------------------------------


def push_times(c: EngineClient, model_dir: Path, work: Path, ranks, repeats: int) -> list[dict]:
    shapes = linear_shapes(model_dir)
    rows = []
    for rank in ranks:
        sd = lora_state(shapes, rank, seed=rank)
        mb = sum(t.numel() * t.element_size() for t in sd.values()) / 2**20
        mem, mem_worker, save, disk, disk_worker = [], [], [], [], []
        for i in range(repeats):
            t0 = time.perf_counter()
            r_mem = c.load_lora_adapter_from_tensors(f"push-r{rank}", sd, rank=rank, alpha=rank)
            t1 = time.perf_counter()
            path = save_diffusers(work / f"push-r{rank}-{i}", sd, rank)
            t2 = time.perf_counter()
            r_disk = c.load_lora_adapter(f"push-r{rank}", str(path))
            t3 = time.perf_counter()
            if r_mem["sha256"] != r_disk["sha256"]:
                raise SystemExit(f"rank {rank}: memory and disk loads of the same tensors differ "
                                 f"({r_mem['sha256'][:12]} vs {r_disk['sha256'][:12]})")
            mem.append(t1 - t0)
            mem_worker.append(r_mem.get("seconds", float("nan")))
            save.append(t2 - t1)
            disk.append(t3 - t2)
            disk_worker.append(r_disk.get("seconds", float("nan")))
        c.unload_lora_adapter(f"push-r{rank}")
        med = statistics.median
        rows.append({"rank": rank, "modules": len(shapes), "mb": mb, "memory_s": med(mem),
                     "memory_engine_s": med(mem_worker), "save_s": med(save), "disk_load_s": med(disk),
                     "disk_engine_s": med(disk_worker), "disk_total_s": med(save) + med(disk)})
    return rows


# --------------------------------------------------------------------------


def bench_model(model: str, args, work: Path) -> dict:
    model_dir = ensure_builtin(model)
    shapes = linear_shapes(model_dir)
    names = [f"lora{i}" for i in range(args.adapters)]
    paths = {n: save_diffusers(work / model / n, lora_state(shapes, args.rank, seed=i), args.rank)
             for i, n in enumerate(names)}
    reqs = bodies(model, args)
    extra = ["--weight-root", str(work), "--max-loras", str(max(16, args.adapters + 1))]
    result = {"model": model, "requests": len(reqs), "adapters": args.adapters, "rank": args.rank,
              "modules": len(shapes), "request": {k: reqs[0][k] for k in ("height", "width", "num_frames",
                                                                          "num_inference_steps")}}
    with EngineProcess(model, extra=extra, workdir=work / f"engine-{model}") as eng, EngineClient(eng.url) as c:
        meter = CpuMeter(eng.worker_pids() + [eng.proc.pid])
        for n, p in paths.items():
            c.load_lora_adapter(n, str(p))
        rows, extras = engine_throughput(c, reqs, names, args.rounds, meter)
        result["engine"], result["engine_cpu"] = rows, extras["cpu"]
        result["ratio_8_vs_none"] = rows["8 adapters"]["req_s"] / rows["none"]["req_s"]
        result["ratio_one_vs_none"] = rows["one"]["req_s"] / rows["none"]["req_s"]
        if not args.no_diffusers:
            d, first = diffusers_throughput(model_dir, reqs, paths, meter)
            result["diffusers"] = d
            result["engine_vs_diffusers_max_abs_diff"] = (extras["outputs"]["8 adapters"] - first).abs().max().item()
        if model == args.push_model:
            result["push"] = push_times(c, model_dir, work / "push", args.push_ranks, args.push_repeats)
    return result


def print_tables(results: list[dict]) -> None:
    served = [r for r in results if "engine" in r]
    if served:
        print(f"\n{'model':<6} {'request':<15} {'none req/s':>10} {'one req/s':>10} {'8 adapt. req/s':>14} "
              f"{'8 / none':>8} {'one / none':>10} {'diffusers req/s':>15} {'8 / diffusers':>13} {'max batch':>9} "
              f"{'cores ours/other':>16} {'max diff':>8}")
    for r in served:
        e, q = r["engine"], r["request"]
        size = f"{q['height']}x{q['width']}x{q['num_frames']} {q['num_inference_steps']}st"
        eight = e["8 adapters"]["req_s"]
        d = r.get("diffusers", {}).get("req_s")
        cpu = r.get("engine_cpu", {})
        cores = f"{cpu.get('cpu_cores_ours', float('nan')):.2f}/{cpu.get('cpu_cores_other', float('nan')):.2f}"
        print(f"{r['model']:<6} {size:<15} {e['none']['req_s']:>10.2f} {e['one']['req_s']:>10.2f} {eight:>14.2f} "
              f"{r['ratio_8_vs_none']:>8.3f} {r['ratio_one_vs_none']:>10.3f} "
              f"{(f'{d:.2f}' if d else '-'):>15} {(f'{eight / d:.2f}x' if d else '-'):>13} "
              f"{e['8 adapters']['max_batch']:>9} {cores:>16} "
              f"{r.get('engine_vs_diffusers_max_abs_diff', float('nan')):>8.1e}")
    busy = [r["model"] for r in served if r.get("engine_cpu", {}).get("cpu_cores_other", 0) > 0.25]
    if busy:
        print(f"note: other work on this machine took cores during the runs of {', '.join(busy)}; "
              "those figures are skewed (run again on an idle machine)")
    for r in results:
        if "push" not in r:
            continue
        print(f"\npush into {r['model']} ({r['push'][0]['modules']} modules; median seconds)")
        print(f"{'rank':>4} {'MB':>7} {'memory':>8} {'(engine)':>9} {'disk: save':>11} {'load':>7} {'(engine)':>9} "
              f"{'total':>7} {'disk / memory':>13}")
        for p in r["push"]:
            print(f"{p['rank']:>4} {p['mb']:>7.2f} {p['memory_s']:>8.3f} {p['memory_engine_s']:>9.3f} "
                  f"{p['save_s']:>11.3f} {p['disk_load_s']:>7.3f} {p['disk_engine_s']:>9.3f} "
                  f"{p['disk_total_s']:>7.3f} {p['disk_total_s'] / p['memory_s']:>12.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--requests", type=int, default=16, help="requests sent at once per scenario")
    ap.add_argument("--adapters", type=int, default=8, help="adapters in the round-robin scenario")
    ap.add_argument("--rank", type=int, default=16, help="rank of the serving adapters")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds (the scenarios take turns)")
    ap.add_argument("--height", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--num-frames", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--no-diffusers", action="store_true", help="skip diffusers' sequential baseline")
    ap.add_argument("--push-model", default="small", help="the model the push times are taken on ('' skips)")
    ap.add_argument("--push-ranks", nargs="+", type=int, default=[4, 16, 64])
    ap.add_argument("--push-repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))  # the engines may read adapters only below it
    results = [bench_model(m, args, work) for m in args.models]
    if args.push_model and args.push_model not in args.models:
        model_dir = ensure_builtin(args.push_model)
        with EngineProcess(args.push_model, extra=["--weight-root", str(work)], workdir=work / "engine-push") as eng, \
                EngineClient(eng.url) as c:
            results.append({"model": args.push_model,
                            "push": push_times(c, model_dir, work / "push", args.push_ranks, args.push_repeats)})
    print_tables(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
