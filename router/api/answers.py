"""What each endpoint answers with 200, as pydantic models: documentation only (``/openapi.json``), the
handlers build their answers themselves. The schema-driven fuzz run (tests/test_fuzz.py) holds every answer
to these shapes, so a field added to an answer belongs here too. Error answers: router/api/http_errors.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class Answer(BaseModel):
    """Answers may gain fields: a client ignores the ones it does not know."""


# --- generations ------------------------------------------------------------------------------------------
class TensorBody(Answer):
    dtype: str = Field(description="a wire dtype name: float32, bfloat16, uint8, ...")
    shape: list[int]
    data: str = Field(description="base64 of the raw little-endian C-order bytes (msgpack answers: the bytes)")


class FileBody(Answer):
    media_type: str = Field(description="video/mp4, image/png or audio/wav")
    data: str = Field(description="the file in base64 (msgpack answers: the bytes)")


class Trajectory(Answer):
    latents: TensorBody = Field(description="[T+1, *latent]: the latents before each step and after the last "
                                "(with trajectory_steps: those entries)")
    timesteps: TensorBody
    sigmas: TensorBody
    steps: TensorBody | None = Field(default=None, description="with trajectory_steps: the entries of 0..T that "
                                     "latents holds")


class Sample(Answer):
    seed: int
    output: TensorBody | FileBody = Field(description="frames [F, H, W, 3] in [0, 1] or latents; a file for "
                                          "output_type mp4 / png / wav")
    audio: TensorBody | None = Field(default=None, description="models with sound, output as a tensor: the "
                                     "waveform [channels, samples] float32")
    sample_rate: int | None = Field(default=None, description="with audio: its samples per second (the vocoder's)")
    route: dict[str, int] = Field(description="the worker index of each stage")
    weight_version: int | None
    scheduler: str | None = Field(default=None, description="the serving or rollout scheduler's class")
    schedule: Literal["rollout", "serving"] | None = Field(
        default=None, description="whose sigmas and timesteps ran: the rollout (flow-match Euler) schedule or the "
        "serving scheduler's")
    batch: int | None = Field(default=None, description="the most requests it shared a denoise forward with")
    transformer_passes: list[int] | int | None = Field(default=None, description="full forwards per CFG branch")
    cached_steps: list[int] | int | None = Field(default=None, description="row-steps that reused an output")
    prefix_transformer_passes: int | None = Field(default=None, description="share_prefix: the forwards of the "
                                                  "group's shared prefix, run once for all its samples")
    lora_name: str | None
    lora_version: int | None
    log_probs: TensorBody | None = Field(default=None, description="rollouts: [K] per SDE step")
    log_prob_steps: TensorBody | None = None
    log_probs_video: TensorBody | None = Field(default=None, description="models with video and audio streams: "
                                               "[K] the video stream's log-probs (log_probs: the joint's)")
    log_probs_audio: TensorBody | None = Field(default=None, description="[K] the audio stream's log-probs")
    sde_window: list[int] | None = Field(default=None, description="rollouts with sde_window_size: the SDE steps "
                                         "[start, stop) picked from the seed")
    kl: TensorBody | None = Field(default=None, description="return_kl: [K] KL against the reference per SDE step")
    ref_log_probs: TensorBody | None = Field(default=None, description="return_kl: [K] log-probs under the reference")
    trajectory: Trajectory | None = None
    step_weight_versions: list[int] | None = Field(default=None, description="rollouts: the weight version each "
                                                   "step taken ran on (one per step, partial answers too)")
    step_lora_versions: list[int] | None = Field(default=None, description="rollouts with an adapter: its "
                                                 "version at each step taken")


class Samples(Answer):
    request_id: str
    samples: list[Sample]
    timings: dict[str, float] = Field(description="encode_s, denoise_s, decode_s (0.0 when skipped), total_s, ...")
    peak_memory: dict[str, int | None] = Field(description="bytes by stage; null for a stage it skipped")
    weight_version: int | None
    attempts: int = Field(description="runs it took: more than 1 when a worker died holding it")
    partial: bool | None = Field(default=None, description="a rollout cancelled with return_partial: true")
    conditioning: dict[str, Any] | None = Field(default=None, description="return_conditioning: cond and uncond "
                                                "(the transformer's text keywords), image, guidance")
    steps_done: int | None = Field(default=None, description="with partial: the denoising steps it took")


class Aborted(Answer):
    aborted: list[str] = Field(description="the ids (X-Request-Id) of the requests cancelled")


class Progress(Answer):
    id: str
    object: Literal["request.progress"]
    stage: Literal["encode", "denoise", "decode"]
    step: int
    steps: int | None
    progress: int = Field(ge=0, le=100)


# --- workers ------------------------------------------------------------------------------------------------
class WorkerRow(Answer):
    role: str
    index: int
    device: str
    devices: list[str]
    ulysses: int
    ring: int
    cfg_parallel: bool
    pid: int | None
    endpoint: str
    node: str
    socket_type: str
    state: str = Field(description="starting, loading, ready, sleeping, lost, ...")
    outstanding: int
    weights: Literal["current", "stale"]
    missing: list[str]
    seconds_since_heartbeat: float | None
    cuda_ipc: dict[str, int]
    shm: dict[str, int]


class Health(Answer):
    ok: bool = Field(description="every worker is ready (or asleep on purpose)")
    model: str
    family: str
    pipeline: str
    workers: list[WorkerRow]


# --- weights and adapters -------------------------------------------------------------------------------
class WeightsUpdated(Answer):
    weight_version: int
    module: str
    sha256: str | None = Field(description="null when the workers disagree or the checksum was skipped")
    seconds: float
    workers: list[dict[str, Any]]


class ReferencePinned(Answer):
    weight_version: int = Field(description="the weights now pinned as kl_reference: pinned")
    experts: list[str]
    seconds: float
    workers: list[dict[str, Any]] = Field(description="each worker's copy: experts, nbytes, pin_s")


class Checksums(Answer):
    module: str
    sha256: str | None
    weight_version: int | None
    consistent: bool
    workers: list[dict[str, Any]]


class LoraLoaded(Answer):
    lora_name: str
    lora_version: int
    seconds: float
    workers: list[dict[str, Any]]


class LoraUnloaded(Answer):
    lora_name: str
    unloaded: bool


class LoraAdapters(Answer):
    adapters: list[dict[str, Any]] = Field(description="each adapter's name, version, rank, scale, modules")


class WeightSyncInfo(Answer):
    enabled: bool
    shm_prefix: str | None
    cuda_ipc: bool
    denoise_workers: int
    weight_version: int
    group: bool


class GroupJoined(Answer):
    world_size: int
    backend: str
    ranks: list[dict[str, int]]


class GroupDestroyed(Answer):
    destroyed: bool


class ComponentState(Answer):
    sleeping: bool
    level: int | None
    weights: str = Field(description="device, host, dropped, pushed or partly pushed")


class SleepState(Answer):
    is_sleeping: bool
    components: dict[str, ComponentState]


class Released(SleepState):
    tags: list[str]
    level: int
    seconds: float
    workers: list[dict[str, Any]]


class Resumed(SleepState):
    tags: list[str]
    resumed: list[str]
    seconds: float
    weight_version: int
    workers: list[dict[str, Any]]


# --- OpenAI-style ------------------------------------------------------------------------------------------
class ModelCard(Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    family: str
    pipeline: str
    defaults: dict[str, Any]
    video: bool
    image_input: str
    max_images: int = Field(description="how many images the image field may hold (a list: edit models that "
                            "take several); 0: none")
    sized_by_image: bool = Field(description="the output's size follows the input image alone (a request's "
                                 "size is refused)")
    fps: int


class Models(Answer):
    object: Literal["list"]
    data: list[ModelCard]


class B64Image(Answer):
    b64_json: str


class Images(Answer):
    created: int
    output_format: str
    size: str
    data: list[B64Image]


class Job(Answer):
    """A video job (``object: video``) or a recorded image (``object: image``: no seconds, no remix)."""

    id: str
    object: Literal["video", "image"]
    model: str
    status: str = Field(description="queued, in_progress, completed or failed")
    progress: int
    created_at: int
    completed_at: int | None
    expires_at: int | None
    size: str
    prompt: str
    error: dict[str, Any] | None
    seconds: str | None = None
    remixed_from_video_id: str | None = None


class Jobs(Answer):
    object: Literal["list"]
    data: list[Job]
    has_more: bool
    first_id: str | None
    last_id: str | None


class JobDeleted(Answer):
    id: str
    object: str
    deleted: bool
