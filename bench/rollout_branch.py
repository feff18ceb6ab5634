"""Groups that branch from a shared prefix: the forwards and the time ``share_prefix`` saves.

    python bench/rollout_branch.py                                   # tiny and small-sd3, n=16, 10 steps
    python bench/rollout_branch.py --model small --repeats 3
    python bench/rollout_branch.py --model tiny --windows 2:2 6:4 --json bench/results/rollout-branch.json

In-process, without sockets: the denoise worker's own :class:`~denoise_worker.denoiser.Denoiser` on the CPU, float32, the encoder's text tensors made once
per model. Per model and window (``start:size``: SDE steps ``start .. start+size-1`` of ``--steps``), one
group of ``--n`` samples with ``sde_type "sde"`` and CFG (guidance 4.0, negative prompt) is run

- ``shared noise``: ``initial_noise_seed = seed``, every row computed (what a group costs without the feature);
- ``share_prefix``: the same group computing the steps before the window once, on one row.

Each round runs every row once in turn (machine noise hits them alike); the median of ``--repeats`` rounds
after one untimed warm-up. Printed per row: the rows the transformer ran (counted where the policy runs them,
CFG branches included), the wall time and this process's CPU time (``time.process_time``: what the
work took, whatever else the machine runs), and for ``share_prefix`` the rows and times saved against
``shared noise`` and ``saved / rows saved`` (the fraction of the ideal saving obtained; 1.0: time in
proportion to rows). ``max diff``: the largest difference between the two rows' latents, log-probs and
trajectories (the answers are the same; only the work differs).
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

from common.builtin import ensure_builtin  # noqa: E402
from common.diffusion import text_roles  # noqa: E402
from common.diffusion.policy import Policy  # noqa: E402
from common.families import read_model  # noqa: E402
from common.protocol.messages import LOG_PROBS, TRAJECTORY_LATENTS, GenerationParams, RolloutParams  # noqa: E402
from denoise_worker.denoiser import Denoiser  # noqa: E402
from denoise_worker.task import DenoiseTask  # noqa: E402

CPU = torch.device("cpu")


class Model:
    """One model directory's denoise path in this process, its prompt encoded once."""

    def __init__(self, name: str, max_batch: int):
        self.name, self.max_batch = name, max_batch
        self.info = read_model(ensure_builtin(name))
        self.family = self.info.family
        self.policy = Policy.load(self.info, torch.float32, CPU)
        self.denoiser = Denoiser(self.policy, CPU, max_batch)  # sizes each forward's threads as the CPU worker
        self.encoder = self.family.text.load_encoder(self.info, torch.float32, CPU)
        self.rows = 0

        def counted(inputs):  # the rows each forward takes, guidance passes included
            self.rows += sum(x.row_count for x in inputs)
        self.denoiser.observe = counted
        self.wire = None

    def params(self, n: int, steps: int, window: list[int], share: bool) -> GenerationParams:
        d = self.info.defaults
        fields = {"true_cfg_scale": 4.0} if self.family.cfg_field == "true_cfg_scale" else {}
        return GenerationParams(
            prompt="a heron in the reeds", negative_prompt="blurry", height=d["height"], width=d["width"],
            num_frames=d["num_frames"] if self.family.video else 1, num_inference_steps=steps, guidance_scale=4.0,
            seed=100, n=n, fields=fields, max_sequence_length=d["max_sequence_length"], output_type="latent",
            rollout=RolloutParams(sde_step_indices=window, return_trajectory=True, initial_noise_seed=100,
                                  share_prefix=share))

    @torch.no_grad()
    def run(self, p: GenerationParams) -> tuple[DenoiseTask, int, float, float]:
        if self.wire is None:
            guided = self.family.guidance.uses_cfg(p)
            texts = [(p.prompt, False), (p.negative_prompt, True)] if guided else [(p.prompt, False)]
            wires = text_roles.encode(self.encoder, texts, p.max_sequence_length)
            self.wire = {**wires[0], **({self.family.text.negatives()[k]: t for k, t in wires[1].items()} if guided else {})}
        rows, t0, c0 = self.rows, time.perf_counter(), time.process_time()
        task = self.denoiser.add("bench", self.denoiser.task(p, self.wire)).task
        while self.denoiser.requests:
            assert all(out.error is None for out in self.denoiser.step())
        return task, self.rows - rows, time.perf_counter() - t0, time.process_time() - c0


def _diff(a: DenoiseTask, b: DenoiseTask) -> float:
    ea, eb = a.extras(), b.extras()
    return max((a.latents - b.latents).abs().max().item(),
               *((ea[k] - eb[k]).abs().max().item() for k in (LOG_PROBS.name, TRAJECTORY_LATENTS.name)))


def bench(model: Model, n: int, steps: int, start: int, size: int, repeats: int) -> dict:
    window = list(range(start, min(steps, start + size)))
    ps = {share: model.params(n, steps, window, share) for share in (False, True)}
    wall: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    rows, tasks = {}, {}
    for round_ in range(repeats + 1):  # round 0: warm-up
        for share in (False, True):
            tasks[share], rows[share], seconds, cpu_s = model.run(ps[share])
            if round_:
                wall[share].append(seconds)
                cpu[share].append(cpu_s)
    rows_saved = 1 - rows[True] / rows[False]
    out = {"model": model.name, "n": n, "steps": steps, "window": window, "rows_shared_noise": rows[False],
           "rows_share_prefix": rows[True], "rows_saved": rows_saved, "max_diff": _diff(tasks[True], tasks[False])}
    for kind, times in (("s", wall), ("cpu_s", cpu)):
        base, mine = statistics.median(times[False]), statistics.median(times[True])
        saved = 1 - mine / base
        out.update({f"{kind}_shared_noise": base, f"{kind}_share_prefix": mine, f"{kind}_saved": saved,
                    f"{kind}_saved_over_rows_saved": saved / rows_saved if rows_saved else None})
    return out


def _row(r: dict) -> str:
    cells = [r["model"], f"{r['window'][0]}..{r['window'][-1]} of {r['steps']}",
             f"{r['rows_shared_noise']} -> {r['rows_share_prefix']}", f"{r['rows_saved']:.1%}"]
    for kind in ("s", "cpu_s"):
        cells += [f"{r[f'{kind}_shared_noise']:.3f} -> {r[f'{kind}_share_prefix']:.3f}", f"{r[f'{kind}_saved']:.1%}",
                  f"{r[f'{kind}_saved_over_rows_saved']:.2f}"]
    return "| " + " | ".join(cells + [f"{r['max_diff']:.2g}"]) + " |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["tiny", "small-sd3"], help="built-in models")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--windows", nargs="+", default=["2:3", "6:3"], help="start:size of the SDE window")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-batch-size", type=int, default=16, help="rows per forward, as the worker's flag")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print("| model | window | rows | rows saved | wall s | wall saved | / rows saved | CPU s | CPU saved "
          "| / rows saved | max diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    out = []
    for name in args.model:
        model = Model(name, args.max_batch_size)
        for w in args.windows:
            start, size = (int(v) for v in w.split(":"))
            out.append(bench(model, args.n, args.steps, start, size, args.repeats))
            print(_row(out[-1]), flush=True)  # as each finishes: the small models take minutes
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
