"""How much a built-in model's timestep embedding changes per denoising step, beside its ``-smooth`` variant's.

For each model: the timesteps of a ``--steps`` schedule of its own scheduler as the denoise worker builds it
(its serving defaults' size for the dynamic shift of FLUX and Qwen-Image), then the relative L1 change
``mean|e_i - e_{i-1}| / mean|e_{i-1}|`` of each time embedder's output between consecutive steps (Wan: also
its 6 x D ``timestep_proj``), min / median / max over the steps; a two-expert model's per expert, over the
steps it takes. See common/builtin/smooth_time.py.

    .venv/bin/python bench/time_embedding.py tiny tiny-sd3 [--steps 50]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.diffusion import schedulers  # noqa: E402
from common.families import read_model  # noqa: E402
from common.builtin import BUILTINS, ensure_builtin  # noqa: E402
from common.builtin.smooth_time import EXPERTS, embedding_changes  # noqa: E402
from common.protocol.messages import GenerationParams  # noqa: E402

SUFFIX = "-smooth"


def schedule(info, steps: int) -> torch.Tensor:
    """The timesteps [steps] the denoise worker runs for the model's default request at ``steps`` steps."""
    d = info.defaults
    p = GenerationParams(prompt="", negative_prompt="", height=d["height"], width=d["width"],
                         num_frames=d.get("num_frames", 1), num_inference_steps=steps,
                         guidance_scale=float(d.get("guidance_scale", 1.0)), seed=0)
    seq_len = info.family.latents.image_seq_len(info, p.height, p.width, p.num_frames)
    scheduler = schedulers.build(schedulers.load_serving_template(info), p, image_seq_len=seq_len,
                                 default_sigmas=info.family.guidance.default_sigmas)
    return scheduler.timesteps.double()


def changes(model_dir: str | Path, steps: int) -> dict[tuple[str, str], torch.Tensor]:
    """Per (expert, embedding): the per-step relative L1 changes over the steps the expert takes."""
    info = read_model(model_dir)
    t = schedule(info, steps)
    boundary = (info.boundary_ratio or 0.0) * info.num_train_timesteps
    out = {}
    for expert in EXPERTS:
        if not (info.path / expert / "config.json").is_file():
            continue
        mine = t[t >= boundary] if expert == "transformer" else t[t < boundary]
        model = info.family.transformer.load(info.path / expert, torch.float32)
        for emb, c in embedding_changes(model, mine).items():
            out[(expert, emb)] = c
    return out


def row(c: torch.Tensor | None) -> str:
    if c is None:
        return "| | | "
    return "| " + " | ".join(f"{100 * v:.1f}%" for v in (c.min(), c.median(), c.max())) + " "


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="+", help="built-in models (a -smooth one's base, or a base's -smooth one)")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    print(f"relative L1 change of the time embedding per step, {args.steps} steps: min / median / max")
    print("| model | expert | embedding | base min | median | max | smooth min | median | max |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.names:
        base = name.removesuffix(SUFFIX)
        if base not in BUILTINS:
            sys.exit(f"unknown built-in model {base!r}")
        smooth = base + SUFFIX if base + SUFFIX in BUILTINS else None
        a = changes(ensure_builtin(base), args.steps)
        b = changes(ensure_builtin(smooth), args.steps) if smooth else {}
        for key in a:
            print(f"| {base} | {key[0]} | {key[1]} {row(a[key])}{row(b.get(key))}|")


if __name__ == "__main__":
    main()
