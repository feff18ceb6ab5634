"""Time a weight sync (save on the trainer, load into every denoise worker, verify).

    python bench/weight_sync.py [--models tiny small] [--repeats 5] [--denoise 1]

For each model: starts an engine, then per repeat perturbs a trainer-side copy
of the transformer, saves it as safetensors, POSTs /update_weights_from_disk,
and checks /weights_checksum against the trainer's own checksum. Prints a table
(median seconds) and optionally writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.runtime.engine_process import EngineProcess  # noqa: E402
from common.wan.tiny_model import ensure_tiny_model  # noqa: E402
from common.wan.weights import save_weights, state_dict_checksum  # noqa: E402
from router.client import EngineClient  # noqa: E402


def bench_model(name: str, repeats: int, denoise: int) -> dict:
    model_dir = ensure_tiny_model(name)
    trainer = WanTransformer3DModel.from_pretrained(model_dir / "transformer")
    params = sum(p.numel() for p in trainer.parameters())
    rows = {"save_s": [], "update_s": [], "checksum_s": [], "trainer_checksum_s": []}
    work = Path(tempfile.mkdtemp(prefix="wsync-"))  # the engine may read weights only below it
    with EngineProcess(name, f"encoder=1,denoise={denoise},decode=1", extra=["--weight-root", str(work)]) as eng, \
            EngineClient(eng.url) as c:
        for i in range(repeats):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.mul_(1.0 + 1e-3)
            path = work / f"w{i}.safetensors"
            t0 = time.perf_counter()
            save_weights(trainer, path)
            t1 = time.perf_counter()
            res = c.update_weights_from_disk(path)
            t2 = time.perf_counter()
            remote = c.weights_checksum()["sha256"]
            t3 = time.perf_counter()
            local = state_dict_checksum(trainer)
            t4 = time.perf_counter()
            if not (remote == local == res["sha256"]):
                raise SystemExit(f"{name}: checksum mismatch after update {i}")
            rows["save_s"].append(t1 - t0)
            rows["update_s"].append(t2 - t1)
            rows["checksum_s"].append(t3 - t2)
            rows["trainer_checksum_s"].append(t4 - t3)
    size_mb = path.stat().st_size / 2**20
    return {"model": name, "params": params, "file_mb": size_mb, "denoise_workers": denoise,
            **{k: statistics.median(v) for k, v in rows.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--denoise", type=int, default=1, help="denoise workers to update")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = [bench_model(m, args.repeats, args.denoise) for m in args.models]
    print(f"\n{'model':<8} {'params':>11} {'file MB':>8} {'workers':>7} {'save s':>8} {'update s':>9} "
          f"{'engine sum s':>12} {'trainer sum s':>13}")
    for r in results:
        print(f"{r['model']:<8} {r['params']:>11,} {r['file_mb']:>8.2f} {r['denoise_workers']:>7} {r['save_s']:>8.4f} "
              f"{r['update_s']:>9.4f} {r['checksum_s']:>12.4f} {r['trainer_checksum_s']:>13.4f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
