"""Fit TeaCache's rescaling polynomial for a model directory (or built-in name), as TeaCache's authors did.

TeaCache (common/diffusion/step_cache.py) adds up ``poly(x)`` per step and per CFG branch, with ``x`` the
relative L1 change of the branch's timestep-modulated input since the previous step, and reuses the branch's
last output while the sum stays under the threshold: ``poly`` should turn ``x`` into the change of the
transformer's output that ``x`` predicts. This script measures both over uncached requests and fits it:

- ``--prompts`` requests (prompt ``i`` of a fixed list, seed ``i``; the model's default size unless
  ``--height`` / ``--width`` / ``--frames`` say otherwise; classifier-free guidance as the family's defaults
  set it, with a negative prompt), ``--steps`` steps each, every step computed;
- per step and per CFG branch (the conditional and the unconditional piece, as denoise_worker/caching.py
  splits a request): ``x`` = relative L1 change of the modulated input
  (:func:`common.diffusion.cache_signals.modulated_input`), ``y`` = relative L1 change of that branch's raw
  transformer output (``Policy.batched_velocity`` on the single-branch pieces), both against the previous
  step on the same expert;
- by default only the steps where TeaCache evaluates the polynomial (after the model's warm-up, before the
  last step; ``--all-steps``: every pair); then ``numpy.polyfit(x, y, --degree)``, highest power first
  (4 as TeaCache's authors; 1 extrapolates sanely to schedules whose changes fall outside the fitted range,
  e.g. fewer steps, where a quartic can turn anywhere).

It prints the coefficients, the fit's residual, the range of ``x`` it covered (the polynomial means
something only there: step_cache.py falls back to the raw change where it goes negative), x / y quantiles,
and, for the fitted and the model's current polynomial, the share of branch-steps TeaCache would reuse at
a few thresholds (exact: its decisions depend on the modulated inputs only, which depend on the timesteps
and the text, not on the latents). ``--write`` stores the fit as the model directory's ``step_cache.json``
(read by ``cache_signals.teacache_settings``; for a built-in name that is its generated directory in the
model cache, which every later use of that built-in then reads).

    .venv/bin/python bench/fit_teacache.py small-sd3-smooth --prompts 2 --height 128 --width 128
    .venv/bin/python bench/fit_teacache.py /models/sd3.5-medium --prompts 8 --write
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.diffusion.cache_signals import SETTINGS_FILE, modulated_input, teacache_settings  # noqa: E402
from common.diffusion.params import family_values  # noqa: E402
from common.diffusion.policy import Policy  # noqa: E402
from common.diffusion.step_cache import METHODS, rel_l1, rescale  # noqa: E402
from common.families import read_model  # noqa: E402
from common.builtin import BUILTINS, ensure_builtin  # noqa: E402
from common.protocol.messages import GenerationParams  # noqa: E402
from denoise_worker.task import DenoiseTask  # noqa: E402
from denoise_worker.denoiser import Denoiser  # noqa: E402

DTYPE = torch.float32
CPU = torch.device("cpu")
PROMPTS = (
    "a red fox running through fresh snow at dawn",
    "a bowl of ramen on a wooden table, steam rising, studio lighting",
    "an old lighthouse on a cliff during a thunderstorm",
    "a watercolor painting of a city street in the rain",
    "a close-up portrait of an astronaut, reflections in the visor",
    "a field of sunflowers under a blue sky with small white clouds",
    "a cat sleeping on a stack of books next to a window",
    "a futuristic train crossing a desert bridge at sunset",
)
NEGATIVE = "blurry, low quality, distorted"
BRANCHES = ("cond", "uncond")
THRESHOLDS = (0.04, 0.08, 0.15, 0.3)
QUANTILES = (0, 10, 25, 50, 75, 90, 100)


@dataclass
class Pair:
    """One branch's change between two consecutive steps on the same expert."""

    prompt: int
    branch: int  # 0: conditional, 1: unconditional
    step: int  # the later step
    x: float  # rel L1 of the modulated input
    y: float  # rel L1 of the raw transformer output


