"""Step caching (teacache, first_block): latency, transformer passes and the difference from the uncached output
at several thresholds, and throughput of concurrent requests, each against the same engine without caching.

    python bench/cache.py                                      # small-smooth and small-flux-smooth, 50 steps
    python bench/cache.py --models small-smooth --requests 3   # one model, more requests per row
    python bench/cache.py --thresholds 0.02 0.08 0.3 --methods first_block
    python bench/cache.py --models tiny-smooth tiny-flux-smooth --steps 8 --concurrency 4
    python bench/cache.py --url http://127.0.0.1:8000          # a running engine (one model) instead of starting one
    python bench/cache.py --json bench/results/cache.json

What it does, per model (``--models``; built-in ``-smooth`` models, whose time embedding moves a few percent
per step as a trained model's, docs/operations.md "Models with a smooth time embedding"):

1. Starts one engine (``launch.py --model M``, ``--topology``, ``--extra``; ``--max-batch-size`` its default),
   or uses ``--url``. Every request carries ``cache``: ``null`` for the uncached runs, ``{"method", "threshold"}``
   for the cached ones, so both run on the same engine, side by side.
2. Request ``i``: prompt ``PROMPTS[i mod 8]`` (bench/serve.py's), seed ``--seed * 1000 + i``, ``--steps``
   steps, frames output ([F, H, W, 3] in [0, 1]; one frame for images), CFG on: ``guidance_scale``
   ``--guidance`` (Wan, SD3), or for families whose CFG is ``true_cfg_scale`` (FLUX, Qwen-Image) true CFG
   ``--true-cfg`` with the negative prompt ``" "`` and the model's own ``guidance_scale`` (FLUX: its embedded
   guidance). Size: SIZES (a smaller one than the model's default where 50 steps would take too long on a
   CPU), else the model's default; ``--height`` / ``--width`` / ``--num-frames`` override.
3. Warm-up (not counted): every prompt once at one step without caching (the encoder's prompt cache then
   serves every configuration alike), and one request per method at a few steps.
4. One request at a time: the uncached baseline, then each method at each ``--thresholds`` value; ``--requests``
   rounds, each sending request ``i`` once per configuration in turn (drift from other work on the machine
   hits every configuration alike). Per configuration: median latency (and the denoise stage's), speedup
   (the baseline's median / this one's), mean ``transformer_passes`` and ``cached_steps`` per sample, and
   against the baseline's output of the same request: max abs difference of the frames and PSNR
   (10 log10(1 / MSE), frames in [0, 1]; mean and worst over the requests).
5. ``--concurrency`` requests at once (closed loop, as many requests as the level), without caching and with
   each method at its default threshold: throughput (req/s) and its ratio to the uncached level; the outputs'
   PSNR against the uncached level's output of the same request.

Prints tables per model and a summary with the targets at the default threshold (0.08): latency at least
1.6x lower at c=1 and throughput at least 1.5x higher at ``--concurrency``. The CPU each phase took from this
benchmark and the engine, and from everything else on the machine (which skews every figure), is printed
too. ``--json`` writes every number. Random weights make absolute quality meaningless: the difference from
the uncached output is what this measures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve import PROMPTS, CpuMeter  # noqa: E402
from common.diffusion.cache_signals import teacache_settings  # noqa: E402
from common.diffusion.step_cache import METHODS  # noqa: E402
from common.families import read_model  # noqa: E402
from common.runtime.engine_process import EngineProcess  # noqa: E402
from router.client import EngineClient  # noqa: E402

DEFAULT_MODELS = ["small-smooth", "small-flux-smooth"]
# Request sizes where the model's default makes 50 steps too slow for a run of minutes on a 2-core CPU.
SIZES = {
    "small-smooth": dict(height=64, width=64, num_frames=5),
    "small-flux-smooth": dict(height=128, width=128),
    "small-sd3-smooth": dict(height=128, width=128),
    "small-qwen-image-smooth": dict(height=128, width=128),
}
TARGET_LATENCY = 1.6  # uncached c=1 median latency / cached, at the default threshold
TARGET_THROUGHPUT = 1.5  # cached req/s / uncached req/s at --concurrency, at the default threshold
NEGATIVE = " "
WARMUP_STEPS = 3


# --------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------


def request_fields(name: str, info, args) -> dict:
    """Everything but prompt, seed and cache: the same for every request to model ``name``."""
    d = info.defaults
    size = {**SIZES.get(name, {}),
            **{k: v for k, v in (("height", args.height), ("width", args.width), ("num_frames", args.num_frames))
               if v is not None}}
    fields = {"height": size.get("height", d["height"]), "width": size.get("width", d["width"]),
              "num_inference_steps": args.steps, "output_type": "frames", "negative_prompt": NEGATIVE}
    if info.family.video:
        fields["num_frames"] = size.get("num_frames", d["num_frames"])
    if info.family.cfg_field == "true_cfg_scale":
        fields["true_cfg_scale"] = args.true_cfg  # guidance_scale: the model's default (FLUX: embedded)
    else:
        fields["guidance_scale"] = args.guidance
    return fields


def config_label(cache: dict | None) -> str:
    return "none" if cache is None else f"{cache['method']} {cache['threshold']:g}"


class Client:
    """Sends request ``i`` of the mix with a cache setting; keeps its latency, timings, counts and frames."""

    def __init__(self, client: EngineClient, fields: dict, seed: int):
        self.client, self.fields, self.seed = client, fields, seed

    def send(self, i: int, cache: dict | None, meter: CpuMeter | None = None, **override) -> dict:
        """``meter``: also the CPU seconds this process and the engine took during the request (alone)."""
        body = {**self.fields, "seed": self.seed * 1000 + i, "cache": cache, **override}
        if meter is not None:
            meter.start()
        t0 = time.perf_counter()
        r = self.client.generate(PROMPTS[i % len(PROMPTS)], **body)
        latency = time.perf_counter() - t0
        cpu = meter.stop() if meter is not None else {}
        samples = r["samples"]
        return {"latency_s": latency, "denoise_s": r.get("timings", {}).get("denoise_s"),
                "cpu_s": cpu["cpu_cores_ours"] * latency if cpu else None,
                "cpu_cores_other": cpu.get("cpu_cores_other"),
                "transformer_passes": statistics.mean(s["transformer_passes"] for s in samples),
                "cached_steps": statistics.mean(s["cached_steps"] for s in samples),
                "frames": [frames01(s["output"]) for s in samples]}


def frames01(t: torch.Tensor) -> torch.Tensor:
    """Frames as float32 in [0, 1] (uint8 frames scaled)."""
    return t.float() / 255.0 if t.dtype == torch.uint8 else t.float()


def difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float | None]:
    """(max abs difference, PSNR in dB against peak 1; None where identical) of two requests' frames."""
    d = torch.cat([(x - y).flatten() for x, y in zip(a, b)])
    mse = float((d * d).mean())
    return float(d.abs().max()), (None if mse == 0 else 10 * math.log10(1.0 / mse))


