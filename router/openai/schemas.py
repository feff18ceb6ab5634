"""Bodies of the OpenAI-style endpoints (``/v1/images/generations``, ``/v1/images/edits``, ``/v1/videos``),
and the OpenAI fields' translation into a :class:`~router.request.schemas.GenerateBody`.

OpenAI's own fields keep their meaning; the engine's own come as extra body fields. An edit's and a video
job's body arrive as multipart form fields (what the official client sends) or
JSON: their values may be strings ("4"), so those models are lax.
"""

from __future__ import annotations

import json
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.protocol.messages import LORA_NAME_PATTERN
from common.diffusion.params import COMMON
from router.core.errors import FieldError
from router.request.schemas import MAX_SEED, CacheBody, GenerateBody, ImageList, one_image_or_a_list


class EngineFields(BaseModel):
    """What the engine takes beyond OpenAI's fields (extra body fields of the official client); each means
    what the served family's diffusers pipeline means by it. The family's own fields come as extra fields,
    checked as /generate's (:func:`family_fields`)."""

    model_config = ConfigDict(extra="allow")

    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    lora_name: str | None = Field(default=None, pattern=LORA_NAME_PATTERN)
    lora_scale: float = Field(default=1.0, ge=-100.0, le=100.0)
    timeout_s: float | None = Field(default=None, gt=0)
    max_sequence_length: int | None = Field(default=None, ge=1)
    cache: CacheBody | None = Field(default=None, description="step caching, as /generate's (null: off)")


class ImagesBody(EngineFields):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, json_schema_extra={"examples": [
        {"prompt": "a lighthouse at dusk", "size": "832x480", "n": 1, "response_format": "b64_json"}]})

    prompt: str
    model: str | None = None
    n: int = Field(default=1, ge=1)
    size: str | None = Field(default=None, description="WIDTHxHEIGHT, multiples of the model's VAE scale times "
                             "its patches (16 on an 8x VAE; default: the model's)")
    response_format: Literal["b64_json"] = Field(default="b64_json", description="PNGs in base64 (no urls)")
    output_format: Literal["png"] = "png"
    user: str | None = None  # OpenAI's end-user tag: accepted, unused


class EditsBody(EngineFields):
    """``/v1/images/edits``: OpenAI's fields and the engine's, from multipart form text (lax: ``"4"`` is 4) or
    JSON; the image files become ``image`` (one, or a list on a model that takes several)."""

    model_config = ConfigDict(extra="allow", strict=False, allow_inf_nan=False, json_schema_extra={"examples": [
        {"prompt": "make it night", "image": "data:image/png;base64,...", "size": "auto", "n": 1}]})

    prompt: str
    image: str | ImageList = Field(
        description="the image(s) to edit: multipart files image or image[]; in JSON base64 or data: URLs")
    model: str | None = None
    n: int = Field(default=1, ge=1)
    size: str | None = Field(default=None, description="WIDTHxHEIGHT, or auto (left out too): the model's size "
                             "for the image(s)")
    response_format: Literal["b64_json"] = Field(default="b64_json", description="PNGs in base64 (no urls)")
    output_format: Literal["png"] = "png"
    user: str | None = None  # OpenAI's end-user tag: accepted, unused

    @field_validator("image", mode="before")
    @classmethod
    def _one_or_a_list(cls, value):
        return one_image_or_a_list(value)


class VideoBody(EngineFields):
    model_config = ConfigDict(extra="allow", strict=False, allow_inf_nan=False, json_schema_extra={"examples": [
        {"prompt": "a red fox running through snow", "seconds": "1", "size": "832x480"}]})

    prompt: str
    model: str | None = None
    seconds: str | None = Field(default=None, description="length; 16 * seconds + 1 frames (Wan's 16 fps)")
    size: str | None = Field(default=None, description="WIDTHxHEIGHT, multiples of the model's VAE scale times "
                             "its patches (16 on an 8x VAE; default: the model's)")
    num_frames: int | None = Field(default=None, description="4k+1 frames; replaces seconds")
    # Image to video: OpenAI's input_reference (a multipart file, or JSON {"image_url": "data:..."}), as the
    # engine's image field (a base64 file or data: URL; router/request/images.py).
    image: str | None = Field(default=None, description="image-to-video models: input_reference's image")


def family_fields(body: EngineFields) -> dict:
    """The body's extra fields (the served family's own, checked by the conversion). A video job's may come as
    form text (lax, as its model): a value that reads as a JSON number or boolean is taken as one."""
    extra = dict(body.model_extra or {})
    for name in extra:  # a native field that OpenAI's bodies say otherwise (size, n, ...) or do not take
        if name in GenerateBody.model_fields or name in COMMON:
            raise FieldError(name, f"is not a field of this endpoint's body ({type(body).__name__})")
    if body.model_config.get("strict") is False:
        for name, value in extra.items():
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except ValueError:
                    continue
                extra[name] = parsed if isinstance(parsed, (bool, int, float)) else value
    return extra


def parse_size(size: str | None, defaults: dict) -> tuple[int, int]:
    """``"WxH"`` -> (width, height); None: the model's default size."""
    if size is None:
        return defaults["width"], defaults["height"]
    parts = size.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise FieldError("size", f"must be WIDTHxHEIGHT, e.g. 832x480, got {size!r}")
    width, height = int(parts[0]), int(parts[1])
    return width, height  # their multiples and bounds: the model's rule (common/diffusion/params.py)


def frames_for(seconds: str | None, num_frames: int | None, fps: int, default_frames: int, stride: int = 4) -> int:
    """A video's frame count: ``num_frames``, else ``fps * seconds + 1``, else the model's default (``stride``:
    the VAE's frames per latent frame; counts are ``stride * k + 1``)."""
    if num_frames is not None:
        return num_frames
    if seconds is None:
        return default_frames
    try:
        value = float(seconds)
    except ValueError:
        raise FieldError("seconds", f"must be a number of seconds, got {seconds!r}") from None
    frames = fps * value + 1
    if not math.isfinite(value) or value <= 0 or abs(frames - round(frames)) > 1e-6 or (round(frames) - 1) % stride:
        raise FieldError("seconds", f"must be a positive multiple of {stride / fps:g} s ({fps} fps, "
                         f"{stride}k+1 frames), "
                         f"got {seconds!r}")
    return int(round(frames))


def seconds_of(frames: int, fps: int) -> str:
    """The length a job reports: ``(frames - 1) / fps`` seconds, as OpenAI's string."""
    value = (frames - 1) / fps
    return f"{value:g}"
