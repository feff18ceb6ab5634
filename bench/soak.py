"""Soak: thousands of small mixed requests at a fixed concurrency, some of them invalid.

    python bench/soak.py [--requests 2000] [--concurrency 32] [--topology encoder=1,denoise=1,decode=1]
    python bench/soak.py --url http://127.0.0.1:8000      # against a running engine

Reports how many requests were answered as expected, failed (an unexpected
status) or lost (no answer), latency percentiles of the valid ones, and each
worker's resident memory after warm-up and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.runtime.engine_process import EngineProcess  # noqa: E402

INVALID = [
    {"prompt": "x", "height": 33},
    {"prompt": "x", "num_frames": 6},
    {"prompt": 5},
    {"prompt": "x", "num_inference_steps": 0},
    {"prompt": "x", "sigmas": [1.5]},
    {"prompt": "x", "unknown": True},
    {"prompt": "x", "n": 0},
]


def make_request(rng: random.Random, i: int, invalid_share: float) -> tuple[str, dict, int]:
    """(path, body, expected status)."""
    if rng.random() < invalid_share:
        path = rng.choice(["/generate", "/rollout/generate"])
        return path, dict(rng.choice(INVALID)), 400
    body = {"prompt": f"soak {i % 17}", "seed": i, "num_inference_steps": rng.randint(2, 5),
            "guidance_scale": rng.choice([1.0, 5.0])}
    if rng.random() < 0.5:
        body["output_type"] = rng.choice(["latent", "frames"])
        return "/generate", body, 200
    body.update(sde_type=rng.choice(["sde", "cps", "ode"]), return_trajectory=rng.random() < 0.3,
                sde_step_indices=rng.choice([None, [0, 1]]), noise_level=0.7)
    return "/rollout/generate", body, 200


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def worker_memory(url: str) -> dict[str, float | None]:
    workers = httpx.get(f"{url}/health").json()["workers"]
    return {f"{w['role']}-{w['index']}": rss_mb(w["pid"]) for w in workers if w["pid"]}


async def _run(url: str, n: int, concurrency: int, invalid_share: float, seed: int, warmup: int) -> dict:
    rng = random.Random(seed)
    plan = [make_request(rng, i, invalid_share) for i in range(n)]
    sem = asyncio.Semaphore(concurrency)
    latencies, statuses, lost, unexpected = [], {}, 0, []
    mem_start: dict = {}
    done = 0
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        async def one(path: str, body: dict, expect: int) -> None:
            nonlocal lost, done, mem_start
            async with sem:
                t0 = time.perf_counter()
                try:
                    r = await http.post(path, json=body)
                except httpx.HTTPError:
                    lost += 1
                    return
                finally:
                    done += 1
                    if done == warmup:
                        mem_start = worker_memory(url)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code != expect:
                    unexpected.append((path, body, r.status_code, r.text[:200]))
                elif expect == 200:
                    latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(*p) for p in plan))
        wall = time.perf_counter() - t0
    latencies.sort()

    def pct(q: float) -> float | None:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else None

    return {
        "requests": n, "concurrency": concurrency, "wall_s": wall,
        "answered_as_expected": n - lost - len(unexpected), "failed": len(unexpected), "lost": lost,
        "invalid_sent": sum(1 for p in plan if p[2] == 400), "statuses": statuses,
        "p50_s": pct(0.50), "p99_s": pct(0.99), "throughput_rps": n / wall,
        "memory_mb_after_warmup": mem_start, "memory_mb_end": worker_memory(url),
        "unexpected_examples": unexpected[:5],
    }


def run_soak(url: str, n: int = 2000, concurrency: int = 32, invalid_share: float = 0.1, seed: int = 0,
             warmup: int | None = None) -> dict:
    return asyncio.run(_run(url, n, concurrency, invalid_share, seed, warmup or max(1, n // 10)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running engine; default: start one")
    ap.add_argument("--topology", default="encoder=1,denoise=1,decode=1")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--invalid-share", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    engine = None if args.url else EngineProcess("tiny", args.topology)
    url = args.url or engine.url
    try:
        res = run_soak(url, args.requests, args.concurrency, args.invalid_share, args.seed)
    finally:
        if engine is not None:
            engine.stop()
    print(f"\nrequests {res['requests']} at concurrency {res['concurrency']} in {res['wall_s']:.1f}s "
          f"({res['throughput_rps']:.1f} req/s); invalid sent: {res['invalid_sent']}")
    print(f"answered as expected {res['answered_as_expected']}  failed {res['failed']}  lost {res['lost']}  "
          f"statuses {res['statuses']}")
    print(f"latency of valid requests: p50 {res['p50_s']:.3f}s  p99 {res['p99_s']:.3f}s")
    print(f"{'worker':<10} {'RSS after warm-up MB':>21} {'RSS at end MB':>14}")
    for k, v in res["memory_mb_after_warmup"].items():
        end = res["memory_mb_end"].get(k)
        print(f"{k:<10} {v:>21.1f} {end:>14.1f}")
    if res["unexpected_examples"]:
        print("unexpected:", res["unexpected_examples"])
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