# --------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------


def warm_up(sender: Client, args, count: int) -> None:
    for i in range(min(count, len(PROMPTS))):  # fills the encoder's prompt cache for every configuration
        sender.send(i, None, num_inference_steps=1, seed=2**40 + i)
    for method in args.methods:  # each method's code path (the probe, the modulated input) once
        sender.send(0, {"method": method, "threshold": METHODS[method].default_threshold},
                    num_inference_steps=min(args.steps, WARMUP_STEPS), seed=2**40)


def single(sender: Client, configs: list[dict | None], requests: int, meter: CpuMeter) -> list[dict]:
    """Every configuration one request at a time, in rounds; one row per configuration."""
    runs: dict[int, list[dict]] = {k: [] for k in range(len(configs))}
    for i in range(requests):
        for k, cache in enumerate(configs):
            runs[k].append(sender.send(i, cache, meter))
        print(f"  c=1 round {i + 1}/{requests}: " + ", ".join(
            f"{config_label(c)} {runs[k][-1]['latency_s']:.2f}s" for k, c in enumerate(configs)), flush=True)
    base = summarise(None, runs[0], runs[0])
    return [base] + [summarise(cache, runs[k], runs[0], base) for k, cache in enumerate(configs) if k]


def summarise(cache: dict | None, runs: list[dict], base_runs: list[dict], base: dict | None = None) -> dict:
    """One configuration's requests, against the uncached ones (``base_runs``, and their row ``base``)."""
    diffs = [difference(r["frames"], b["frames"]) for r, b in zip(runs, base_runs)]
    psnrs = [p for _, p in diffs if p is not None]
    med = lambda key: statistics.median(r[key] for r in runs) if all(r[key] is not None for r in runs) else None  # noqa: E731
    row = {"cache": cache, "label": config_label(cache), "requests": len(runs),
           "latency_p50_s": med("latency_s"), "latency_s": [r["latency_s"] for r in runs],
           "denoise_p50_s": med("denoise_s"), "cpu_p50_s": med("cpu_s"),
           "cpu_cores_other": statistics.mean(r["cpu_cores_other"] or 0.0 for r in runs),
           "transformer_passes": statistics.mean(r["transformer_passes"] for r in runs),
           "cached_steps": statistics.mean(r["cached_steps"] for r in runs),
           "max_abs_diff": max(d for d, _ in diffs), "identical": not psnrs,
           "psnr_mean_db": statistics.mean(psnrs) if psnrs else None,
           "psnr_min_db": min(psnrs) if psnrs else None}
    base = base or row
    row["speedup"] = base["latency_p50_s"] / row["latency_p50_s"]
    row["cpu_speedup"] = base["cpu_p50_s"] / row["cpu_p50_s"] if row["cpu_p50_s"] and base["cpu_p50_s"] else None
    return row


