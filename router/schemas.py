"""HTTP request bodies and their validation.

Pydantic checks types (strictly: no ``"32"`` for an int, no NaN/inf); the
limits that depend on the engine's flags and on the model are checked in
:func:`to_params`. Every failure names the offending field.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from common.config.engine import Limits
from common.protocol.messages import GenerationParams, RolloutParams

MAX_SEED = 2**63 - 1


class FieldError(ValueError):
    """A request field is invalid; ``field`` names it in the HTTP error."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: str
    negative_prompt: str = ""
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    n: int = Field(default=1, ge=1)
    sigmas: list[float] | None = None
    timesteps: list[float] | None = None
    mu: float | None = None
    output_type: Literal["frames", "latent"] = "frames"
    timeout_s: float | None = Field(default=None, gt=0)


class RolloutBody(GenerateBody):
    """``/rollout/generate``: everything ``/generate`` takes plus the rollout settings."""

    rollout: bool = True
    sde_type: Literal["sde", "cps", "ode"] = "sde"
    noise_level: float = Field(default=0.7, ge=0.0, le=10.0)
    sde_step_indices: list[int] | None = None
    return_trajectory: bool = False
    return_log_probs: bool = True
    output_type: Literal["frames", "latent"] = "latent"


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    path: str = Field(min_length=1, max_length=4096)
    module: Literal["transformer", "transformer_2"] = "transformer"


def _check_size(name: str, value: int, multiple: int, maximum: int) -> None:
    if value < multiple or value % multiple:
        raise FieldError(name, f"must be a positive multiple of {multiple}, got {value}")
    if value > maximum:
        raise FieldError(name, f"must be at most {maximum}, got {value}")


def _check_schedule(name: str, values: list[float], lo: float, hi: float, max_len: int) -> None:
    if not 1 <= len(values) <= max_len:
        raise FieldError(name, f"must hold 1..{max_len} values, got {len(values)}")
    if any(not math.isfinite(v) or v < lo or v > hi for v in values):
        raise FieldError(name, f"values must be finite and within [{lo}, {hi}]")


def to_params(body: GenerateBody, defaults: dict, limits: Limits, n_train: int = 1000) -> GenerationParams:
    """Fill model defaults and enforce the engine's limits."""
    h = body.height if body.height is not None else defaults["height"]
    w = body.width if body.width is not None else defaults["width"]
    f = body.num_frames if body.num_frames is not None else defaults["num_frames"]
    steps = body.num_inference_steps if body.num_inference_steps is not None else defaults["num_inference_steps"]
    g = body.guidance_scale if body.guidance_scale is not None else defaults["guidance_scale"]
    if len(body.prompt) > limits.max_prompt_chars:
        raise FieldError("prompt", f"longer than {limits.max_prompt_chars} characters")
    if len(body.negative_prompt) > limits.max_prompt_chars:
        raise FieldError("negative_prompt", f"longer than {limits.max_prompt_chars} characters")
    _check_size("height", h, 16, limits.max_height)
    _check_size("width", w, 16, limits.max_width)
    if f < 1 or (f - 1) % 4:
        raise FieldError("num_frames", f"must be of the form 4k+1, got {f}")
    if f > limits.max_num_frames:
        raise FieldError("num_frames", f"must be at most {limits.max_num_frames}, got {f}")
    if not 1 <= steps <= limits.max_steps:
        raise FieldError("num_inference_steps", f"must be within 1..{limits.max_steps}, got {steps}")
    for name, val in (("guidance_scale", g), ("guidance_scale_2", body.guidance_scale_2)):
        if val is not None and not 0.0 <= val <= 100.0:
            raise FieldError(name, f"must be within [0, 100], got {val}")
    if body.n > limits.max_n:
        raise FieldError("n", f"must be within 1..{limits.max_n}, got {body.n}")
    if body.seed + body.n - 1 > MAX_SEED:
        raise FieldError("seed", "seed + n - 1 must fit in a signed 64-bit integer")
    if body.sigmas is not None:
        _check_schedule("sigmas", body.sigmas, 0.0, 1.0, limits.max_steps)
        steps = len(body.sigmas)
    elif body.timesteps is not None:
        _check_schedule("timesteps", body.timesteps, 0.0, float(n_train), limits.max_steps)
        steps = len(body.timesteps)
    if body.timeout_s is not None and body.timeout_s > limits.request_timeout_s:
        raise FieldError("timeout_s", f"must be at most the engine's --request-timeout {limits.request_timeout_s}")
    if body.mu is not None and abs(body.mu) > 100:
        raise FieldError("mu", f"must be within [-100, 100], got {body.mu}")
    rollout = None
    if isinstance(body, RolloutBody):
        idx = body.sde_step_indices
        if idx is not None:
            if len(idx) > steps or len(set(idx)) != len(idx):
                raise FieldError("sde_step_indices", "must be distinct step indices")
            if any(i < 0 or i >= steps for i in idx):
                raise FieldError("sde_step_indices", f"indices must be within 0..{steps - 1}")
        rollout = RolloutParams(
            sde_scheduler=body.rollout,
            sde_type=body.sde_type,
            noise_level=body.noise_level,
            sde_step_indices=sorted(idx) if idx is not None else None,
            return_trajectory=body.return_trajectory,
            return_log_probs=body.return_log_probs,
        )
    return GenerationParams(
        rollout=rollout,
        prompt=body.prompt,
        negative_prompt=body.negative_prompt,
        height=h,
        width=w,
        num_frames=f,
        num_inference_steps=steps,
        guidance_scale=float(g),
        guidance_scale_2=body.guidance_scale_2,
        seed=body.seed,
        output_type=body.output_type,
        sigmas=body.sigmas,
        timesteps=body.timesteps,
        mu=body.mu,
    )
