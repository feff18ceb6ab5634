"""What the engine reads from a diffusers-format Wan model directory.

Each worker loads only its own components (see the stage modules); this
module holds the facts every process needs without loading any weights:
the pipeline index, the sizes to serve by default, the VAE's strides and the
scheduler facts (training timesteps, flow shift), read once here for every user.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SERVING_DEFAULTS_FILE = "serving_defaults.json"

# Wan's own pipeline defaults (480p) for directories that do not say otherwise.
WAN_DEFAULTS = {
    "height": 480,
    "width": 832,
    "num_frames": 81,
    "num_inference_steps": 50,
    "guidance_scale": 5.0,
}
MAX_SEQUENCE_LENGTH = 512
# Wan2.1 / Wan2.2 text-to-video models make 16 frames per second (diffusers' examples export at 16); a model
# directory's serving_defaults.json may say otherwise with "fps".
WAN_FPS = 16


def flow_shift_of(scheduler_config) -> float:
    """The static flow shift of a scheduler config: UniPC calls it ``flow_shift``, flow-match Euler ``shift``."""
    return float(scheduler_config.get("flow_shift", None) or scheduler_config.get("shift", 1.0))


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    boundary_ratio: float | None
    has_transformer_2: bool
    defaults: dict
    vae_scale_spatial: int
    vae_scale_temporal: int
    latent_channels: int
    patch_size: tuple[int, int, int]
    # The scheduler facts both schedulers (serving UniPC, rollout Euler) and the expert split depend on.
    scheduler_config: dict
    num_train_timesteps: int
    flow_shift: float
    fps: int = WAN_FPS  # frames per second of the videos it makes (MP4 output)

    @classmethod
    def read(cls, path: str | Path) -> "ModelInfo":
        path = Path(path)
        index_file = path / "model_index.json"
        if not index_file.is_file():
            raise FileNotFoundError(f"{path} is not a diffusers model directory (no model_index.json)")
        index = json.loads(index_file.read_text())
        defaults = dict(WAN_DEFAULTS)
        extra = path / SERVING_DEFAULTS_FILE
        if extra.is_file():
            defaults.update(json.loads(extra.read_text()))
        has_t2 = bool(index.get("transformer_2") and index["transformer_2"][0] is not None)
        tdir = path / "transformer"
        if not (tdir / "config.json").is_file():
            tdir = path / "transformer_2"
        tcfg = json.loads((tdir / "config.json").read_text())
        vcfg = json.loads((path / "vae" / "config.json").read_text())
        scfg = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
        # AutoencoderKLWan stores its strides in the config; Wan2.1's VAE uses 8 and 4.
        return cls(
            path=path,
            boundary_ratio=index.get("boundary_ratio"),
            has_transformer_2=has_t2,
            defaults=defaults,
            vae_scale_spatial=int(vcfg.get("scale_factor_spatial", 8)),
            vae_scale_temporal=int(vcfg.get("scale_factor_temporal", 4)),
            latent_channels=int(tcfg.get("in_channels", 16)),
            patch_size=tuple(tcfg.get("patch_size", (1, 2, 2))),
            scheduler_config=scfg,
            num_train_timesteps=int(scfg.get("num_train_timesteps", 1000)),
            flow_shift=flow_shift_of(scfg),
            fps=int(defaults.pop("fps", WAN_FPS)),
        )

    def latent_shape(self, height: int, width: int, num_frames: int) -> tuple[int, ...]:
        """Shape of one sample's initial noise, as diffusers' WanPipeline draws it."""
        return (
            1,
            self.latent_channels,
            (num_frames - 1) // self.vae_scale_temporal + 1,
            height // self.vae_scale_spatial,
            width // self.vae_scale_spatial,
        )
