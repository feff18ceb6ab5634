"""Time releasing and resuming the transformer's weights for a colocated trainer, against memcpy of the same bytes.

    python bench/sleep.py [--model wan2.1-1.3b] [--repeats 3] [--json PATH]

Starts one engine (``encoder=1,denoise=1,decode=1``, ``--weight-sync-from-memory``, bfloat16 for
``wan2.1-1.3b``: Wan2.1-T2V-1.3B's transformer, 2.8 GB, random weights) on the machine's devices (GPUs when
there are, else the CPU) and holds a trainer-side copy of the transformer in host memory. Per repeat, in turn:

- ``level 1``: ``release_memory_occupation(["transformer"], level=1)``, then ``resume_memory_occupation``
  (on a GPU the weights go to pinned host memory and back; on the CPU they stay where they are);
- ``level 2 + push``: release at level 2 (the weights are dropped), push the trainer's copy from memory
  (``update_weights_from_tensors``, shared-memory buckets, ``checksum=False``), resume: each call and the sum;
- ``level 2 + disk``: release at level 2, resume with ``reload="disk"`` (from the model directory);
- ``push, awake``: the same push into the awake worker, for reference (the difference is the first touch of
  the memory a level-2 push writes into); ``worker`` rows are the denoise worker's own ``load_s``;
- ``memcpy``: ``dst.copy_(src)`` of the transformer's byte size in host memory (bench/weight_sync.py's).

After each resume a small request (32x32, one frame, 2 steps) must equal the one before any release (max
abs diff 0.0). Each worker's answer to a release says what its process held before and after (RSS, and on
GPUs ``torch.cuda.memory_allocated`` / ``memory_reserved``); the bench prints them for the level-2 release
of the transformer and for a level-1 release of every component (``weights``), with what the resume left.
Prints a table of median and best seconds, GB/s and the fraction of memcpy's GB/s. ``--json PATH`` writes
the medians and every raw timing. GB = 1e9 bytes.
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

from bench.weight_sync import MODEL_DTYPES, memcpy_seconds, state_bytes  # noqa: E402
from common.builtin import ensure_builtin  # noqa: E402
from common.runtime.engine_process import EngineProcess  # noqa: E402
from router.client import EngineClient  # noqa: E402

CHECK = dict(prompt="a fox at dawn", seed=1, height=32, width=32, num_frames=1, num_inference_steps=2,
             output_type="latent")
L1, L2_PUSH, L2_DISK, AWAKE, MEMCPY = "level 1", "level 2 + push", "level 2 + disk", "push, awake", "memcpy"
ROWS = (f"{L1}: release", f"{L1}: resume", L1, f"{L2_PUSH}: release", f"{L2_PUSH}: push",
        f"{L2_PUSH}: push, worker", f"{L2_PUSH}: resume", L2_PUSH, f"{L2_DISK}: release", f"{L2_DISK}: resume",
        L2_DISK, AWAKE, f"{AWAKE}, worker", MEMCPY)
MB = 1e6


def timed(fn, *a, **kw) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return time.perf_counter() - t0, out


class Cycles:
    """The release / resume cycles on one engine, each checked against the output before any release."""

    def __init__(self, client: EngineClient, trainer: dict[str, torch.Tensor]):
        self.c, self.trainer = client, trainer
        self.reference = self._output()

    def _output(self) -> torch.Tensor:
        return self.c.generate(**CHECK)["samples"][0]["output"]

    def check(self, what: str) -> None:
        diff = (self._output() - self.reference).abs().max().item()
        if diff != 0.0:
            raise SystemExit(f"{what}: the output after the resume differs from before (max abs diff {diff})")

    def level1(self) -> dict[str, float]:
        release, _ = timed(self.c.release_memory_occupation, ["transformer"], level=1)
        resume, _ = timed(self.c.resume_memory_occupation, ["transformer"])
        self.check(L1)
        return {f"{L1}: release": release, f"{L1}: resume": resume, L1: release + resume}

    def level2_push(self) -> tuple[dict[str, float], dict]:
        release, released = timed(self.c.release_memory_occupation, ["transformer"], level=2)
        push, pushed = timed(self.c.update_weights_from_tensors, self.trainer, checksum=False)
        resume, resumed = timed(self.c.resume_memory_occupation, ["transformer"])
        self.check(L2_PUSH)
        return ({f"{L2_PUSH}: release": release, f"{L2_PUSH}: push": push, f"{L2_PUSH}: resume": resume,
                 f"{L2_PUSH}: push, worker": pushed["workers"][0]["load_s"], L2_PUSH: release + push + resume},
                {"released": released, "resumed": resumed})

    def awake_push(self) -> dict[str, float]:
        push, pushed = timed(self.c.update_weights_from_tensors, self.trainer, checksum=False)
        return {AWAKE: push, f"{AWAKE}, worker": pushed["workers"][0]["load_s"]}

    def level2_disk(self) -> dict[str, float]:
        release, _ = timed(self.c.release_memory_occupation, ["transformer"], level=2)
        resume, _ = timed(self.c.resume_memory_occupation, ["transformer"], reload="disk")
        self.check(L2_DISK)
        return {f"{L2_DISK}: release": release, f"{L2_DISK}: resume": resume, L2_DISK: release + resume}

    def every_component(self) -> dict:
        """A level-1 release of ``weights`` and its resume: every worker's memory before, released, resumed."""
        released = self.c.release_memory_occupation(["weights"], level=1)
        resumed = self.c.resume_memory_occupation(["weights"])
        self.check("level 1 of weights")
        return {"released": released, "resumed": resumed}


