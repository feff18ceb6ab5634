"""The native request bodies and their validation: what ``/generate``, ``/rollout/generate`` and the control
endpoints take, and what the core's operations take (the HTTP fronts parse into them, the core reads them).

Pydantic checks types (strictly: no ``"32"`` for an int, no NaN/inf); the
limits that depend on the engine's flags and on the model are checked in
:func:`router.core.request_params.to_params`. Every failure names the offending field.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from common.protocol.messages import (
    EDIT_IMAGES, EXPERT_NAMES, LORA_NAME_PATTERN, CacheMethod, ExpertName, KlReference, OdeSolver, RolloutSchedule, SdeType,
)
from router.core.errors import FieldError

MAX_SEED = 2**63 - 1
# What HTTP callers may ask for: the wire's output types, or frames encoded as a file by the router (wav: the
# sound alone, from a model that makes sound).
HttpOutputType = Literal["frames", "latent", "mp4", "png", "wav"]
MEDIA_OUTPUTS = ("mp4", "png", "wav")
MAX_IMAGES = len(EDIT_IMAGES)  # the most images a request's image list may hold (the wire's image, image.2, ...)
# ``image`` as a list: an edit model's several images (one_image_or_a_list checks the shape first).
ImageList = Annotated[list[str], Field(min_length=1, max_length=MAX_IMAGES)]




class CacheBody(BaseModel):
    """A request's step caching (docs/api.md#step-caching)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    method: CacheMethod
    threshold: float | None = Field(default=None, description="left out: the method's default")


class GenerateBody(BaseModel):
    """The fields every family takes; the served family's own (its binding's ``request_fields``) come as extra
    fields, checked with the rest by common/diffusion/params.py (an unknown one: 400 naming it)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False,
                              json_schema_extra={"examples": [{"prompt": "a red fox running through snow", "seed": 0}]})

    prompt: str
    negative_prompt: str | None = Field(default=None, description="left out: the empty prompt (a family whose "
                                        "classifier-free guidance needs one runs it only with one, as its pipeline)")
    # Sizes, steps and guidance left out take the model's serving defaults.
    height: int | None = None
    width: int | None = None
    num_frames: int | None = Field(default=None, description="video families: 4k+1 frames (LTX-2: 8k+1; image families: 1)")
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=100.0)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    n: int = Field(default=1, ge=1, description="samples, with seeds seed, seed+1, ...")
    seeds: list[Annotated[int, Field(ge=0, le=MAX_SEED)]] | None = Field(
        default=None, min_length=1, description="each sample's own seed (n: their number; seed: the first)")
    sigmas: list[Annotated[float, Field(ge=0.0, le=1.0)]] | None = Field(
        default=None, min_length=1, description="custom schedule in [0, 1]; replace num_inference_steps")
    sigmas_as_given: bool = Field(default=False, description="sigmas are the schedule itself, already shifted (as "
                                  "a trainer's or SGLang's schedule holds them): never shifted again; a flow-match "
                                  "Euler schedule (a rollout's) takes them")
    timesteps: list[Annotated[float, Field(ge=0.0)]] | None = Field(
        default=None, min_length=1, description="timesteps in [0, num_train_timesteps]; replace num_inference_steps")
    mu: float | None = Field(default=None, ge=-100.0, le=100.0)
    max_sequence_length: int | None = Field(default=None, ge=1, description="the text encoder's token budget "
                                            "(as the family's diffusers pipeline: Wan 512, SD3 256)")
    output_type: HttpOutputType = Field(default="frames", description="frames or latent tensors, or frames as an "
                                        "mp4 (H.264, with an audio track from a model with sound) or png (one "
                                        "frame) file, or the sound alone as a wav (models with sound); Accept: "
                                        "video/mp4, image/png or audio/wav too")
    stream: bool = Field(default=False, description="answer each sample as soon as it is decoded, one per line "
                         "(JSON lines; msgpack maps back to back with Accept: application/msgpack), then a last "
                         "line with the request's timings (docs/api.md#streaming)")
    output_dtype: Literal["float32", "uint8"] = Field(default="float32", description="frames as float32 in [0, 1], "
                                                      "or uint8 in [0, 255] (round(x * 255), as diffusers' PIL "
                                                      "output): a quarter of the bytes")
    timeout_s: float | None = Field(default=None, gt=0, description="at most the engine's --request-timeout")
    lora_name: str | None = Field(default=None, pattern=LORA_NAME_PATTERN,
                                  description="a loaded LoRA adapter (GET /v1/lora_adapters); default: none")
    lora_scale: float = Field(default=1.0, ge=-100.0, le=100.0, description="the adapter's strength")
    cache: CacheBody | None = Field(default=None, description="step caching: reuse a transformer output between "
                                    "close steps (never on a rollout's SDE steps); left out: the engine's --cache, "
                                    "null: off")
    image: str | ImageList | None = Field(
        default=None, description="image-to-video models: the first frame; edit models: the image to edit, or a "
        f"list of up to {MAX_IMAGES} (GET /v1/models: max_images); each a base64 PNG, JPEG or WEBP or a data: URL "
        "(the engine fetches no URL)")
    last_image: str | None = Field(default=None, description="first-last-frame models: the last frame, as image")

    @field_validator("image", mode="before")
    @classmethod
    def _one_or_a_list(cls, value):
        return one_image_or_a_list(value)


def one_image_or_a_list(value):
    """``image``'s shape, checked before the union's, so that a mistake reads "image: ..." rather than one line
    per branch of the union."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_IMAGES:
        raise ValueError(f"must be an image (a base64 string or data: URL) or a list of 1..{MAX_IMAGES} of them")
    bad = next((i for i, v in enumerate(value) if not isinstance(v, str)), None)
    if bad is not None:
        raise ValueError(f"item {bad} must be a string (a base64 image or data: URL)")
    return value


