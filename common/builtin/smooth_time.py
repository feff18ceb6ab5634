"""Built-in models whose timestep embedding changes smoothly from step to step, as a trained model's does.

Every diffusers transformer embeds its timestep in two stages: ``Timesteps`` turns it into sinusoidal features
(half sines, half cosines; feature ``j`` and ``j + half`` share frequency
``exp(-ln(10000) * j / (half - downscale_freq_shift))``, falling with ``j``), then a ``TimestepEmbedding`` MLP
(``linear_1``, an activation, ``linear_2``) maps them to the embedding that modulates the blocks. A random
``linear_1`` weighs the fastest sinusoids, whose phase turns by radians between two denoising steps, as much as
the slow ones, so a random model's embedding jumps by tens of percent per step; a trained one's moves by a few.

:func:`smooth_time_embedding` scales each column of ``linear_1`` by a gain of its feature's phase per step
(``frequency * step``, with ``step`` timestep units between steps on the 0..1000 scale: 20 for 50 steps):
1 up to ``keep`` radians, 0 from ``drop`` radians, a raised cosine in log-phase between. Every family feeds its
sinusoids the timestep on that scale (Wan and SD3 directly; FLUX multiplies the pipeline's t / 1000 by 1000;
Qwen-Image's ``Timesteps`` has ``scale=1000`` for the same t / 1000), so one setting serves them all.
FLUX.1-dev's guidance embedder is a ``TimestepEmbedding`` too and is smoothed alike (its input is constant
over a request's steps). Z-Image's ``TimestepEmbedder`` makes its own sinusoids (cos then sin, no shift) from
``t * t_scale`` on the same scale and maps them with ``mlp`` (``mlp.0`` is its first layer): :class:`_OwnSinusoids`
stands for its ``Timesteps``.

:class:`SmoothTimeSpec` is a built-in: a base spec built as usual, then its transformer weights so rescaled.
:func:`embedding_changes` measures the result (``bench/time_embedding.py`` prints it per model).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

MAX_PERIOD = 10000  # diffusers' get_timestep_embedding default; Timesteps does not change it
STEP = 20.0  # timestep units between two steps of a 50-step schedule over 0..1000
# A feature whose phase turns by at most KEEP_RAD per step keeps its weight, one that turns by DROP_RAD or more
# loses it. Measured (bench/time_embedding.py): the embedding then moves by a median 2-5% per step in every
# family, against 79-98% for the random base (docs/operations.md); common/builtin/__init__.py sets Wan
# text-to-video's tighter.
KEEP_RAD = 0.05
DROP_RAD = 0.2
EXPERTS = ("transformer", "transformer_2")


class _OwnSinusoids:
    """The ``Timesteps`` an embedder that makes its own sinusoids (Z-Image's) would have: its layout and call."""

    flip_sin_to_cos, downscale_freq_shift, scale = True, 0.0, 1.0

    def __init__(self, embedder: torch.nn.Module):
        self.embedder, self.num_channels = embedder, embedder.frequency_embedding_size

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return self.embedder.timestep_embedding(t, self.num_channels)


def _own_sinusoids(module: torch.nn.Module) -> bool:
    return (hasattr(module, "frequency_embedding_size") and hasattr(module, "timestep_embedding")
            and isinstance(getattr(module, "mlp", None), torch.nn.Sequential))


def first_layer(embedder: torch.nn.Module) -> str:
    """The name, inside ``embedder``, of the Linear that reads the sinusoids."""
    return "mlp.0" if _own_sinusoids(embedder) else "linear_1"


def time_embedders(transformer: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    """Each ``TimestepEmbedding`` of ``transformer`` by module name, with the ``Timesteps`` beside it (a
    module of its parent making as many features as ``linear_1`` takes) that makes its input; and each
    embedder that makes its own sinusoids, with :class:`_OwnSinusoids`."""
    from diffusers.models.embeddings import TimestepEmbedding, Timesteps

    modules = dict(transformer.named_modules())
    found = {}
    for name, module in modules.items():
        if _own_sinusoids(module):
            found[name] = (module, _OwnSinusoids(module))
            continue
        if not isinstance(module, TimestepEmbedding):
            continue
        parent = modules[name.rpartition(".")[0]]
        width = module.linear_1.in_features
        sources = [m for m in parent.children() if isinstance(m, Timesteps) and m.num_channels == width]
        layouts = {(m.flip_sin_to_cos, float(m.downscale_freq_shift)) for m in sources}
        if len(layouts) != 1:
            raise ValueError(f"{type(transformer).__name__}.{name}: no single Timesteps of {width} features "
                             "beside it to read its frequencies from")
        found[name] = (module, sources[0])
    if not found:
        raise ValueError(f"{type(transformer).__name__} has no TimestepEmbedding")
    return found


def feature_frequencies(source: torch.nn.Module) -> torch.Tensor:
    """Radians per timestep unit of each feature ``source`` (a ``Timesteps``) makes, in its order."""
    half = source.num_channels // 2
    freq = torch.exp(-math.log(MAX_PERIOD) * torch.arange(half, dtype=torch.float64)
                     / (half - source.downscale_freq_shift))
    out = torch.cat([freq, freq])  # sin then cos, or cos then sin: the same frequencies
    if source.num_channels % 2:
        out = torch.cat([out, torch.zeros(1, dtype=torch.float64)])  # the zero padding: constant
    return out


def phase_gain(phase: torch.Tensor, keep: float = KEEP_RAD, drop: float = DROP_RAD) -> torch.Tensor:
    """1 for a phase per step up to ``keep``, 0 from ``drop``, a raised cosine in log-phase between."""
    x = ((phase.clamp(min=1e-30).log() - math.log(keep)) / math.log(drop / keep)).clamp(0.0, 1.0)
    return 0.5 * (1.0 + torch.cos(math.pi * x))


def column_gains(transformer: torch.nn.Module, step: float = STEP, keep: float = KEEP_RAD,
                 drop: float = DROP_RAD) -> dict[str, torch.Tensor]:
    """The gain of each column of every time embedder's first layer's weight, by parameter name (float64)."""
    return {f"{name}.{first_layer(embedder)}.weight": phase_gain(feature_frequencies(source) * step, keep, drop)
            for name, (embedder, source) in time_embedders(transformer).items()}


def _facts(gains: dict[str, torch.Tensor], step: float, keep: float, drop: float) -> dict:
    per = {name.removesuffix(".weight").removesuffix(".linear_1").removesuffix(".mlp.0"): {
        "features": g.numel(), "kept": int((g == 1).sum()), "tapered": int(((g > 0) & (g < 1)).sum()),
        "dropped": int((g == 0).sum())} for name, g in gains.items()}
    return {"step": step, "keep_rad": keep, "drop_rad": drop, "embedders": per}


def smooth_time_embedding(transformer: torch.nn.Module, step: float = STEP, keep: float = KEEP_RAD,
                          drop: float = DROP_RAD) -> dict:
    """Scale, in place, the columns of every time embedder's ``linear_1`` weight that read features turning
    faster than ``keep`` radians per ``step`` timestep units (to 0 from ``drop``); returns what it did: per
    embedder the features kept whole, tapered and dropped."""
    gains = column_gains(transformer, step, keep, drop)
    params = dict(transformer.named_parameters())
    with torch.no_grad():
        for name, gain in gains.items():
            w = params[name]
            w.copy_((w.double() * gain.to(w.device)).to(w.dtype))
    return _facts(gains, step, keep, drop)


def smooth_component_dir(component: str | Path, step: float = STEP, keep: float = KEEP_RAD,
                         drop: float = DROP_RAD) -> dict:
    """:func:`smooth_time_embedding` on a saved transformer (``config.json`` and safetensors files): each file
    rewritten under its own name, metadata and dtypes, only the time embedders' ``linear_1`` weights changed."""
    import diffusers
    from safetensors import safe_open
    from safetensors.torch import save_file

    component = Path(component)
    config = json.loads((component / "config.json").read_text())
    with torch.device("meta"):  # the module tree only: which weights are the embedders', their frequencies
        skeleton = getattr(diffusers, config["_class_name"]).from_config(config)
    gains = column_gains(skeleton, step, keep, drop)
    todo = set(gains)
    for path in sorted(component.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        hit = todo & set(tensors)
        for name in hit:
            w = tensors[name]
            tensors[name] = (w.double() * gains[name]).to(w.dtype)
        if hit:
            save_file(tensors, path, metadata=metadata)
            todo -= hit
    if todo:
        raise ValueError(f"{component}: no weights named {sorted(todo)}")
    return _facts(gains, step, keep, drop)


@dataclasses.dataclass(frozen=True)
class SmoothTimeSpec:
    """Built-in model ``base`` (a spec) with :func:`smooth_time_embedding` applied to its transformer(s)."""

    name: str
    base: object
    step: float = STEP
    keep_rad: float = KEEP_RAD
    drop_rad: float = DROP_RAD

    def build(self, out_dir) -> Path:
        """The base model's directory (its serving defaults included), its experts' weights rescaled."""
        out = Path(out_dir)
        self.base.build(out)
        for expert in EXPERTS:
            if (out / expert / "config.json").is_file():
                smooth_component_dir(out / expert, self.step, self.keep_rad, self.drop_rad)
        return out


def smooth_variants(specs: dict, bases, settings: dict | None = None) -> dict[str, SmoothTimeSpec]:
    """``<base>-smooth`` for each name in ``bases`` (specs in ``specs``), by name; ``settings``: per base,
    ``keep_rad`` / ``drop_rad`` other than the defaults."""
    settings = settings or {}
    return {f"{b}-smooth": SmoothTimeSpec(name=f"{b}-smooth", base=specs[b], **settings.get(b, {})) for b in bases}


# --- measurement ---------------------------------------------------------------------------------------------

def time_embeddings(transformer: torch.nn.Module, timesteps: torch.Tensor) -> dict[str, torch.Tensor]:
    """For timesteps [N] on the 0..1000 scale, each time embedder's output [N, D] by module name (FLUX's
    guidance embedder left out: its input is the guidance); for Wan also ``<parent>.timestep_proj``, the
    6 x D projection ``time_proj(act_fn(temb))`` that modulates its blocks."""
    modules = dict(transformer.named_modules())
    out = {}
    with torch.no_grad():
        for name, (embedder, source) in time_embedders(transformer).items():
            if name.rpartition(".")[2].startswith("guidance"):
                continue
            # The families' transformers feed Timesteps t / scale (see the module docstring).
            features = source(timesteps.double() / source.scale)
            w = embedder.get_submodule(first_layer(embedder)).weight
            mlp = embedder.mlp if isinstance(source, _OwnSinusoids) else embedder
            temb = mlp(features.to(device=w.device, dtype=w.dtype)).float()
            out[name] = temb
            parent_name = name.rpartition(".")[0]
            parent = modules[parent_name]
            if isinstance(getattr(parent, "time_proj", None), torch.nn.Linear) and hasattr(parent, "act_fn"):
                out[f"{parent_name}.timestep_proj"] = parent.time_proj(parent.act_fn(temb.to(w.dtype))).float()
    return out


def relative_l1_changes(emb: torch.Tensor) -> torch.Tensor:
    """``mean|e_i - e_{i-1}| / mean|e_{i-1}|`` for consecutive rows of ``emb`` [N, ...]: [N - 1]."""
    flat = emb.flatten(1).double()
    return (flat[1:] - flat[:-1]).abs().mean(1) / flat[:-1].abs().mean(1)


def embedding_changes(transformer: torch.nn.Module, timesteps: torch.Tensor) -> dict[str, torch.Tensor]:
    """:func:`relative_l1_changes` of each of :func:`time_embeddings` over ``timesteps`` [N]."""
    return {k: relative_l1_changes(v) for k, v in time_embeddings(transformer, timesteps).items()}
