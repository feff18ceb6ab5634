"""Bodies of the OpenAI-style endpoints (``/v1/images/generations``, ``/v1/videos``), and the OpenAI fields'
translation into a :class:`~router.api.schemas.GenerateBody`.

OpenAI's own fields keep their meaning; the engine's own come as extra body fields. A video
job's body arrives as multipart form fields (what the official client sends) or
JSON: its values may be strings ("4"), so that model is lax.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from common.protocol.messages import LORA_NAME_PATTERN
from router.api.schemas import MAX_SEED, CacheBody, FieldError


class EngineFields(BaseModel):
    """What the engine takes beyond OpenAI's fields (extra body fields of the official client); each means
    what the served family's diffusers pipeline means by it."""

    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    true_cfg_scale: float | None = None
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    lora_name: str | None = Field(default=None, pattern=LORA_NAME_PATTERN)
    lora_scale: float = Field(default=1.0, ge=-100.0, le=100.0)
    timeout_s: float | None = Field(default=None, gt=0)
    max_sequence_length: int | None = Field(default=None, ge=1)
    cache: CacheBody | None = Field(default=None, description="step caching, as /generate's (null: off)")


class ImagesBody(EngineFields):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, json_schema_extra={"examples": [
        {"prompt": "a lighthouse at dusk", "size": "832x480", "n": 1, "response_format": "b64_json"}]})

    prompt: str
    model: str | None = None
    n: int = Field(default=1, ge=1)
    size: str | None = Field(default=None, description="WIDTHxHEIGHT, multiples of 16 (default: the model's)")
    response_format: Literal["b64_json"] = Field(default="b64_json", description="PNGs in base64 (no urls)")
    output_format: Literal["png"] = "png"
    user: str | None = None  # OpenAI's end-user tag: accepted, unused


class VideoBody(EngineFields):
    model_config = ConfigDict(extra="forbid", strict=False, allow_inf_nan=False, json_schema_extra={"examples": [
        {"prompt": "a red fox running through snow", "seconds": "1", "size": "832x480"}]})

    prompt: str
    model: str | None = None
    seconds: str | None = Field(default=None, description="length; 16 * seconds + 1 frames (Wan's 16 fps)")
    size: str | None = Field(default=None, description="WIDTHxHEIGHT, multiples of 16 (default: the model's)")
    num_frames: int | None = Field(default=None, description="4k+1 frames; replaces seconds")
    # Image to video: OpenAI's input_reference (a multipart file, or JSON {"image_url": "data:..."}), as the
    # engine's image field (a base64 file or data: URL; router/api/images.py).
    image: str | None = Field(default=None, description="image-to-video models: input_reference's image")


def parse_size(size: str | None, defaults: dict) -> tuple[int, int]:
    """``"WxH"`` -> (width, height); None: the model's default size."""
    if size is None:
        return defaults["width"], defaults["height"]
    parts = size.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise FieldError("size", f"must be WIDTHxHEIGHT, e.g. 832x480, got {size!r}")
    width, height = int(parts[0]), int(parts[1])
    for name, v in (("width", width), ("height", height)):
        if v < 16 or v % 16:
            raise FieldError("size", f"{name} must be a positive multiple of 16, got {v}")
    return width, height


def frames_for(seconds: str | None, num_frames: int | None, fps: int, default_frames: int) -> int:
    """A video's frame count: ``num_frames``, else ``fps * seconds + 1``, else the model's default."""
    if num_frames is not None:
        return num_frames
    if seconds is None:
        return default_frames
    try:
        value = float(seconds)
    except ValueError:
        raise FieldError("seconds", f"must be a number of seconds, got {seconds!r}") from None
    frames = fps * value + 1
    if not math.isfinite(value) or value <= 0 or abs(frames - round(frames)) > 1e-6 or (round(frames) - 1) % 4:
        raise FieldError("seconds", f"must be a positive multiple of {4 / fps:g} s ({fps} fps, 4k+1 frames), "
                         f"got {seconds!r}")
    return int(round(frames))


def seconds_of(frames: int, fps: int) -> str:
    """The length a job reports: ``(frames - 1) / fps`` seconds, as OpenAI's string."""
    value = (frames - 1) / fps
    return f"{value:g}"