def picture(h: int, w: int, seed: int):
    """A smooth seeded RGB picture, for a model that needs an image (image-to-video)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([np.sin(6 * xx + seed), np.cos(5 * yy - seed), np.sin(4 * (xx + yy))], axis=-1)
    return Image.fromarray(np.clip(127.5 * (1 + base) + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8))


class Runner:
    """The workers' path in this process (text encoder, policy, task), without the decoder."""

    def __init__(self, model_dir: Path):
        self.info = read_model(model_dir)
        self.family = f = self.info.family
        self.encoder = f.text.load_encoder(self.info, DTYPE, CPU)
        self.policy = Policy.load(self.info, DTYPE, CPU)
        self.denoiser = Denoiser(self.policy, CPU, max_batch=8)
        self.images = f.condition.load(self.info, DTYPE, CPU) if f.condition.image_input(self.info) == "required" else None

    def params(self, i: int, steps: int, height: int | None, width: int | None, frames: int | None) -> GenerationParams:
        d = self.info.defaults
        fields = dict(prompt=PROMPTS[i % len(PROMPTS)], negative_prompt=NEGATIVE, height=height or d["height"],
                      width=width or d["width"], num_frames=1 if not self.family.video else (frames or d["num_frames"]),
                      num_inference_steps=steps, guidance_scale=float(d["guidance_scale"]), seed=i,
                      max_sequence_length=d["max_sequence_length"], output_type="latent")
        if self.family.cfg_field == "true_cfg_scale":
            fields["true_cfg_scale"] = float(d.get("true_cfg_scale", 1.0))
        # The family's own fields at their defaults, as the router fills them (LTX-2's further guidance passes).
        own = family_values(fields, self.info)
        return GenerationParams(**fields, fields=own)

    def task(self, p: GenerationParams) -> DenoiseTask:
        guided = self.family.guidance.uses_cfg(p)
        wires = self.encoder.wire_tensors([p.prompt, p.negative_prompt] if guided else [p.prompt],
                                          p.max_sequence_length)
        pixels = {}
        if self.images is not None:
            pixels = self.images.wire_tensors(picture(p.height, p.width, p.seed), None, p.height, p.width,
                                              p.num_frames)
        tensors = {**wires[0], **pixels}
        if guided:
            tensors.update({self.family.text.negatives()[k]: t for k, t in wires[1].items()})
        return self.denoiser.task(p, tensors)

    @torch.no_grad()
    def pairs(self, prompt: int, p: GenerationParams) -> list[Pair]:
        """Run request ``p`` uncached; each branch's (x, y) between consecutive steps on the same expert."""
        task, policy, out = self.task(p), self.policy, []
        before = None  # (expert, modulated inputs, raw outputs) of the previous step
        while not task.done:
            x = task.model_input()
            name = policy.expert_for(x.timestep)
            # every guidance pass alone, as denoise_worker/caching.py splits a request
            pieces = [replace(x, cond=c, uncond=None, passes=(), unconditional=b > 0, settings=None)
                      for b, c in enumerate(x.branches)]
            signals = [modulated_input(policy, name, piece) for piece in pieces]
            raw = policy.batched_velocity(pieces)  # single-branch pieces: each branch's raw output
            if before is not None and before[0] == name:
                for b in range(len(pieces)):
                    out.append(Pair(prompt, b, task.step, float(rel_l1(signals[b], before[1][b])[0]),
                                    float(rel_l1(raw[b].flatten(1), before[2][b].flatten(1)).mean())))
            before = (name, signals, raw)
            v = policy.combine(name, x, raw)
            task.advance(v)
        return out


def fit(pairs: list[Pair], degree: int) -> np.ndarray:
    x = np.array([q.x for q in pairs])
    y = np.array([q.y for q in pairs])
    return np.polyfit(x, y, degree)


def skipped_share(pairs: list[Pair], coefficients, threshold: float, warmup: int, steps: int) -> tuple[int, int]:
    """(reused, total) branch-steps of TeaCache at ``threshold`` over the recorded changes, as RequestCache decides
    (steps without a pair, i.e. the first of an expert, and the warm-up and last steps compute)."""
    by_branch: dict[tuple[int, int], dict[int, float]] = {}
    for q in pairs:
        by_branch.setdefault((q.prompt, q.branch), {})[q.step] = q.x
    reused = total = 0
    warmup = max(warmup, METHODS["teacache"].warmup)
    for changes in by_branch.values():
        acc = 0.0
        for step in range(steps):
            total += 1
            if step < warmup or step >= steps - 1 or step not in changes:
                acc = 0.0
                continue
            change = changes[step]
            r = float(rescale(tuple(coefficients), torch.tensor(change)))
            acc += r if r > 0 else change
            if acc < threshold:
                reused += 1
            else:
                acc = 0.0
    return reused, total