def concurrent(sender: Client, configs: list[dict | None], concurrency: int, meter: CpuMeter) -> list[dict]:
    """``concurrency`` requests at once per configuration, one configuration after another."""
    rows: list[dict] = []
    base_runs: list[dict] = []
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for cache in configs:
            meter.start()
            t0 = time.perf_counter()
            runs = list(pool.map(lambda i: sender.send(i, cache), range(concurrency)))
            wall = time.perf_counter() - t0
            cpu = meter.stop()
            base_runs = base_runs or runs
            row = summarise(cache, runs, base_runs, rows[0] if rows else None)
            row.update(wall_s=wall, req_per_s=concurrency / wall, **cpu)
            row["cpu_per_request_s"] = cpu["cpu_cores_ours"] * wall / concurrency if cpu else None
            base = rows[0] if rows else row
            row["throughput_ratio"] = row["req_per_s"] / base["req_per_s"]
            row["cpu_ratio"] = (base["cpu_per_request_s"] / row["cpu_per_request_s"]
                                if row["cpu_per_request_s"] and base["cpu_per_request_s"] else None)
            rows.append(row)
            print(f"  c={concurrency} {row['label']}: {wall:.1f}s, {row['req_per_s']:.3f} req/s "
                  f"({row['throughput_ratio']:.2f}x)", flush=True)
    return rows


def targets(res: dict) -> dict:
    """Per method at its default threshold: speedup at c=1 and throughput ratio, against the targets."""
    out = {}
    for method in res["methods"]:
        t = METHODS[method].default_threshold
        s = next((r for r in res["single"] if r["cache"] and r["cache"]["method"] == method
                  and r["cache"]["threshold"] == t), {})
        c = next((r for r in res["concurrent"] if r["cache"] and r["cache"]["method"] == method), {})
        out[method] = {"threshold": t, "latency_speedup": s.get("speedup"), "latency_cpu_ratio": s.get("cpu_speedup"),
                       "latency_met": (s.get("speedup") or 0) >= TARGET_LATENCY,
                       "throughput_ratio": c.get("throughput_ratio"), "throughput_cpu_ratio": c.get("cpu_ratio"),
                       "throughput_met": (c.get("throughput_ratio") or 0) >= TARGET_THROUGHPUT}
    return out


