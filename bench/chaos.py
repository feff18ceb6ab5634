"""Chaos soak: requests at a fixed concurrency while a random worker is SIGKILLed every few seconds.

    python bench/chaos.py                                  # both topologies below, 180 s each
    python bench/chaos.py --topologies encoder=2,denoise=2,decode=2 --seconds 60 --kill-every 3

For each topology: an engine (``--max-batch-size 1``, so that an answer does not depend on which requests it
shared a forward with), then ``--distinct`` requests (serving latents and frames, rollouts with log-probs,
CFG on and off) each run once alone: the references. Then ``--concurrency`` clients send those requests
again, at random, for ``--seconds``, while a killer SIGKILLs a random worker process every ``--kill-every``
seconds. Reported:

- requests sent and answers received (every request must get exactly one), by status and by attempts;
- answers that differ from their reference (max abs difference over every tensor: 0.0 expected);
- the router's (launcher's) resident memory after the references and at the end, and each surviving
  worker's;
- after the stop: processes and shared-memory segments of the engine left behind (none expected).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.soak import rss_mb  # noqa: E402
from common.runtime.engine_process import EngineProcess  # noqa: E402
from common.transport.shm import engine_prefix  # noqa: E402
from router.client import EngineClient, EngineHTTPError  # noqa: E402

TENSORS = ("output", "log_probs", "log_prob_steps")


def requests(distinct: int) -> list[tuple[str, dict]]:
    out = []
    for i in range(distinct):
        body = {"prompt": f"chaos {i}", "seed": 1000 + i, "num_inference_steps": 3 + i % 4,
                "guidance_scale": (1.0, 5.0)[i % 2]}
        if i % 3 == 2:
            out.append(("/rollout/generate", {**body, "noise_level": 0.7}))
        else:
            out.append(("/generate", {**body, "output_type": ("latent", "frames")[i % 3]}))
    return out


def difference(got: dict, want: dict) -> float:
    diff = 0.0
    for g, w in zip(got["samples"], want["samples"]):
        for key in TENSORS:
            if key in w:
                diff = max(diff, (g[key] - w[key]).abs().max().item())
    return diff


def killer(engine: EngineProcess, every_s: float, stop: threading.Event, kills: list) -> None:
    rng = random.Random(7)
    while not stop.wait(every_s):
        try:
            workers = [w for w in engine.http.get("/health", timeout=10).json()["workers"] if w["pid"]]
            victim = rng.choice(workers)
            os.kill(victim["pid"], signal.SIGKILL)
            kills.append(f"{victim['role']}-{victim['index']}")
        except Exception:  # a worker gone by itself, or /health busy: try at the next tick
            continue


def leftovers(engine: EngineProcess) -> tuple[list[int], list[str]]:
    procs = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and str(engine.workdir).encode() in (d / "cmdline").read_bytes():
                procs.append(int(d.name))
        except OSError:
            continue
    prefix = engine_prefix(str(engine.runtime))
    return procs, [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix)]


def run(topology: str, seconds: float, kill_every: float, concurrency: int, distinct: int) -> dict:
    engine = EngineProcess("tiny", topology, extra=["--max-batch-size", "1"])
    plan = requests(distinct)
    try:
        client = EngineClient(engine.url)
        refs = [client._post(path, body) for path, body in plan]
        router_start = rss_mb(engine.proc.pid)
        stop, kills = threading.Event(), []
        statuses, attempts, wrong, sent = Counter(), Counter(), [], [0]
        lock = threading.Lock()

        def client_loop(k: int) -> None:
            rng, c = random.Random(k), EngineClient(engine.url, timeout=600)
            while not stop.is_set():
                i = rng.randrange(len(plan))
                with lock:
                    sent[0] += 1
                try:
                    got = c._post(*plan[i])
                    status = 200
                except EngineHTTPError as e:
                    status, got = f"{e.status} {e.error.get('type')}", None
                except httpx.HTTPError as e:  # no HTTP answer at all: what must never happen
                    status, got = f"no answer ({type(e).__name__})", None
                with lock:
                    statuses[status] += 1
                    if got is not None:
                        attempts[got["attempts"]] += 1
                        if (d := difference(got, refs[i])) != 0.0:
                            wrong.append((i, d))

        chaos = threading.Thread(target=killer, args=(engine, kill_every, stop, kills), daemon=True)
        chaos.start()
        with ThreadPoolExecutor(concurrency) as pool:
            for k in range(concurrency):
                pool.submit(client_loop, k)
            time.sleep(seconds)
            stop.set()
        workers = {f"{w['role']}-{w['index']}": rss_mb(w["pid"])
                   for w in engine.http.get("/health").json()["workers"] if w["pid"]}
        result = dict(topology=topology, sent=sent[0], answered=sum(statuses.values()), statuses=dict(statuses),
                      attempts=dict(sorted(attempts.items())), wrong=wrong, kills=Counter(kills),
                      router_mb=(router_start, rss_mb(engine.proc.pid)), workers_mb=workers)
    finally:
        engine.stop()
    result["left_processes"], result["left_segments"] = leftovers(engine)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topologies", nargs="+", default=["encoder=2,denoise=2,decode=2", "encoder=1,denoise=1,decode=1"])
    p.add_argument("--seconds", type=float, default=180)
    p.add_argument("--kill-every", type=float, default=4)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--distinct", type=int, default=24)
    args = p.parse_args()
    for topology in args.topologies:
        r = run(topology, args.seconds, args.kill_every, args.concurrency, args.distinct)
        print(f"\n{r['topology']}: {args.seconds:.0f} s at concurrency {args.concurrency}, a kill every "
              f"{args.kill_every:.0f} s ({sum(r['kills'].values())} kills: {dict(r['kills'])})")
        print(f"  sent {r['sent']}, answered {r['answered']}; statuses {r['statuses']}; attempts {r['attempts']}")
        print(f"  answers unequal to their reference: {len(r['wrong'])} {r['wrong'][:5]}")
        print(f"  router RSS {r['router_mb'][0]:.0f} -> {r['router_mb'][1]:.0f} MB; workers at the end (MB): "
              + ", ".join(f"{k} {v:.0f}" for k, v in r["workers_mb"].items() if v))
        print(f"  left after stop: {len(r['left_processes'])} processes, {len(r['left_segments'])} segments")


if __name__ == "__main__":
    main()