def report(name: str, runner: Runner, pairs: list[Pair], used: list[Pair], fitted_steps: str, coefficients: np.ndarray,
           current: tuple[float, ...], warmup: int, steps: int, branches: int, seconds: float) -> dict:
    x = np.array([q.x for q in used])
    y = np.array([q.y for q in used])
    poly = np.poly1d(coefficients)
    predicted = poly(x)
    residual = y - predicted
    rms = float(np.sqrt(np.mean(residual ** 2)))
    r2 = float(1 - np.sum(residual ** 2) / max(np.sum((y - y.mean()) ** 2), 1e-30))
    grid = np.linspace(x.min(), x.max(), 1001)
    on_grid = poly(grid)
    now = np.array([float(rescale(current, torch.tensor(v))) for v in x])
    current_rms = float(np.sqrt(np.mean((y - now) ** 2)))
    print(f"{name}: {runner.family.pipeline}, {steps} steps, {branches} CFG branch(es), {len(pairs)} pairs "
          f"({len(used)} fitted: steps {fitted_steps}), {seconds:.0f}s")
    print("fitted teacache_coefficients (highest power first):")
    print("    (" + ", ".join(f"{c:.8e}" for c in coefficients) + ")")
    print(f"residual: rms {rms:.4g} (mean y {y.mean():.4g}), R^2 {r2:.3f}; current polynomial "
          f"{tuple(current)}: rms {current_rms:.4g}")
    print(f"x range covered: [{x.min():.4g}, {x.max():.4g}]; fitted poly over it: [{on_grid.min():.4g}, "
          f"{on_grid.max():.4g}]{'  NEGATIVE somewhere: step_cache falls back to raw x there' if on_grid.min() < 0 else ''}"
          f"{'' if np.all(np.diff(on_grid) >= 0) else '  (not monotonic)'}")
    print("| quantile | x | y | fitted(x) | current(x) | y / x |")
    print("|---|---|---|---|---|---|")
    for q in QUANTILES:
        xq, yq = np.percentile(x, q), np.percentile(y, q)
        print(f"| {q}% | {xq:.4g} | {yq:.4g} | {poly(xq):.4g} | {float(rescale(current, torch.tensor(xq))):.4g} | "
              f"{np.percentile(y / np.maximum(x, 1e-12), q):.3g} |")
    print("teacache's reused share of branch-steps over these requests (exact: decisions follow x only):")
    print("| threshold | fitted | current |")
    print("|---|---|---|")
    shares = {}
    for t in THRESHOLDS:
        a, total = skipped_share(pairs, coefficients, t, warmup, steps)
        b, _ = skipped_share(pairs, current, t, warmup, steps)
        shares[t] = (a / total, b / total)
        print(f"| {t} | {a}/{total} ({100 * a / total:.0f}%) | {b}/{total} ({100 * b / total:.0f}%) |")
    return {"coefficients": [float(c) for c in coefficients], "x_range": [float(x.min()), float(x.max())],
            "rms": rms, "r2": r2, "shares": shares}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a model directory or a built-in model name")
    ap.add_argument("--prompts", type=int, default=2, help="requests (prompt i of a fixed list, seed i)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--height", type=int, help="default: the model's")
    ap.add_argument("--width", type=int, help="default: the model's")
    ap.add_argument("--frames", type=int, help="video models; default: the model's")
    ap.add_argument("--degree", type=int, default=4, help="of the polynomial (default 4, as TeaCache's)")
    ap.add_argument("--all-steps", action="store_true",
                    help="fit every consecutive pair, not only the steps where teacache uses the polynomial")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    ap.add_argument("--write", action="store_true", help=f"write the fit as the model directory's {SETTINGS_FILE}")
    args = ap.parse_args(argv)
    if args.steps < 3 or args.prompts < 1 or args.degree < 1:
        ap.error("--steps must be >= 3, --prompts >= 1 and --degree >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    builtin = args.model in BUILTINS and not Path(args.model).is_dir()
    model_dir = ensure_builtin(args.model) if builtin else Path(args.model)
    t0 = time.perf_counter()
    runner = Runner(model_dir)
    current, warmup = teacache_settings(runner.info)
    current = current or (1.0, 0.0)  # a model without one yet: compared with the identity
    pairs: list[Pair] = []
    branches = 1
    for i in range(args.prompts):
        p = runner.params(i, args.steps, args.height, args.width, args.frames)
        got = runner.pairs(i, p)
        branches = max([branches] + [q.branch + 1 for q in got])
        pairs += got
    # teacache evaluates the polynomial at steps warmup .. steps - 2 (the last one always computes)
    first, last = (1, args.steps - 1) if args.all_steps else (max(warmup, METHODS["teacache"].warmup), args.steps - 2)
    used = [q for q in pairs if first <= q.step <= last]
    if len(used) <= args.degree:
        sys.exit(f"only {len(used)} pairs to fit a degree-{args.degree} polynomial: more --steps or --prompts")
    coefficients = fit(used, args.degree)
    result = report(args.model, runner, pairs, used, f"{first}..{last}", coefficients, current, warmup, args.steps,
                    branches, time.perf_counter() - t0)
    if args.write:
        path = model_dir / SETTINGS_FILE
        data = {"teacache_coefficients": result["coefficients"], "teacache_warmup": warmup,
                "x_range": result["x_range"], "source": f"fitted on this directory by bench/fit_teacache.py "
                f"(degree {args.degree}, {args.prompts} prompts, {args.steps} steps)"}
        path.write_text(json.dumps(data, indent=2) + "\n")
        note = " (a built-in's generated directory: every later use of it reads this)" if builtin else ""
        print(f"wrote {path}{note}")
    return result


if __name__ == "__main__":
    main()