def bench_model(model: str | None, args) -> dict:
    engine = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        print(f"starting engine: --model {model} --topology {args.topology} {' '.join(args.extra)}", flush=True)
        engine = EngineProcess(model, args.topology, args.extra)
        url = engine.url
    try:
        with EngineClient(url, timeout=args.request_timeout) as client:
            health = client.health()
            info = read_model(health["model"])
            teacache = dict(zip(("coefficients", "warmup"), teacache_settings(info)))  # as the engine read them
            name = model or Path(health["model"]).name
            fields = request_fields(name, info, args)
            sender = Client(client, fields, args.seed)
            pids = [w["pid"] for w in health["workers"] if w.get("pid")] + ([engine.proc.pid] if engine else [])
            meter = CpuMeter(pids)
            print(f"{name}: {describe(fields)}; warm-up", flush=True)
            warm_up(sender, args, max(args.requests, args.concurrency))
            configs = [None] + [{"method": m, "threshold": t} for m in args.methods for t in args.thresholds]
            rows = single(sender, configs, args.requests, meter)
            conc = []
            if args.concurrency > 0:
                conc_configs = [None] + [{"method": m, "threshold": METHODS[m].default_threshold} for m in args.methods]
                conc = concurrent(sender, conc_configs, args.concurrency, meter)
    finally:
        if engine is not None:
            engine.stop()
    base = rows[0]  # uncached: every row-step a transformer pass
    res = {"model": name, "model_dir": str(info.path), "pipeline": info.family.pipeline,
           "branches": round((base["transformer_passes"] + base["cached_steps"]) / args.steps), "request": fields,
           "teacache": teacache, "methods": args.methods, "single": rows,
           "concurrency": args.concurrency, "concurrent": conc,
           "engine": {"url": url, "started_by_bench": engine is not None, "topology": args.topology,
                      "extra": args.extra}}
    res["targets"] = targets(res)
    return res


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def describe(fields: dict) -> str:
    size = f"{fields['height']}x{fields['width']}" + (f", {fields['num_frames']} frames" if "num_frames" in fields
                                                      else ", image")
    cfg = (f"true CFG {fields['true_cfg_scale']:g} (negative {NEGATIVE!r}), embedded guidance the model's default"
           if "true_cfg_scale" in fields else f"CFG guidance_scale {fields['guidance_scale']:g}")
    return f"{size}, {fields['num_inference_steps']} steps, {cfg}, frames output"


