"""Ray against the local launcher: time to ready, and one request's latency over cross-node tcp + CURVE links.

    python bench/ray_launch.py                          # tiny and small, 5 rounds
    python bench/ray_launch.py --models small --repeats 9

A local Ray cluster (``ray.cluster_utils.Cluster``: a head and two nodes on 127.0.0.1, each with its own
custom resource) is started once; its start time is reported apart. Then, per model, three engines of
``encoder=1,denoise=1,decode=1``, one at a time so that their loads do not compete:

- ``ipc``: the local launcher, ipc links (shared memory for large tensors), the default;
- ``tcp``: the local launcher with ``--transport tcp`` (CURVE on): the links' cost without Ray;
- ``ray``: ``launch.py --ray``, the encoder on the head, the denoise worker on the second node and the decode
  worker on the third: every link crosses nodes (tcp + CURVE), the router stays on the head.

"ready" is from starting ``launch.py`` to ``/health`` answering 200 (the built-in model is generated before).
Each of ``--repeats`` rounds sends the model's default request (frames out, so the decoded video crosses a
link too) once to each engine in turn, each round starting with the next engine; medians are reported, and every output is checked against ``ipc``'s
(max abs difference; 0.0 expected).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on 127.0.0.1 (read when Ray is imported)

from common.runtime.engine_process import EngineProcess  # noqa: E402
from common.builtin import ensure_builtin  # noqa: E402
from router.client import EngineClient  # noqa: E402

NODES = ("node_a", "node_b", "node_c")
PLACES = [("encoder", "node_a"), ("denoise", "node_b"), ("decode", "node_c")]


def start_cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, connect=False,
                head_node_args={"num_cpus": 2, "resources": {NODES[0]: 1}, "node_ip_address": "127.0.0.1"})
    for name in NODES[1:]:
        c.add_node(num_cpus=2, resources={name: 1}, node_ip_address="127.0.0.1")
    return c


def engines(model: str, address: str, tmp: Path) -> dict[str, tuple[EngineProcess, float]]:
    topology = tmp / f"{model}-ray.json"
    topology.write_text(json.dumps({"workers": [{"role": r, "resources": {n: 0.1}} for r, n in PLACES]}))
    kinds = {"ipc": ("encoder=1,denoise=1,decode=1", []),
             "tcp": ("encoder=1,denoise=1,decode=1", ["--transport", "tcp"]),
             "ray": (str(topology), ["--ray", address])}
    out = {}
    for kind, (topo, extra) in kinds.items():
        t0 = time.perf_counter()
        out[kind] = (EngineProcess(model, topo, extra=extra, workdir=tmp / f"{model}-{kind}"),
                     time.perf_counter() - t0)
    return out


def measure(model: str, address: str, repeats: int, tmp: Path) -> list[dict]:
    ensure_builtin(model)
    started = engines(model, address, tmp)
    clients = {k: EngineClient(e.url) for k, (e, _) in started.items()}
    times: dict[str, list[float]] = {k: [] for k in started}
    diff = {k: 0.0 for k in started}
    try:
        for seed in range(repeats):
            outputs = {}
            order = list(clients)[seed % len(clients):] + list(clients)[:seed % len(clients)]  # no row always first
            for kind, client in ((k, clients[k]) for k in order):
                t0 = time.perf_counter()
                outputs[kind] = client.generate("a red fox runs through the snow at dawn", seed=seed)
                times[kind].append(time.perf_counter() - t0)
            ref = outputs["ipc"]["samples"][0]["output"]
            for kind, out in outputs.items():
                diff[kind] = max(diff[kind], (out["samples"][0]["output"] - ref).abs().max().item())
    finally:
        for e, _ in started.values():
            e.stop()
    base = statistics.median(times["ipc"])
    return [dict(model=model, kind=k, ready_s=started[k][1], latency_s=statistics.median(times[k]),
                 ratio=statistics.median(times[k]) / base, max_diff=diff[k]) for k in started]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "small"])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    t0 = time.perf_counter()
    cluster = start_cluster()
    print(f"Ray cluster of {len(NODES)} nodes up in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
            for model in args.models:
                rows += measure(model, cluster.address, args.repeats, Path(tmp))
    finally:
        cluster.shutdown()
    print(f"\nmedian of {args.repeats}, encoder=1,denoise=1,decode=1, one request at a time, frames out\n")
    print("| model | links | ready | latency | x ipc | max diff vs ipc |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['kind']} | {r['ready_s']:.1f} s | {r['latency_s'] * 1e3:.0f} ms | "
              f"{r['ratio']:.2f} | {r['max_diff']:.1e} |")


if __name__ == "__main__":
    main()
