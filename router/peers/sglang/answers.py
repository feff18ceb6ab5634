"""What SGLang's routes answer with 200, as pydantic models: documentation only (``/openapi.json``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class Done(BaseModel):
    """SGLang's control answer."""

    success: bool
    message: str
    weight_version: int | None = Field(default=None, description="the engine's weight version after an update")


class Memory(BaseModel):
    success: bool
    sleeping: bool
    message: str


class Health(BaseModel):
    status: str = Field(description="ok")


class Checksums(BaseModel):
    """SGLang's digest (compute_weights_checksum) per module asked for; not_found for one the denoise workers do
    not hold."""

    model_config = {"extra": "allow"}

    transformer: str | None = None
    transformer_2: str | None = None


class RolloutSample(BaseModel):
    """One sample of the msgpack list ``/rollout/generate`` answers (SGLang's RolloutResponse)."""

    request_id: str
    prompt: str
    seed: int
    generated_output: dict[str, Any] = Field(description='{"__tensor__": true, "data": safetensors bytes, "shape", '
                                             '"dtype"}: frames [3, F, H, W] in [0, 1]')
    rollout_log_probs: dict[str, Any] | None = Field(default=None, description="[T], 0 on steps without an SDE")
    rollout_debug_tensors: None = None
    denoising_env: dict[str, Any] | None = None
    dit_trajectory: dict[str, Any] | None = None
    inference_time_s: float | None = None
    peak_memory_mb: float | None = None
