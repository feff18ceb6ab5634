"""bfloat16 measured: serving against diffusers in bf16, and rollout log-probs against the trainer's recompute.

    python bench/bf16.py                                   # one tiny built-in per pipeline, then small-sd3
    python bench/bf16.py --models tiny-sd3 small-sd3 --steps 10 --json bench/results/bf16.json

Per model directory (float32 weights, loaded in each dtype as ``--dtype`` loads them), in this process on the
CPU, with the workers' own path (bench/engine_path.py) and ``rl.TrainerPolicy``:

1. Serving, the model's default request (its guidance) at ``--steps``: the engine's final latents in bf16
   against the family's diffusers pipeline in bf16 on the same directory and seed (``pipe bf16``), against the
   engine in float32 (``own f32``: the bf16 error itself), and diffusers' own bf16 error (``pipe bf16 - pipe
   f32``) beside them; ``f32 parity``: the engine against the pipeline, both in float32 (the setup's check).
   Where the pipeline returns its latents in another layout than the engine's answer (several streams), the
   decoded frames are compared instead. Max and mean abs, and each over the scale (RMS) of the float32
   latents.
2. Rollouts, ``sde_type "sde"`` (noise level 0.7) on every step, without and with CFG (the family's CFG field
   at 1 and at 4.0; without, a CFG scale per stream, LTX-2's audio one, at 1 too): the engine's log-probs (per element means, the trainer's convention) against
   ``TrainerPolicy.log_probs`` recomputing them from the returned trajectory: a bf16 rollout against a bf16
   and a float32 recompute, a float32 rollout against a float32 (the floor) and a bf16 one. Mean and max of
   |rollout - recompute| over the SDE steps; ``|lp|``: the log-probs' mean magnitude.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_path import EnginePath  # noqa: E402
from bench.serve import PIPELINE_ARGS, _components  # noqa: E402
from common.builtin import BUILTINS, ensure_builtin  # noqa: E402
from common.diffusion.field_error import FieldError  # noqa: E402
from common.families import BINDINGS  # noqa: E402
from common.protocol.messages import LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS  # noqa: E402
from common.protocol.messages import TRAJECTORY_TIMESTEPS, GenerationParams  # noqa: E402
from common.runtime.component_memory import settle_held  # noqa: E402
from rl import TrainerPolicy, Trajectory  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
PROMPT, NEGATIVE, SEED = "a red fox in the snow at dawn", "blurry, low quality", 3
CFG_ON = 4.0
# (rollout dtype, recompute dtype) pairs, as the table's columns.
PAIRS = (("bf16", "bf16"), ("bf16", "f32"), ("f32", "f32"), ("f32", "bf16"))


def default_models() -> list[str]:
    """One tiny built-in per served pipeline (the registry's, as tests/family_builtins.py picks them), then
    small-sd3: a more realistic size."""
    out: dict[str, str] = {}
    for name, spec in BUILTINS.items():
        pipeline = getattr(spec, "pipeline", None)
        if name.startswith("tiny") and not name.endswith("-smooth") and pipeline in BINDINGS:
            out.setdefault(pipeline, name)
    return sorted(out.values()) + ["small-sd3"]


def picture(height: int = 64, width: int = 96):
    """A smooth RGB picture (a gradient plus noise): every request to a model that takes an image carries it."""
    import numpy as np
    import PIL.Image

    rng = np.random.RandomState(0)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1)
    return PIL.Image.fromarray(((0.7 * base + 0.3 * rng.rand(height, width, 3)) * 255).astype(np.uint8))


class Model:
    """One directory's engine path, trainer copy and diffusers pipeline in each dtype (built when first used)."""

    def __init__(self, name: str):
        import diffusers

        self.name, self.dir = name, ensure_builtin(name)
        self._made: dict[tuple[str, str], object] = {}
        self.info = self.trainer("f32").info
        self.family = self.info.family
        # A picture where both the engine and the pipeline class take one (an edit, image-to-video).
        takes = inspect.signature(getattr(diffusers, self.family.pipeline).__call__).parameters
        self.image = picture() if self.family.condition.image_input(self.info) and "image" in takes else None

    def _get(self, kind: str, dtype: str, make):
        if (kind, dtype) not in self._made:
            self._made[(kind, dtype)] = make(DTYPES[dtype])
        return self._made[(kind, dtype)]

    def engine(self, dtype: str) -> EnginePath:
        return self._get("engine", dtype, lambda d: EnginePath(self.dir, d))

    def trainer(self, dtype: str) -> TrainerPolicy:
        return self._get("trainer", dtype, lambda d: TrainerPolicy(self.dir, dtype=d))

    def pipe(self, dtype: str):
        import diffusers

        def make(d):
            cls = getattr(diffusers, self.family.pipeline)
            pipe = cls.from_pretrained(self.dir, dtype=d, **_components(self.dir, self.family.pipeline))
            settle_held(pipe=pipe)  # laid out as the engine's weights (common/diffusion/weight_storage.py)
            pipe.set_progress_bar_config(disable=True)
            return pipe
        return self._get("pipe", dtype, make)

    def params(self, steps: int, cfg: bool | None, rollout: bool, off: float = 1.0, n: int = 1) -> GenerationParams:
        """The request as the router makes it: the model's defaults (its size, its guidance where ``cfg`` is
        None), ``steps`` steps; ``cfg`` True / False: the family's CFG field at 4.0 / ``off``."""
        fields: dict = dict(num_inference_steps=steps, seed=SEED, n=n, height=self.info.defaults["height"],
                            width=self.info.defaults["width"])
        refused = self.family.guidance.refusal(self.info, {"negative_prompt": NEGATIVE})
        negative = None if refused is not None and refused[0] == "negative_prompt" else NEGATIVE
        if cfg is not None:
            fields[self.family.cfg_field] = CFG_ON if cfg else off
        if cfg is False:  # a family with a CFG scale per stream (LTX-2's audio): each off too
            fields.update({f.name: off for f in self.family.request_fields if f.name.endswith("guidance_scale")})
        if self.image is not None:
            fields["image"] = self.image
        if rollout:
            fields.update(sde_type="sde", noise_level=0.7, return_trajectory=True)
        try:
            return self.trainer("f32").params(PROMPT, negative, **fields)
        except FieldError as e:  # a model whose size follows its image's aspect takes none
            if e.field not in ("height", "width"):
                raise
            return self.trainer("f32").params(PROMPT, negative, **{k: v for k, v in fields.items()
                                                                  if k not in ("height", "width")})

    def pipeline_output(self, dtype: str, p: GenerationParams, output_type: str):
        """The pipeline's output for request ``p``: its latents (``output_type="latent"``) or frames."""
        pipe = self.pipe(dtype)
        takes = inspect.signature(pipe.__call__).parameters
        kw = dict(prompt=p.prompt, num_inference_steps=p.num_inference_steps,
                  generator=torch.Generator("cpu").manual_seed(p.seed), output_type=output_type)
        if self.family.guidance.uses_cfg(p) and "negative_prompt" in takes:
            kw["negative_prompt"] = p.negative_prompt
        optional = dict(height=p.height, width=p.width, guidance_scale=p.guidance_scale, max_sequence_length=p.max_sequence_length,
                        num_frames=p.num_frames if self.family.video else None, image=self.image)
        kw.update({k: v for k, v in optional.items() if k in takes and v is not None})
        kw.update({k: v for k, v in p.fields.items() if k in takes})
        for name, translate in PIPELINE_ARGS.items():  # a field the pipeline takes under another name
            if name in p.fields and not set(translate(p.fields[name])) - set(takes):
                kw.update(translate(p.fields[name]))
        with torch.no_grad():
            return pipe(**kw)


def _diffs(a: torch.Tensor, b: torch.Tensor, scale: float) -> dict:
    d = (a.float() - b.float()).abs()
    return {"max": d.max().item(), "mean": d.mean().item(), "max_rel": d.max().item() / scale,
            "mean_rel": d.mean().item() / scale}


def _pipeline_latents(out) -> torch.Tensor | None:
    """The pipeline's latent answer for one sample, or None where it returns more than one tensor (streams)."""
    if getattr(out, "audio", None) is not None:
        return None
    lat = out.frames if hasattr(out, "frames") else out.images
    return lat[0]


def serving(model: Model, steps: int) -> dict:
    """Section 1 of the module docstring."""
    p = model.params(steps, None, rollout=False)
    engine = {d: model.engine(d).run(p, model.image).output_latents()[0] for d in DTYPES}
    pipe = {d: _pipeline_latents(model.pipeline_output(d, p, "latent")) for d in DTYPES}
    compared = "latents"
    if pipe["f32"] is None or pipe["f32"].shape != engine["f32"].shape:
        compared = "frames"
        engine = {d: _frames(model, d, engine[d][None], p) for d in DTYPES}
        pipe = {d: _pipeline_frames(model.pipeline_output(d, p, "pt")) for d in DTYPES}
    scale = engine["f32"].float().pow(2).mean().sqrt().item()
    return {"compared": compared, "guided": model.family.guidance.uses_cfg(p), "scale": scale,
            "pipe_bf16": _diffs(engine["bf16"], pipe["bf16"], scale),
            "own_f32": _diffs(engine["bf16"], engine["f32"], scale),
            "pipe_bf16_vs_pipe_f32": _diffs(pipe["bf16"], pipe["f32"], scale),
            "f32_parity": _diffs(engine["f32"], pipe["f32"], scale)}


def _frames(model: Model, dtype: str, latents: torch.Tensor, p: GenerationParams) -> torch.Tensor:
    """The decode worker's frames [F, H, W, 3] of one sample's final latents, its VAE in ``dtype``."""
    decoder = model._get("decoder", dtype, lambda d: model.family.decoder.load(model.info, d, torch.device("cpu")))
    with torch.no_grad():
        if hasattr(decoder, "decode_rows"):  # a decoder that reads its request (several streams)
            return decoder.decode_rows(latents, [(p, 0)], *model.family.latents.size(model.info, p.height, p.width,
                                                                                      p.fields)).frames[0]
        made = model.family.latents.size(model.info, p.height, p.width, p.fields)
        return decoder.decode(model.family.latents.unpack(latents, model.info, *made), p.height, p.width)[0]


def _pipeline_frames(out) -> torch.Tensor:
    frames = (out.frames if hasattr(out, "frames") else out.images)[0].float()
    return frames.permute(0, 2, 3, 1) if frames.ndim == 4 else frames.permute(1, 2, 0)[None]


def _rollout(model: Model, dtype: str, p: GenerationParams) -> list[tuple[torch.Tensor, list[int], Trajectory]]:
    """The engine's rollout of ``p`` in ``dtype``: each sample's (log-probs, their steps, trajectory)."""
    out = model.engine(dtype).run(p, model.image).extras()
    steps = out[LOG_PROB_STEPS.name].tolist()
    return [(out[LOG_PROBS.name][i], steps, Trajectory(out[TRAJECTORY_LATENTS.name][i], out[TRAJECTORY_TIMESTEPS.name],
                                                       out[TRAJECTORY_SIGMAS.name])) for i in range(p.n)]


def _gap(model: Model, samples: list, dtype: str, p: GenerationParams) -> dict:
    """Mean and max |rollout - recompute| over ``samples``' SDE steps, the trainer in ``dtype`` taking each
    sample alone."""
    trainer = model.trainer(dtype)
    image = None if model.image is None else trainer.image(p, model.image)
    diffs = []
    for log_probs, steps, trajectory in samples:
        with torch.no_grad():
            diffs.append((trainer.log_probs(trajectory, steps, p, image=image).float() - log_probs.float()).abs())
    d = torch.cat(diffs)
    return {"mean": d.mean().item(), "max": d.max().item()}


def rollouts(model: Model, steps: int, cfg: bool, group: int) -> dict:
    """Section 2 of the module docstring, one guidance setting."""
    try:
        p = model.params(steps, cfg, rollout=True)
        off = 0.0 if not cfg and model.family.guidance.uses_cfg(p) else 1.0  # guided above 0 (Z-Image's pipeline)
        p = model.params(steps, cfg, rollout=True, off=off)
    except FieldError as e:  # a model that takes no CFG
        return {"refused": f"{e.field}: {e.message}"}
    if model.family.guidance.uses_cfg(p) != cfg:
        return {"refused": f"{model.family.cfg_field} does not turn CFG {'on' if cfg else 'off'} on this model"}
    answers = {d: _rollout(model, d, p) for d in DTYPES}
    out = {"sde_steps": len(answers["f32"][0][1]), "abs_log_prob": answers["f32"][0][0].abs().mean().item()}
    out.update({f"{rolled}/{recomputed}": _gap(model, answers[rolled], recomputed, p) for rolled, recomputed in PAIRS})
    if group > 1:  # the samples of one request share the engine's forwards; the trainer takes each alone
        pg = model.params(steps, cfg, rollout=True, off=off, n=group)
        out.update({f"group {d}/{d}": _gap(model, _rollout(model, d, pg), d, pg) for d in DTYPES})
    return out


def bench_model(name: str, steps: int, group: int = 0) -> dict:
    t0 = time.perf_counter()
    model = Model(name)
    out = {"model": name, "pipeline": model.family.pipeline, "steps": steps, "serving": serving(model, steps),
           "rollout": {label: rollouts(model, steps, cfg, group) for label, cfg in (("no_cfg", False), ("cfg", True))}}
    out["seconds"] = time.perf_counter() - t0
    return out


def _e(v: float) -> str:
    return f"{v:.1e}"


def serving_row(r: dict) -> str:
    s = r["serving"]
    cells = [r["model"], s["compared"] + (", CFG" if s["guided"] else ""), f"{s['scale']:.2f}"]
    for key in ("pipe_bf16", "own_f32", "pipe_bf16_vs_pipe_f32"):
        cells.append(f"{_e(s[key]['max'])} / {_e(s[key]['mean'])} ({_e(s[key]['max_rel'])} / {_e(s[key]['mean_rel'])})")
    cells.append(_e(s["f32_parity"]["max"]))
    return "| " + " | ".join(cells) + " |"


def _columns(results: list[dict]) -> list[str]:
    """The rollout table's gap columns: the PAIRS, then the group's where measured."""
    keys = [f"{a}/{b}" for a, b in PAIRS]
    return keys + [f"group {d}/{d}" for d in DTYPES if any(f"group {d}/{d}" in x for r in results
                                                            for x in r["rollout"].values())]


def rollout_row(r: dict, label: str, columns: list[str]) -> str:
    x, guidance = r["rollout"][label], "CFG" if label == "cfg" else "no CFG"
    if "refused" in x:
        return f"| {r['model']} | {guidance} | {x['refused']} |" + " - |" * (len(columns) + 1)
    cells = [r["model"], guidance, str(x["sde_steps"]), f"{x['abs_log_prob']:.2f}"]
    cells += [f"{_e(x[k]['mean'])} / {_e(x[k]['max'])}" if k in x else "-" for k in columns]
    return "| " + " | ".join(cells) + " |"


def _heading(column: str, group: int) -> str:
    rolled, recomputed = column.removeprefix("group ").split("/")
    what = f"rollout {rolled} - recompute {recomputed}"
    return f"{what}, a group of {group}" if column.startswith("group") else what


SERVING_HEAD = ("| model | compared | scale (RMS) | engine bf16 - pipe bf16: max / mean (over scale) | engine bf16 - "
                "engine f32 | pipe bf16 - pipe f32 | f32 parity (max) |\n|---|---|---|---|---|---|---|")


def rollout_head(columns: list[str], group: int) -> str:
    return ("| model | guidance | SDE steps | mean \\|lp\\| | " + " | ".join(_heading(c, group) for c in columns) +
            " |\n|---|---|---|---|" + "---|" * len(columns))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=None, help="built-in models (default: one tiny per pipeline, "
                                                               "then small-sd3)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--group", type=int, default=4, help="samples of one grouped rollout (0: none)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    results = []
    for name in args.models or default_models():
        results.append(bench_model(name, args.steps, args.group))
        r, columns = results[-1], _columns(results[-1:])
        print(f"# {name}: {r['seconds']:.1f} s", flush=True)
        print(serving_row(r), rollout_row(r, "no_cfg", columns), rollout_row(r, "cfg", columns), sep="\n", flush=True)
    print("\nServing (latents, or frames where noted; each over the scale in brackets)\n" + SERVING_HEAD)
    print("\n".join(serving_row(r) for r in results))
    columns = _columns(results)
    print("\nRollout log-probs against the trainer's recompute: mean / max\n" + rollout_head(columns, args.group))
    print("\n".join(rollout_row(r, label, columns) for r in results for label in ("no_cfg", "cfg")))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
