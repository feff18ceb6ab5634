"""What the engine reads from a diffusers model directory, whatever its family.

Each worker loads only its own components (see the family's binding); this
module holds the facts every process needs without loading any weights: the
family, the pipeline index, the request defaults, the latent geometry and the
scheduler facts (training timesteps, flow shift), read once here for every user.
``common.families.read_model`` picks the binding from ``model_index.json`` and
reads the rest with :meth:`ModelInfo.read_with`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from common.diffusion.binding import Binding

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


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    family: Binding
    boundary_ratio: float | None
    has_transformer_2: bool
    defaults: dict  # the request fields' defaults: the pipeline's, then serving_defaults.json's
    vae_scale_spatial: int
    vae_scale_temporal: int
    latent_channels: int
    patch_size: tuple[int, ...]
    # The scheduler facts both schedulers (serving, rollout Euler) and the expert split depend on.
    scheduler_config: dict
    num_train_timesteps: int
    flow_shift: float
    fps: int = 16  # frames per second of the videos it makes (MP4 output)
    transformer_config: dict = field(default_factory=dict)  # e.g. FLUX.1-dev's guidance_embeds
    index: dict = field(default_factory=dict)  # model_index.json: components, and e.g. Wan2.2's expand_timesteps
    # One checkpoint file holding the transformer's weights (launch.py --transformer-file; a .safetensors or a
    # .gguf), read instead of transformer/'s own (common/diffusion/loading.py); None: the directory's.
    transformer_file: Path | None = None

    @property
    def expand_timesteps(self) -> bool:
        """Wan2.2 TI2V: a timestep per latent token (frame 0's can be 0: the image's latent)."""
        return bool(self.index.get("expand_timesteps", False))

    def has_component(self, name: str) -> bool:
        """Whether the directory has component ``name`` (saved pipelines list absent ones as [null, null])."""
        entry = self.index.get(name)
        return bool(entry) and entry[0] is not None

    @property
    def dynamic_shifting(self) -> bool:
        """The scheduler shifts by ``mu`` (a request's, or the one of its image size): FLUX, Qwen-Image."""
        return bool(self.scheduler_config.get("use_dynamic_shifting", False))

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
