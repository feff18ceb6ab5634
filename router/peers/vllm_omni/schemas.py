"""vLLM-Omni's RL request bodies, field for field as its ``rl_api.py`` declares them (and ``/v1/omni/sleep`` /
``/v1/omni/wakeup``'s), and its answers (documentation only: ``/openapi.json``; the handlers build the answers).

As there, a top-level field a body names that the model does not declare is ignored (pydantic's default);
unlike there, types are strict (no ``"1"`` for an int), so that a mistake is a 400 naming the field.
``sampling_params`` is a free dict there, splatted into ``OmniDiffusionSamplingParams``; its keys are checked
by router/peers/vllm_omni/translate.py.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


StageIds = Optional[list[int]]


class OmniRolloutRequest(_Body):
    """``POST /rollout/generate`` (vLLM-Omni's ``RolloutGenerateRequest``)."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "a red fox", "request_id": "rollout-1", "stage_id": 0,
         "sampling_params": {"seed": 7, "num_inference_steps": 8, "num_outputs_per_prompt": 2,
                             "extra_args": {"sde_type": "sde", "noise_level": 0.7, "sde_window_size": 2}}}]})

    prompt: str
    negative_prompt: Optional[str] = None
    request_id: str = Field(default="", description="echoed; empty: rollout-<uuid hex>. 1-64 of A-Z a-z 0-9 _ . -")
    stage_id: Optional[int] = Field(default=None, description="this engine serves one diffusion stage, 0")
    sampling_params: dict[str, Any] = Field(default_factory=dict, description="OmniDiffusionSamplingParams' "
                                            "fields; the rollout's own settings in extra_args")
    transport: Literal["shm"] = "shm"


class AbortRequestsRequest(_Body):
    request_ids: Optional[list[str]] = Field(default=None, max_length=100_000)


class WeightTransferBody(_Body):
    init_info: dict[str, Any] = Field(description="backend: safetensors, filesystem or shared_storage; "
                                      "stage_ids, component")


class WeightUpdateBody(_Body):
    update_info: dict[str, Any] = Field(description="path (or weights_path): a .safetensors file below "
                                        "--weight-root holding the component's whole state dict; stage_ids, component")


class FinishWeightUpdateBody(_Body):
    weight_version: Optional[Union[str, int]] = None


class WeightsChecksumRequest(_Body):
    stage_ids: StageIds = None
    component: Optional[str] = None


class LoadLoRARequest(_Body):
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False
    stage_ids: StageIds = None


class UnloadLoRARequest(_Body):
    lora_name: str
    lora_int_id: Optional[int] = None
    stage_ids: StageIds = None


class OmniSleepRequest(_Body):
    stage_ids: list[int]
    level: int = 2


class OmniWakeupRequest(_Body):
    stage_ids: list[int]


# --- answers ------------------------------------------------------------------------------------------------
class _Answer(BaseModel):
    """Answers may gain fields."""


class Status(_Answer):
    status: str = Field(description="paused, resumed")


class PauseStatus(_Answer):
    is_paused: bool
    barrier_complete: bool


class Aborted(_Answer):
    status: Literal["aborted"]
    aborted: int = Field(description="the ids sent, or the generations cancelled")


class Ack(_Answer):
    stage_id: int
    success: bool
    result: dict[str, Any] = Field(description="the worker's answer: supported, rank, ...")


class Acks(_Answer):
    message: str
    acks: list[Ack]


class Stage(_Answer):
    stage_id: int
    stage_type: str
    model_stage: str
    world_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int


class WorldSize(_Answer):
    world_size: int
    stages: list[Stage]


class StageSleep(_Answer):
    stage_id: int
    is_sleeping: bool


class SleepStatus(_Answer):
    is_sleeping: bool
    stages: list[StageSleep]
    tags: list[str]


class OmniAck(_Answer):
    task_id: str
    status: Literal["SUCCESS", "ERROR"]
    stage_id: Optional[int]
    rank: Optional[int]
    freed_bytes: int
    metadata: dict[str, Any]
    error_msg: Optional[str]


class OmniSleepAnswer(_Answer):
    status: Literal["SUCCESS", "SKIPPED"]
    acks: Optional[list[OmniAck]] = None
    reason: Optional[str] = None


class Handle(_Answer):
    name: str = Field(description="the POSIX shared-memory segment (/dev/shm/<name>) the client opens and unlinks")
    shape: list[int]
    numpy_dtype: str
    nbytes: int
    torch_dtype: str
    kind: Literal["shm"]
    ownership: Literal["client"]
    release: Literal["unlink"]


class Handles(_Answer):
    latents: Optional[Handle] = Field(description="[T+1, *latent] ([n, T+1, *latent] for n > 1)")
    timesteps: Optional[Handle] = Field(description="[T]")
    log_probs: Optional[Handle] = Field(description="[T] ([n, T]): 0 on the steps without an SDE")
    kl: Optional[Handle] = Field(default=None, description="extra_args.return_kl: as log_probs")
    ref_log_probs: Optional[Handle] = Field(default=None, description="extra_args.return_kl: as log_probs")


class RolloutAnswer(_Answer):
    request_id: str
    stage_id: int
    transport: Literal["shm"]
    handles: Handles
    metrics: dict[str, Any]


class OmniRl(_Answer):
    stage_aware: bool
    rollout_transport: Literal["shm"]
    topology: WorldSize


class ServerInfo(_Answer):
    omni_rl: OmniRl
    engine: dict[str, Any] = Field(description="the model, its family and pipeline, the weight version")
    shm: dict[str, int] = Field(description="rollout segments written and not yet unlinked by their client")