def _f(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _psnr(row: dict) -> str:
    if row["identical"]:
        return "identical"
    return f"{_f(row['psnr_mean_db'], 1)} / {_f(row['psnr_min_db'], 1)}"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _method(row: dict) -> str:
    return row["cache"]["method"] if row["cache"] else "none"


def _threshold(row: dict) -> str:
    return "-" if row["cache"] is None else f"{row['cache']['threshold']:g}"


def print_report(results: list[dict], meta: dict) -> None:
    print(f"\nCPU cores: {os.cpu_count()}; load average (1/5/15 min) at start "
          f"{'/'.join(f'{x:.1f}' for x in meta['loadavg_at_start'])}, at end "
          f"{'/'.join(f'{x:.1f}' for x in meta['loadavg_at_end'])}")
    for res in results:
        steps = res["request"]["num_inference_steps"]
        print(f"\n### {res['model']} ({res['pipeline']}): {describe(res['request'])}")
        tc = res["teacache"]
        print(f"teacache polynomial {[float(f'{c:.4g}') for c in tc['coefficients']]}, warm-up {tc['warmup']} steps")
        print(f"one request at a time, {res['single'][0]['requests']} per row, medians; {steps} steps x "
              f"{res['branches']} branches = {steps * res['branches']} row-steps per sample")
        print("| cache | threshold | p50 s | speedup | CPU s | CPU ratio | transformer_passes | cached_steps "
              "| max abs diff | PSNR dB mean / min | other cores |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in res["single"]:
            print(f"| {_method(r)} | {_threshold(r)} | {r['latency_p50_s']:.2f} | {r['speedup']:.2f}x "
                  f"| {_f(r['cpu_p50_s'], 2)} | {_x(r['cpu_speedup'])} | {r['transformer_passes']:.1f} "
                  f"| {r['cached_steps']:.1f} | {r['max_abs_diff']:.2g} | {_psnr(r)} | {r['cpu_cores_other']:.2f} |")
        if res["concurrent"]:
            print(f"\n{res['concurrency']} requests at once")
            print("| cache | threshold | wall s | req/s | vs none | CPU s / request | CPU ratio | transformer_passes "
                  "| cached_steps | PSNR dB mean / min | other cores |")
            print("|---|---|---|---|---|---|---|---|---|---|---|")
            for r in res["concurrent"]:
                print(f"| {_method(r)} | {_threshold(r)} | {r['wall_s']:.1f} | {r['req_per_s']:.3f} "
                      f"| {r['throughput_ratio']:.2f}x | {_f(r['cpu_per_request_s'], 2)} | {_x(r['cpu_ratio'])} "
                      f"| {r['transformer_passes']:.1f} | {r['cached_steps']:.1f} | {_psnr(r)} "
                      f"| {_f(r.get('cpu_cores_other'), 2)} |")
    print("(speedup, vs none: the uncached row's median latency / this row's, this row's req/s / the uncached "
          "row's; CPU s: CPU seconds this benchmark and the engine took per request, CPU ratio: the uncached "
          "row's / this row's, what other work on the machine skews least; PSNR against the uncached output of "
          "the same request, frames in [0, 1]; other cores: cores other processes took meanwhile)")
    print(f"\ntargets at the default threshold: c=1 latency >= {TARGET_LATENCY}x lower, "
          f"throughput at the concurrency level >= {TARGET_THROUGHPUT}x")
    print("| model | method | threshold | c=1 speedup (CPU ratio) | | throughput ratio (CPU ratio) | |")
    print("|---|---|---|---|---|---|---|")
    for res in results:
        for method, t in res["targets"].items():
            print(f"| {res['model']} | {method} | {t['threshold']:g} | {_x(t['latency_speedup'])} "
                  f"({_x(t['latency_cpu_ratio'])}) | {'met' if t['latency_met'] else 'NOT met'} "
                  f"| {_x(t['throughput_ratio'])} ({_x(t['throughput_cpu_ratio'])}) "
                  f"| {'met' if t['throughput_met'] else 'NOT met'} |")
    busy = [res["model"] for res in results
            if any((ph.get("cpu_cores_other") or 0) > 0.25 for ph in [*res["single"], *res["concurrent"]])]
    if busy:
        print(f"note: other processes took CPU during the runs of {', '.join(busy)}: the wall-clock figures are "
              "skewed (the CPU ratios less so)")


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS,
                    help=f"models to start one after another (default: {' '.join(DEFAULT_MODELS)})")
    ap.add_argument("--url", help="a running engine instead of starting one (its model; --models is not used)")
    ap.add_argument("--topology", default="encoder=1,denoise=1,decode=1")
    ap.add_argument("--extra", default="", help="more launch.py flags, one string: --extra='--dtype float32'")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(METHODS))
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.04, 0.08, 0.16],
                    help="thresholds of the one-at-a-time rows, for every method (default 0.04 0.08 0.16; "
                         "concurrent requests use each method's default, 0.08)")
    ap.add_argument("--requests", type=int, default=2, help="requests per configuration, one at a time")
    ap.add_argument("--concurrency", type=int, default=16,
                    help="requests at once per configuration (0: skip that phase)")
    ap.add_argument("--height", type=int, help="default: SIZES, else the model's default")
    ap.add_argument("--width", type=int)
    ap.add_argument("--num-frames", type=int, help="video models only")
    ap.add_argument("--guidance", type=float, default=5.0, help="guidance_scale where it is the CFG scale")
    ap.add_argument("--true-cfg", type=float, default=4.0,
                    help="true_cfg_scale of FLUX and Qwen-Image (with the negative prompt ' ')")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=1800.0, help="client timeout per request, s")
    ap.add_argument("--json", type=Path, help="write every number here")
    args = ap.parse_args(argv)
    args.extra = args.extra.split()
    if args.steps < 2 or args.requests < 1 or args.concurrency < 0:
        ap.error("--steps must be >= 2, --requests >= 1, --concurrency >= 0")
    for method in args.methods:
        for t in args.thresholds:
            if not 0.0 < t <= METHODS[method].max_threshold:
                ap.error(f"{method} takes thresholds in (0, {METHODS[method].max_threshold}], got {t}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    meta = {"loadavg_at_start": os.getloadavg(), "cpu_count": os.cpu_count(), "steps": args.steps,
            "thresholds": args.thresholds, "methods": args.methods, "requests": args.requests,
            "concurrency": args.concurrency, "targets": {"latency": TARGET_LATENCY, "throughput": TARGET_THROUGHPUT}}
    t0 = time.perf_counter()
    models = [None] if args.url else args.models
    results = [bench_model(m, args) for m in models]
    meta.update(loadavg_at_end=os.getloadavg(), wall_s=time.perf_counter() - t0)
    print_report(results, meta)
    print(f"total {meta['wall_s']:.0f}s")
    out = {"config": meta, "models": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
