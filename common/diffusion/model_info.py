"""What the engine reads from a diffusers model directory, whatever its family.

Each worker loads only its own components (see the family's binding); this
module reads the facts every process needs without loading any weights
(:class:`~common.diffusion.model_facts.ModelFacts`), once for every user, and
holds them with the family's binding.
``common.families.read_model`` picks the binding from ``model_index.json`` and
reads the rest with :meth:`ModelInfo.read_with`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.diffusion.binding import Binding
from common.diffusion.model_facts import ModelFacts

SERVING_DEFAULTS_FILE = "serving_defaults.json"
STEP_CACHE_FILE = "step_cache.json"  # the directory's TeaCache polynomial (common/diffusion/cache_signals.py)


def flow_shift_of(scheduler_config) -> float:
    """The static flow shift of a scheduler config: UniPC calls it ``flow_shift``, flow-match Euler ``shift``."""
    return float(scheduler_config.get("flow_shift", None) or scheduler_config.get("shift", 1.0))


def read_index(path: str | Path) -> dict:
    index_file = Path(path) / "model_index.json"
    if not index_file.is_file():
        raise FileNotFoundError(f"{path} is not a diffusers model directory (no model_index.json)")
    return json.loads(index_file.read_text())


@dataclass(frozen=True, kw_only=True)
class ModelInfo(ModelFacts):
    """A model directory's facts (:class:`ModelFacts`) and its family's binding."""

    family: Binding

    @classmethod
    def read_with(cls, family: Binding, path: str | Path) -> "ModelInfo":
        path = Path(path)
        index = read_index(path)
        has_t2 = bool(index.get("transformer_2") and index["transformer_2"][0] is not None)
        tdir = path / "transformer"
        if not (tdir / "config.json").is_file():
            tdir = path / "transformer_2"
        tcfg = json.loads((tdir / "config.json").read_text())
        geometry = family.latents.geometry(path, tcfg)
        defaults = family.pipeline_defaults(tcfg, geometry)
        extra = path / SERVING_DEFAULTS_FILE
        if extra.is_file():
            defaults.update(json.loads(extra.read_text()))
        scfg = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
        return cls(
            path=path,
            family=family,
            boundary_ratio=index.get("boundary_ratio"),
            has_transformer_2=has_t2,
            defaults=defaults,
            vae_scale_spatial=geometry.vae_scale_spatial,
            vae_scale_temporal=geometry.vae_scale_temporal,
            latent_channels=geometry.latent_channels,
            patch_size=tuple(geometry.patch_size),
            scheduler_config=scfg,
            num_train_timesteps=int(scfg.get("num_train_timesteps", 1000)),
            flow_shift=flow_shift_of(scfg),
            fps=int(defaults.pop("fps", family.fps)),
            transformer_config=tcfg,
            index=index,
        )

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """Shape of one sample's initial noise, as the family's diffusers pipeline draws it."""
        return self.family.latents.shape(self, height, width, num_frames)
