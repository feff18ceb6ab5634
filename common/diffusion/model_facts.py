"""What a model directory says, whatever its family: the facts a binding's parts read.

:class:`ModelFacts` holds the directory's path, its pipeline index, the request defaults, the latent geometry and
the scheduler facts (training timesteps, flow shift). The parts (:mod:`common.diffusion.parts`) take these and
never the binding they belong to; :class:`~common.diffusion.model_info.ModelInfo` is these facts with the
family's binding beside them, what the stages and the trainer hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    path: Path
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
