"""What a rollout's answer costs the trainer: bytes and time with the whole trajectory, the SDE window's steps
only, and streamed; and when the trainer holds its first sample, streamed against whole.

    python bench/rollout_answers.py                         # small (Wan) and small-sd3, a group of 16
    python bench/rollout_answers.py --model tiny tiny-sd3 --repeats 1
    python bench/rollout_answers.py --json bench/results/rollout-answers.json

Per model an engine (``launch.py --model M --dtype float32``) on a free loopback port; one group of ``--n``
samples, ``--steps`` steps with an SDE window of ``--window`` steps picked from the seed, CFG, frames decoded
(``output_type: "frames"``), answers in msgpack (raw bytes, as a trainer reads them). Rows, each once untimed
first, then ``--repeats`` rounds of every row in turn (the median reported; the machine is noisy, read the
ratios):

- ``whole trajectory``: ``return_trajectory`` (every step's latents);
- ``window only``: ``trajectory_steps: "sde"`` (x_i and x_{i+1} of each SDE step: what the recompute reads);
- ``window, uint8 frames``: the same with ``output_dtype: "uint8"``;
- ``window, streamed``: the same with ``stream: true``: the decode worker decodes one sample at a time and
  each sample is sent as soon as it is decoded.

Printed: answer bytes, wall time to the whole answer, time until the first sample is in the trainer's hands
(whole answers: the whole answer's), and the ratios to the first row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.runtime.engine_process import EngineProcess  # noqa: E402

ROWS = {
    "whole trajectory": {"return_trajectory": True},
    "window only": {"return_trajectory": True, "trajectory_steps": "sde"},
    "window, uint8 frames": {"return_trajectory": True, "trajectory_steps": "sde", "output_dtype": "uint8"},
    "window, streamed": {"return_trajectory": True, "trajectory_steps": "sde", "stream": True},
}


def run(client: httpx.Client, body: dict) -> dict:
    """One request: answer bytes, seconds to the answer, seconds to the first sample held."""
    t0 = time.perf_counter()
    if not body.get("stream"):
        r = client.post("/rollout/generate", json=body, headers={"Accept": "application/msgpack"})
        r.raise_for_status()
        msgpack.unpackb(r.content)
        total = time.perf_counter() - t0
        return {"bytes": len(r.content), "total_s": total, "first_s": total}
    first, size, items = None, 0, 0
    unpacker = msgpack.Unpacker(raw=False)
    with client.stream("POST", "/rollout/generate", json=body, headers={"Accept": "application/msgpack"}) as r:
        r.raise_for_status()
        for chunk in r.iter_bytes():
            size += len(chunk)
            unpacker.feed(chunk)
            for item in unpacker:
                if "index" in item:
                    items += 1
                    first = first if first is not None else time.perf_counter() - t0
    assert items == body["n"], items
    return {"bytes": size, "total_s": time.perf_counter() - t0, "first_s": first}


def bench_model(model: str, args) -> list[dict]:
    print(f"starting engine: --model {model}", flush=True)
    engine = EngineProcess(model, "encoder=1,denoise=1,decode=1", ["--dtype", "float32", "--max-n", str(args.n)])
    try:
        client = httpx.Client(base_url=engine.url, timeout=1200)
        base = {"prompt": "a heron in the reeds", "negative_prompt": "blurry", "guidance_scale": 4.0,
                "seed": 7, "n": args.n, "num_inference_steps": args.steps, "sde_window_size": args.window,
                "output_type": "frames"}
        runs: dict[str, list[dict]] = {name: [] for name in ROWS}
        for k in range(args.repeats + 1):  # round 0: the warm-up
            for name, extra in ROWS.items():
                got = run(client, {**base, "prompt": f"{base['prompt']} {k}", **extra})
                if k:
                    runs[name].append(got)
        client.close()
    finally:
        engine.stop()
    rows = []
    for name, got in runs.items():
        rows.append({"model": model, "row": name, "bytes": got[0]["bytes"],
                     "total_s": statistics.median(g["total_s"] for g in got),
                     "first_s": statistics.median(g["first_s"] for g in got)})
    ref = rows[0]
    for r in rows:
        r.update(bytes_ratio=r["bytes"] / ref["bytes"], total_ratio=r["total_s"] / ref["total_s"],
                 first_ratio=r["first_s"] / ref["first_s"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["small", "small-sd3"])
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = [r for m in args.model for r in bench_model(m, args)]
    head = f"{'model':<10} {'row':<22} {'answer MB':>10} {'x':>6} {'whole s':>8} {'x':>6} {'first s':>8} {'x':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:<10} {r['row']:<22} {r['bytes'] / 1e6:>10.2f} {r['bytes_ratio']:>6.2f} "
              f"{r['total_s']:>8.2f} {r['total_ratio']:>6.2f} {r['first_s']:>8.2f} {r['first_ratio']:>6.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