class RolloutBody(GenerateBody):
    """``/rollout/generate``: everything ``/generate`` takes plus the rollout settings."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "a red fox running through snow", "seed": 0, "sde_type": "sde", "noise_level": 0.7}]})

    rollout: bool = True
    sde_type: SdeType = "sde"
    noise_level: float = Field(default=0.7, ge=0.0, le=10.0)
    sde_step_indices: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, description="0-based steps that use the SDE (default: every step)")
    sde_window_size: int | None = Field(default=None, ge=1, description="SDE on a window of this many "
                                        "consecutive steps, its start picked from the seed (not with "
                                        "sde_step_indices)")
    sde_window_range: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, min_length=2, max_length=2, description="[lo, hi]: the window lies within steps lo..hi-1 "
        "(default [0, steps])")
    ode_solver: OdeSolver = Field(default="euler", description="the steps after the last SDE step: euler, or "
                                  "serving (the model's own scheduler on the remaining sigmas)")
    return_trajectory: bool = False
    trajectory_steps: Literal["sde"] | list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, description="with return_trajectory: the entries of 0..T to return (the latents before each "
        "step; T: after the last; []: the timesteps and sigmas alone), or \"sde\": each SDE step's x_i and x_{i+1} "
        "(what a trainer's recompute reads); default: all")
    return_conditioning: bool = Field(default=False, description="the conditioning the transformer took, as its "
                                      "keywords name it (text, image, embedded guidance): what a trainer's "
                                      "recompute feeds it, so it may skip its text encoder")
    return_log_probs: bool = True
    schedule: RolloutSchedule = Field(default="rollout", description="whose sigmas and timesteps the SDE steps "
                                      "follow: rollout (flow-match Euler with the serving shift) or serving (the "
                                      "model's own scheduler's: Wan's UniPC, SANA's DPM-Solver, ...)")
    return_kl: bool = Field(default=False, description="per SDE step: kl and ref_log_probs against kl_reference")
    kl_reference: KlReference = Field(default="base", description="base: the same model with the request's "
                                      "adapter off (without an adapter: kl 0, ref_log_probs = log_probs); "
                                      "pinned: the weights POST /pin_reference copied, no adapter")
    initial_noise_seed: int | None = Field(default=None, ge=0, le=MAX_SEED, description="every sample's initial "
                                           "noise from this seed (the same for all); seed + i draws the SDE noise")
    share_prefix: bool = Field(default=False, description="a group shares the initial noise of seed (unless "
                               "initial_noise_seed) and the steps before its first SDE step, computed once")
    sde_streams: list[str] | None = Field(
        default=None, min_length=1, description="models with several latent streams (LTX-2: video, audio): the "
        "streams the SDE steps take; the others follow their ODE (default: all)")
    return_partial: bool = Field(default=False, description="cancelled by POST /abort_request: answer 200 with "
                                 "the steps done (partial, steps_done) instead of 499")
    output_type: HttpOutputType = "latent"
    initial_latents: TensorBlobBody | None = Field(
        default=None, description="resume: start from these latents [n or 1, *latent] (a partial answer's last "
        "trajectory latent) instead of the seed's noise; give the remaining sigmas with them")


class LoadLoraBody(BaseModel):
    """``/v1/load_lora_adapter`` from a path (JSON). From the trainer's memory the body is msgpack:
    :class:`LoadLoraTensorsBody`."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [
        {"lora_name": "style-a", "lora_path": "/srv/weights/loras/style-a"}]})

    lora_name: str = Field(pattern=LORA_NAME_PATTERN)
    lora_path: str = Field(min_length=1, max_length=4096,
                           description="a diffusers LoRA file or folder, or a peft adapter folder, below --weight-root")
    load_into_transformer_2: bool = Field(default=False,
                                          description="two-expert models: the file's transformer keys go to the second")


class LoraTensorBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=512)
    shape: list[Annotated[int, Field(ge=1, le=1 << 32)]] = Field(min_length=1, max_length=2)


class TensorBlobBody(BaseModel):
    """Tensors in a body: ``{dtype, shape, data}``, ``data`` the raw little-endian C-order bytes (base64 in
    JSON)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    dtype: str = Field(min_length=1, max_length=16, description="a wire dtype name, e.g. float32")
    shape: list[Annotated[int, Field(ge=0, le=1 << 40)]] = Field(max_length=8)
    data: Annotated[Any, WithJsonSchema({"type": "string", "description": "base64 (JSON); the bytes (msgpack)"})]

    @field_validator("data")
    @classmethod
    def _text_or_bytes(cls, value):
        if not isinstance(value, (str, bytes)):
            raise ValueError("must be base64 text (JSON) or the raw bytes (msgpack)")
        return value


RolloutBody.model_rebuild()  # its initial_latents is a TensorBlobBody, defined after it


class LoadLoraTensorsBody(BaseModel):
    """An adapter from memory: every tensor inside one flat ``blob``, in the order ``tensors`` lists them."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(pattern=LORA_NAME_PATTERN)
    tensors: list[LoraTensorBody] = Field(min_length=1, max_length=100_000)
    blob: TensorBlobBody = Field(description="every tensor's values, flat, in one floating-point tensor")
    rank: int = Field(ge=1, le=1 << 16)
    alpha: float | None = None
    module: ExpertName = "transformer"


class UnloadLoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [{"lora_name": "style-a"}]})

    lora_name: str = Field(pattern=LORA_NAME_PATTERN)


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [
        {"path": "/srv/weights/step-100", "module": "transformer"}]})

    path: str = Field(min_length=1, max_length=4096, description="a checkpoint below one of the --weight-root dirs")
    module: ExpertName = "transformer"
    checksum: bool = Field(default=True, description="answer with each worker's sha256 of its new weights "
                                                     "(a pass over them; false skips it)")


TAGS_DESCRIPTION = "transformer (every expert), text_encoder (with the image encoder), vae; weights: all of them; " \
                   "left out: all"


class ReleaseMemoryBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [
        {"tags": ["transformer"], "level": 2}]})

    tags: list[str] | None = Field(default=None, max_length=8, description=TAGS_DESCRIPTION)
    level: Literal[1, 2] = Field(default=2, description="1: the weights to host memory (back bit for bit); "
                                 "2: dropped (back by a push, or reload: disk)")
    mode: Literal["wait", "abort"] = Field(default="wait", description="wait: the work in flight on those workers "
                                           "finishes first; abort: it is answered 503 at once")


class ResumeMemoryBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [{"tags": ["transformer"]}]})

    tags: list[str] | None = Field(default=None, max_length=8, description=TAGS_DESCRIPTION)
    reload: Literal["disk"] | None = Field(default=None, description="disk: weights dropped and not pushed since "
                                           "come from the --model directory (the start-up weights)")


class WeightTensorBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=512)
    dtype: str = Field(min_length=1, max_length=16, description="a wire dtype name, e.g. bfloat16")
    shape: list[Annotated[int, Field(ge=0, le=1 << 40)]] = Field(max_length=8)
    bucket: int = Field(ge=0, lt=100_000)
    offset: int = Field(ge=0, le=1 << 48)


class CudaIpcHandleBody(BaseModel):
    """A CUDA IPC handle of the trainer's GPU buffer (``torch.UntypedStorage._share_cuda_``; bytes in base64)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    device: int = Field(ge=0, le=255)
    handle: str = Field(min_length=1, max_length=2048)
    storage_bytes: int = Field(ge=1, le=1 << 48)
    offset_bytes: int = Field(ge=0, le=1 << 48)
    ref_counter: str = Field(pattern=r"^/torch_[0-9_]+$", max_length=128)
    ref_counter_offset: int = Field(ge=0, lt=10000)
    event: str | None = Field(default=None, max_length=2048)
    event_sync: bool = False


class WeightBucketBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    nbytes: int = Field(ge=0, le=1 << 48)
    segment: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,255}$",
                                description="the shared-memory segment holding the bucket (same host)")
    cuda: CudaIpcHandleBody | None = Field(default=None, description="or the trainer's GPU buffer holding it "
                                           "(same host, denoise workers on GPUs)")


class LoraFromMemoryBody(BaseModel):
    """The tensors of a weight update from memory are a LoRA adapter's (peft names), loaded as ``lora_name``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(pattern=LORA_NAME_PATTERN)
    rank: int = Field(ge=1, le=1 << 16)
    alpha: float | None = Field(default=None, description="peft's lora_alpha; none: alpha = rank (scale 1)")


class UpdateWeightsFromTensorsBody(BaseModel):
    """The trainer's tensors in shared-memory buckets (``EngineClient.update_weights_from_tensors`` writes them)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [{
        "module": "transformer",
        "tensors": [{"name": "proj_out.weight", "dtype": "bfloat16", "shape": [64, 1536], "bucket": 0, "offset": 0}],
        "buckets": [{"nbytes": 196608, "segment": "disagg-1a2b3c4d-weights-" + "0" * 32}]}]})

    module: ExpertName = "transformer"
    checksum: bool = Field(default=True, description="as for /update_weights_from_disk")
    tensors: list[WeightTensorBody] = Field(min_length=1, max_length=100_000)
    buckets: list[WeightBucketBody] = Field(min_length=1, max_length=100_000)
    lora: LoraFromMemoryBody | None = Field(default=None, description="the tensors are this adapter of module's, "
                                            "not its weights: a new lora_version, the weight_version unchanged")


class UpdateWeightsFromDistributedBody(UpdateWeightsFromTensorsBody):
    """An update the trainer broadcasts over the weights group: the same description, buckets without segments."""


class InitWeightsGroupBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [
        {"master_address": "10.0.0.5", "master_port": 29600, "backend": "gloo"}]})

    master_address: str = Field(min_length=1, max_length=255, description="the trainer's host (rank 0, the store)")
    master_port: int = Field(ge=1, le=65535)
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = Field(default=600.0, gt=0, le=86400, description="for joining and for each broadcast")


def checked_weight_path(field: str, path: str, roots: list[str]) -> str:
    """A weight path the workers may read: no NUL byte, absolute, and below a weight root once normalised.
    Lexical only (the router may not share the workers' file system); each worker resolves symlinks and
    checks again on its own machine."""
    if "\x00" in path:
        raise FieldError(field, "must not contain a NUL byte")
    if not os.path.isabs(path):
        raise FieldError(field, f"must be an absolute path, got {path!r}")
    norm = os.path.normpath(path)
    if not any(norm == r or norm.startswith(r.rstrip("/") + "/") for r in map(os.path.normpath, roots)):
        raise FieldError(field, f"{path} is outside the allowed weight directories: {', '.join(roots)}")
    return path


def checked_module(module: str, has_transformer_2: bool) -> str:
    """The expert a weight request names, if this model has it."""
    if module == "transformer_2" and not has_transformer_2:
        raise FieldError("module", "this model has no transformer_2")
    if module not in EXPERT_NAMES:
        names = " or ".join(f"'{m}'" for m in EXPERT_NAMES)
        raise FieldError("module", f"must be {names}")
    return module
