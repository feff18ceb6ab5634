"""Random valid configurations of each family's models, for the parity sweep (tests/test_config_sweep.py).

A family's spec module (:mod:`common.builtin.specs`) may declare ``SWEEP_KNOBS``: spec field -> the values a
drawn configuration takes it from (widths, heads, layers, patch and latent sizes, VAE levels and statistics, text
encoder sizes and lengths, experts, guidance embeddings, the request's size and steps). :func:`draw` starts from
the family's first tiny built-in, draws every knob from a seeded generator and keeps the first combination the
spec accepts (its ``__post_init__`` says what its pipeline and models need). :func:`scheduler_knobs` draws the
scheduler options the family's scheduler class reads (its shift, dynamic shifting and its bounds, the time-shift
type, a terminal shift, Karras or exponential sigmas; UniPC's order) and :func:`vae_knobs` the VAE's latent
statistics (scaling and shift factors, per-channel means and deviations), written into the built directory's
configs by :func:`build_drawn`. Everything follows from ``(pipeline, seed, index)``, so a
configuration the sweep reports is rebuilt from those three.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import random
from pathlib import Path

# Draws per configuration before giving up: the knobs are chosen so that most combinations are valid.
MAX_TRIES = 400


def base_specs() -> dict[str, object]:
    """Pipeline class -> the first tiny built-in that makes one (its smooth-time variants aside): the base each
    drawn configuration starts from."""
    from common.builtin import BUILTINS

    out: dict[str, object] = {}
    for name, spec in BUILTINS.items():
        pipeline = getattr(spec, "pipeline", None)
        if name.startswith("tiny") and not name.endswith("-smooth") and pipeline:
            out.setdefault(pipeline, spec)
    return out


def knobs_of(spec) -> dict[str, tuple]:
    """The ``SWEEP_KNOBS`` of ``spec``'s module that are fields of ``spec`` (a module may hold several specs)."""
    module = importlib.import_module(type(spec).__module__)
    names = {f.name for f in dataclasses.fields(spec)}
    return {k: tuple(v) for k, v in getattr(module, "SWEEP_KNOBS", {}).items() if k in names}


def rng_for(pipeline: str, seed: int, index: int) -> random.Random:
    digest = hashlib.sha256(f"{pipeline}/{seed}/{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def draw(pipeline: str, seed: int, index: int):
    """Configuration ``index`` of the sweep ``seed`` for ``pipeline``: its base spec with every knob drawn."""
    base = base_specs()[pipeline]
    knobs = knobs_of(base)
    rng = rng_for(pipeline, seed, index)
    last = None
    for _ in range(MAX_TRIES):
        drawn = {name: rng.choice(values) for name, values in knobs.items()}
        try:
            return dataclasses.replace(base, name=f"sweep-{seed}-{index}", seed=rng.randrange(1 << 16), **drawn)
        except ValueError as e:  # the spec refuses the combination: draw again
            last = e
    raise RuntimeError(f"{pipeline}: no valid configuration in {MAX_TRIES} draws (last: {last})")


# The scheduler options a flow-match Euler scheduler reads, as a pipeline may ship them. Karras and exponential
# sigmas exclude each other; the time-shift type and the sequence-length bounds matter only with dynamic shifting.
FLOW_MATCH_KNOBS = {
    "shift": (1.0, 2.0, 3.0, 5.0),
    "shift_terminal": (None, None, 0.05, 0.2),
    "sigmas": (None, None, "use_karras_sigmas", "use_exponential_sigmas"),
    "time_shift_type": ("exponential", "linear"),
    "base_shift": (0.25, 0.5, 0.8),
    "max_shift": (0.9, 1.15, 1.5),
    "base_image_seq_len": (16, 64, 256),
    "max_image_seq_len": (1024, 4096),
}
UNIPC_KNOBS = {"flow_shift": (1.0, 3.0, 5.0), "solver_order": (1, 2, 3)}


def scheduler_knobs(config: dict, rng: random.Random) -> dict:
    """Scheduler config entries drawn for ``config`` (a ``scheduler_config.json``), keeping its class and its
    choice of static or dynamic shifting; {} for a class without knobs here."""
    cls = config.get("_class_name")
    if cls == "UniPCMultistepScheduler" and config.get("use_flow_sigmas"):
        return {k: rng.choice(v) for k, v in UNIPC_KNOBS.items()}
    if cls != "FlowMatchEulerDiscreteScheduler":
        return {}
    drawn = {k: rng.choice(v) for k, v in FLOW_MATCH_KNOBS.items()}
    out = {"shift_terminal": drawn["shift_terminal"],
           "use_karras_sigmas": drawn["sigmas"] == "use_karras_sigmas",
           "use_exponential_sigmas": drawn["sigmas"] == "use_exponential_sigmas"}
    if config.get("use_dynamic_shifting"):
        out.update({k: drawn[k] for k in ("time_shift_type", "base_shift", "max_shift", "base_image_seq_len",
                                          "max_image_seq_len")})
    else:
        out["shift"] = drawn["shift"]
    return out


# The VAE's latent statistics as checkpoints ship them (SD3's, FLUX.1's, SDXL's, HunyuanVideo 1.5's scaling).
SCALING_FACTORS = (0.13025, 0.3611, 1.03682, 1.5305)
SHIFT_FACTORS = (0.0, 0.0609, 0.1159)


def vae_knobs(config: dict, rng: random.Random) -> dict:
    """VAE config entries drawn for ``config`` (a ``vae/config.json``): the latents' scaling and shift factors
    and per-channel means and standard deviations, where the class has them."""
    out = {}
    if isinstance(config.get("scaling_factor"), float):
        out["scaling_factor"] = rng.choice(SCALING_FACTORS)
    if isinstance(config.get("shift_factor"), float):
        out["shift_factor"] = rng.choice(SHIFT_FACTORS)
    if isinstance(config.get("latents_mean"), list) and isinstance(config.get("latents_std"), list):
        out["latents_mean"] = [round(rng.uniform(-0.5, 0.5), 4) for _ in config["latents_mean"]]
        out["latents_std"] = [round(rng.uniform(0.5, 3.0), 4) for _ in config["latents_std"]]
    return out


def _redraw(path: Path, knobs, rng: random.Random) -> dict:
    """Rewrite the JSON config at ``path`` with the entries ``knobs(config, rng)`` draws; those entries."""
    config = json.loads(path.read_text())
    drawn = knobs(config, rng)
    path.write_text(json.dumps({**config, **drawn}, indent=2, sort_keys=True) + "\n")
    return drawn


def build_drawn(pipeline: str, seed: int, index: int, out_dir: str | Path) -> tuple[object, dict, Path]:
    """Build configuration ``index`` of sweep ``seed`` for ``pipeline`` into ``out_dir``: (its spec, the scheduler
    and VAE config entries drawn, the directory)."""
    from common.builtin.build import build

    spec = draw(pipeline, seed, index)
    out = build(spec, out_dir)
    drawn = _redraw(out / "scheduler" / "scheduler_config.json", scheduler_knobs,
                    rng_for(pipeline + "/scheduler", seed, index))
    vae = _redraw(out / "vae" / "config.json", vae_knobs, rng_for(pipeline + "/vae", seed, index))
    return spec, {**drawn, **{f"vae.{k}": v for k, v in vae.items()}}, out


def describe(spec, drawn: dict) -> str:
    """The drawn values of a configuration, one line: what a failing sweep case prints."""
    knobs = {k: getattr(spec, k) for k in knobs_of(spec)}
    return json.dumps({"spec": knobs, "seed": spec.seed, "configs": drawn}, sort_keys=True, default=str)