def memory_rows(cycle: dict) -> list[dict]:
    """Per worker: its memory before the release, released, and after the resume (by kind: rss, cuda:N...)."""
    after = {(w["role"], w["index"]): w["memory_after"] for w in cycle["resumed"]["workers"]}
    return [{"worker": f"{w['role']}-{w['index']}", "released_bytes": w["released_bytes"],
             **{kind: [w["memory_before"][kind], w["memory_after"][kind], after[(w["role"], w["index"])][kind]]
                for kind in w["memory_before"]}} for w in cycle["released"]["workers"]]


def print_memory(title: str, rows: list[dict]) -> None:
    print(f"\n{title} (MB: before, released, resumed)")
    for r in rows:
        kinds = "  ".join(f"{k} {v[0] / MB:9.1f} {v[1] / MB:9.1f} {v[2] / MB:9.1f}" for k, v in r.items()
                          if isinstance(v, list))
        print(f"  {r['worker']:<10} weights {r['released_bytes'] / MB:9.1f}  {kinds}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan2.1-1.3b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    model_dir = ensure_builtin(args.model)
    dtype_name = MODEL_DTYPES.get(args.model, "float32")
    from diffusers import WanTransformer3DModel

    trainer = WanTransformer3DModel.from_pretrained(model_dir / "transformer", torch_dtype=getattr(torch, dtype_name))
    state = {k: v.clone() for k, v in trainer.state_dict().items()}  # its own pages, not the file's mapping
    nbytes = state_bytes(trainer)
    del trainer
    print(f"[{args.model}] transformer {nbytes / 1e9:.3f} GB in {dtype_name}", flush=True)
    seconds: dict[str, list[float]] = {row: [] for row in ROWS}
    eng = EngineProcess(args.model, extra=["--weight-sync-from-memory", "--dtype", dtype_name], ready_timeout_s=900)
    try:
        with EngineClient(eng.url) as c:
            devices = sorted({w["device"] for w in c.health()["workers"]})
            cycles = Cycles(c, state)
            c.update_weights_from_tensors(state, checksum=False)  # untimed: the buckets exist, pages touched
            transformer_memory = None
            for r in range(args.repeats):
                for part in (cycles.level1(), cycles.level2_disk()):
                    for k, v in part.items():
                        seconds[k].append(v)
                part, memory = cycles.level2_push()
                # Then into the same (now written) weights: a reload from disk leaves them mapped from the file,
                # where a first write costs a copy-on-write fault per page.
                part.update(cycles.awake_push())
                for k, v in part.items():
                    seconds[k].append(v)
                transformer_memory = transformer_memory or memory
                seconds[MEMCPY].append(statistics.median(memcpy_seconds(nbytes)))
                print(f"[{args.model}] repeat {r + 1}/{args.repeats}: " + ", ".join(
                    f"{k} {seconds[k][-1]:.3f}s" for k in (L1, L2_PUSH, L2_DISK, AWAKE, MEMCPY)), flush=True)
            everything = cycles.every_component()
    finally:
        eng.stop()

    med = {k: statistics.median(v) for k, v in seconds.items()}
    memcpy_gbs = nbytes / med[MEMCPY] / 1e9
    print(f"\n{args.model}: {nbytes / 1e9:.2f} GB transformer, workers on {', '.join(devices)}, "
          f"{args.repeats} repeats (median, best)")
    print(f"  {'step':<30} {'median s':>9} {'best s':>8} {'GB/s':>8} {'of memcpy':>9}")
    for k in ROWS:
        gbs = nbytes / med[k] / 1e9 if med[k] > 0 else float("inf")
        print(f"  {k:<30} {med[k]:>9.3f} {min(seconds[k]):>8.3f} {gbs:>8.2f} {gbs / memcpy_gbs:>9.0%}")
    mem_t, mem_all = memory_rows(transformer_memory), memory_rows(everything)
    print_memory("level 2 + push of the transformer", mem_t)
    print_memory("level 1 of weights", mem_all)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "dtype": dtype_name, "bytes": nbytes, "devices": devices, "median_s": med,
            "seconds": seconds, "memory": {"transformer_level2": mem_t, "weights_level1": mem_all}}, indent=1))


if __name__ == "__main__":
    main()
