"""One request's latency on denoise workers of several layouts, next to diffusers' WanPipeline in this process.

    python bench/denoise_layouts.py                                   # small preset: the rows below, on the CPU
    python bench/denoise_layouts.py --preset tiny --repeats 3
    python bench/denoise_layouts.py --rows one compile                # some rows only
    python bench/denoise_layouts.py --preset wan-1.3b --rows one compile --device cuda   # bench/gpu.sh
    python bench/denoise_layouts.py --preset wan-1.3b --rows one ulysses2 cfg2 --device cuda  # several GPUs

Rows (each an engine started by this script, ``--dtype`` as the preset says, ``--max-batch-size 8``):

- ``diffusers``: ``WanPipeline`` loaded in this process, all cores (``torch.set_num_threads(os.cpu_count())``),
  eager; the reference every row is divided by.
- ``one``: a one-device denoise worker (``encoder=1,denoise=1,decode=1``).
- ``compile``: the same with ``--compile`` (each expert through torch.compile, warmed up at start; the
  compile time shows in the engine's start time, reported apart).
- ``ulysses2``, ``cfg2``, ``cfg2-ulysses2``: multi-device workers (``denoise=1:ulysses=2`` and so on); on
  the CPU their ranks share the machine's cores (so the point there is that they work, not speed);
  ``cfg2-compile``: CFG parallel with ``--compile``.

Every engine is started first (one at a time, so that their loads do not compete), then each of
``--repeats`` rounds sends the preset's request (latent output, CFG) once to each row in turn, so that the
machine's noise hits the rows alike; medians are reported. Each row's output is checked against the
``one`` row's (max abs difference, expected <= 1e-4 in float32).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.protocol.http_tensors import body_to_tensor  # noqa: E402
from common.runtime.engine_process import EngineProcess  # noqa: E402

MSGPACK = "application/msgpack"
PRESETS = {
    "tiny": dict(model="tiny", height=32, width=32, num_frames=5, steps=8, dtype="float32"),
    "small": dict(model="small", height=128, width=128, num_frames=9, steps=10, dtype="float32"),
    # Wan2.1-T2V-1.3B's shape, random weights, bf16 on GPUs: 480x832, 17 frames, 10 steps (as bench/serve.py).
    "wan-1.3b": dict(model="wan2.1-1.3b", height=480, width=832, num_frames=17, steps=10, dtype="bfloat16"),
}
LAYOUTS = {"one": ("denoise=1", []), "compile": ("denoise=1", ["--compile"]),
           "ulysses2": ("denoise=1:ulysses=2", []), "cfg2": ("denoise=1:cfg", []),
           "cfg2-ulysses2": ("denoise=1:ulysses=2:cfg", []), "cfg2-compile": ("denoise=1:cfg", ["--compile"])}
ROWS = ["diffusers", *LAYOUTS]


def body(p: dict, seed: int) -> dict:
    return {"prompt": "a red fox runs through the snow at dawn", "negative_prompt": "", "seed": seed,
            "height": p["height"], "width": p["width"], "num_frames": p["num_frames"],
            "num_inference_steps": p["steps"], "guidance_scale": 5.0, "output_type": "latent"}


def engine_call(url: str, req: dict):
    t = time.perf_counter()
    r = httpx.post(f"{url}/generate", json=req, headers={"accept": MSGPACK}, timeout=3600)
    r.raise_for_status()
    wall = time.perf_counter() - t
    sample = msgpack.unpackb(r.content)["samples"][0]
    return wall, body_to_tensor(sample["output"]).float()


class InProcessDiffusers:
    def __init__(self, model_dir: Path, dtype: str, device: str):
        import torch
        from diffusers import WanPipeline

        torch.set_num_threads(os.cpu_count() or 1)
        self.torch, self.device = torch, torch.device(device)
        self.pipe = WanPipeline.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(self.device)
        self.pipe.set_progress_bar_config(disable=True)

    def __call__(self, req: dict):
        torch = self.torch
        t = time.perf_counter()
        with torch.inference_mode():
            out = self.pipe(prompt=req["prompt"], negative_prompt=req["negative_prompt"], height=req["height"],
                            width=req["width"], num_frames=req["num_frames"],
                            num_inference_steps=req["num_inference_steps"], guidance_scale=req["guidance_scale"],
                            generator=torch.Generator("cpu").manual_seed(req["seed"]), output_type="latent").frames
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return time.perf_counter() - t, out[0].float().cpu()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=["diffusers", "one", "compile", "ulysses2", "cfg2"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (GPUs: the compact topology's round)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    p = PRESETS[args.preset]
    engines, started_s, calls, failed = {}, {}, {}, {}
    try:
        for row in (r for r in args.rows if r != "diffusers"):
            topology, extra = LAYOUTS[row]
            t = time.perf_counter()
            try:
                engines[row] = EngineProcess(p["model"], f"encoder=1,{topology},decode=1",
                                             ["--dtype", p["dtype"], "--max-batch-size", "8", *extra],
                                             ready_timeout_s=3600)
            except (RuntimeError, TimeoutError) as e:  # one layout that cannot start here spoils no other row
                failed[row] = str(e).splitlines()[0] if str(e) else type(e).__name__
                print(f"{row}: the engine did not start: {failed[row]}", file=sys.stderr)
                continue
            started_s[row] = time.perf_counter() - t
            calls[row] = lambda req, url=engines[row].url: engine_call(url, req)
            print(f"started {row} in {started_s[row]:.1f}s", file=sys.stderr)
        if "diffusers" in args.rows:
            model_dir = Path(next(iter(engines.values())).http.get("/health").json()["model"]) if engines else None
            calls["diffusers"] = InProcessDiffusers(model_dir, p["dtype"], args.device)
        times: dict[str, list[float]] = {r: [] for r in calls}
        outputs = {}
        for k in range(args.repeats + 1):  # round 0 warms up
            for row, call in calls.items():
                wall, out = call(body(p, 7))
                outputs[row] = out
                if k:
                    times[row].append(wall)
    finally:
        for e in engines.values():
            e.stop()
    ref = outputs.get("one", outputs.get("diffusers"))
    base = statistics.median(times["diffusers"]) if "diffusers" in times else None
    rows = []
    for row in calls:
        med = statistics.median(times[row])
        rows.append({"row": row, "median_s": med, "vs_diffusers": None if base is None else med / base,
                     "start_s": started_s.get(row), "max_abs_diff": (outputs[row] - ref).abs().max().item()})
    print(f"\npreset {args.preset}: {p['height']}x{p['width']}, {p['num_frames']} frames, {p['steps']} steps, CFG, "
          f"{p['dtype']}, {os.cpu_count()} cores, median of {args.repeats}")
    print(f"{'row':<15}{'latency s':>11}{'x diffusers':>13}{'start s':>10}{'max diff':>11}")
    for r in rows:
        vs = "" if r["vs_diffusers"] is None else f"{r['vs_diffusers']:.2f}"
        start = "" if r["start_s"] is None else f"{r['start_s']:.1f}"
        print(f"{r['row']:<15}{r['median_s']:>11.3f}{vs:>13}{start:>10}{r['max_abs_diff']:>11.1e}")
    for row, why in failed.items():
        print(f"{row:<15}did not start: {why}")
    result = {"preset": args.preset, "config": p, "repeats": args.repeats, "rows": rows, "failed": failed}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
