"""SGLang diffusion's request bodies, field for field as sglang 0.5.23 declares them (``io_struct.py``).

As there, a field a body names that the model does not declare is ignored (pydantic's default); unlike there,
types are strict (no ``"32"`` for an int) so that a mistake is a 400 naming the field, never a coercion. Its
fields that belong to some families only (true CFG's scale) are not declared here: the translation passes a
body's field on wherever the served family declares it (common/diffusion/request_fields.py ``declared``).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from router.request.schemas import MAX_SEED


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class RolloutRequest(_Body):
    """``POST /rollout/generate``."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "a red fox", "seed": 7, "num_outputs_per_prompt": 4, "rollout_sde_type": "sde",
         "rollout_noise_level": 0.7, "rollout_return_dit_trajectory": True}]})

    prompt: str
    negative_prompt: Optional[str] = None
    seed: Optional[int] = Field(default=None, ge=0, le=MAX_SEED, description="null: the engine draws one and "
                                "answers it (sample i draws from seed + i)")
    generator_device: Literal["cuda", "cpu"] = Field(default="cuda", description="accepted for compatibility: "
                                                     "the engine always draws noise with a CPU generator")
    width: Optional[int] = None
    height: Optional[int] = None
    num_inference_steps: Optional[int] = None
    num_outputs_per_prompt: Optional[int] = Field(default=None, ge=1)
    guidance_scale: Optional[float] = None
    num_frames: Optional[int] = None
    fps: Optional[int] = Field(default=None, ge=1, description="a model whose family takes a frame rate (LTX-2): its "
                               "value; elsewhere the rate of a saved video, which this route makes none of")
    rollout: bool = True
    rollout_sde_type: Literal["sde", "cps", "ode"] = "sde"
    rollout_noise_level: float = Field(default=0.7, ge=0.0, le=10.0)
    rollout_log_prob_no_const: bool = False
    rollout_debug_mode: bool = True
    rollout_return_denoising_env: bool = False
    rollout_return_dit_trajectory: bool = False
    rollout_sde_step_indices: Optional[list[int]] = None
    rollout_return_step_indices: Optional[list[int]] = None
    image_path: Optional[list[str]] = Field(default=None, max_length=3, description="files below an --image-root")
    suppress_logs: bool = False
    extra_sampling_params: Optional[dict[str, Any]] = Field(default=None, description="any native "
                                                            "/rollout/generate field (docs/api.md)")


class UpdateWeightsFromDisk(_Body):
    model_path: str = Field(min_length=1, max_length=4096)
    flush_cache: bool = True
    target_modules: Optional[list[str]] = Field(default=None, max_length=16)


class GetWeightsChecksum(_Body):
    module_names: Optional[list[str]] = Field(default=None, max_length=16)


class InitWeightsUpdateGroup(_Body):
    """SGLang's weights group (``sglang.srt``'s ``InitWeightsUpdateGroupReqInput``): the trainer is rank 0."""

    master_address: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(default=1, ge=1)
    world_size: int = Field(ge=2)
    group_name: str = Field(default="weight_update_group", max_length=128)
    backend: Literal["gloo", "nccl"] = "nccl"


class UpdateWeightsFromDistributed(_Body):
    """One broadcast per tensor from rank 0, in this order."""

    names: list[str] = Field(min_length=1, max_length=100_000)
    dtypes: list[str] = Field(min_length=1, max_length=100_000)
    shapes: list[list[int]] = Field(min_length=1, max_length=100_000)
    group_name: str = Field(default="weight_update_group", max_length=128)
    flush_cache: bool = True
    target_modules: Optional[list[str]] = Field(default=None, max_length=1)


class DestroyWeightsUpdateGroup(_Body):
    group_name: str = Field(default="weight_update_group", max_length=128)
