"""Typed messages exchanged between the router and the workers.

Every message is a msgspec Struct tagged by ``kind``; the wire codec
(:mod:`common.protocol.codec`) encodes the struct as frame 0 and the tensors it names
as the following raw frames. Decoding is strict: wrong types, unknown fields
and unknown kinds are rejected before any worker code sees the message.

Schedulers never appear here: a request carries only the numbers a denoise
worker needs to rebuild its own request-local scheduler.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union, get_args

import msgspec

# FLOAT_DTYPES, INT_DTYPES and TensorField are also imported from here.
from common.protocol.tensor_field import FLOAT_DTYPES, INT_DTYPES, TensorField, prompt_tensor  # noqa: F401

PROTOCOL_VERSION = 2  # 2: a request carries its n samples as one unit (leading sample axis)

ROLES = ("encoder", "denoise", "decode")
# Value sets, each spelled once here; the tuples are for membership checks and messages.
OutputType = Literal["frames", "latent"]
SdeType = Literal["sde", "cps", "ode", "flow_grpo_wan", "dance_grpo"]
OdeSolver = Literal["euler", "serving"]  # the steps after a rollout's last SDE step (DenoiseTask)
# The reference of return_kl: the same model with the request's adapter off, or the weights POST /pin_reference copied
KlReference = Literal["base", "pinned"]
ExpertName = Literal["transformer", "transformer_2"]  # also the modules a weight update names
RolloutSchedule = Literal["rollout", "serving"]  # a rollout's sigmas: flow-match Euler's, or the serving scheduler's
CacheMethod = Literal["teacache", "first_block"]  # step caching (common/diffusion/step_cache.py)
Info = Union[str, int, float, list[int]]  # a result's facts: per request, or one int per sample
OUTPUT_TYPES: tuple[str, ...] = get_args(OutputType)
SDE_TYPES: tuple[str, ...] = get_args(SdeType)
ROLLOUT_SCHEDULES: tuple[str, ...] = get_args(RolloutSchedule)
EXPERT_NAMES: tuple[str, ...] = get_args(ExpertName)
# What a colocated trainer may release and resume, and the role whose workers hold each (the encoder's image
# side, image-to-video, goes with the text encoder).
MemoryTag = Literal["transformer", "text_encoder", "vae"]
MEMORY_TAGS: tuple[str, ...] = get_args(MemoryTag)
TAG_ROLES = {"transformer": "denoise", "text_encoder": "encoder", "vae": "decode"}

# A request's n samples travel together: per-sample tensors have a leading sample axis [n, ...].
# The prompt tensors every family sends; a family's others (e.g. pooled projections, a second text encoder's
# sequence, its image side's tensors) are its binding's declaration (common/protocol/contracts.py).
PROMPT_EMBEDS = prompt_tensor("prompt_embeds", FLOAT_DTYPES, 2, required=True)  # [L, D], trimmed to the real tokens
NEGATIVE_PROMPT_EMBEDS = PROMPT_EMBEDS.negative  # with guidance
# The mask over the L tokens [L] (1: attended), for a family whose transformer takes one.
PROMPT_MASK = prompt_tensor("prompt_mask", INT_DTYPES, 1)
NEGATIVE_PROMPT_MASK = PROMPT_MASK.negative
# The request's images as RGB pixels [H, W, 3] (router -> encoder worker): ``image`` (a list of them: ``image``,
# ``image.2``, ``image.3``, e.g. an edit's references) and ``last_image``. What a family's image side makes of
# them travels as its binding declares (Binding.condition.fields).
IMAGE = TensorField("image", frozenset({"uint8"}), 3, required=False)
LAST_IMAGE = TensorField("last_image", frozenset({"uint8"}), 3, required=False)
IMAGE_2 = TensorField("image.2", frozenset({"uint8"}), 3, required=False)
IMAGE_3 = TensorField("image.3", frozenset({"uint8"}), 3, required=False)
EDIT_IMAGES = (IMAGE, IMAGE_2, IMAGE_3)  # a request's images, in order
REQUEST_IMAGES = (IMAGE, LAST_IMAGE, IMAGE_2, IMAGE_3)
# Latents as the transformer sees them: [n, C, F', H', W'] (video families), [n, C, H', W'] (image families) or
# packed tokens [n, seq, C * 4] (FLUX, Qwen-Image).
LATENTS = TensorField("latents", FLOAT_DTYPES, (5, 4, 3))
# A resumed rollout's starting latents, [n or 1, *latent] in LATENTS' layout, used instead of the drawn noise
# (router -> encoder -> denoise worker; common/diffusion/resume.py checks them).
INITIAL_LATENTS = TensorField("initial_latents", FLOAT_DTYPES, (5, 4, 3), required=False)
OUTPUT = TensorField("output", FLOAT_DTYPES, (5, 4, 3))  # frames [n, F, H, W, 3] in [0, 1], or latents as LATENTS
# Models with a sound stream: the waveform [n, channels, samples] at the Result's info["audio_sample_rate"].
AUDIO = TensorField("audio", FLOAT_DTYPES, 3, required=False)
LOG_PROBS = TensorField("log_probs", FLOAT_DTYPES, 2, required=False)  # [n, K], one per SDE step
# Models with several latent streams: each SDE stream's own log-probs [n, K] (LOG_PROBS is the joint Gaussian's).
STREAM_LOG_PROBS = {s: TensorField(f"log_probs_{s}", FLOAT_DTYPES, 2, required=False) for s in ("video", "audio")}
LOG_PROB_STEPS = TensorField("log_prob_steps", INT_DTYPES, 1, required=False)  # [K] step indices, shared
KL = TensorField("kl", FLOAT_DTYPES, 2, required=False)  # [n, K]: KL against the reference, per SDE step
REF_LOG_PROBS = TensorField("ref_log_probs", FLOAT_DTYPES, 2, required=False)  # [n, K]: x_next under the reference
TRAJECTORY_LATENTS = TensorField("trajectory.latents", FLOAT_DTYPES, (6, 5, 4), required=False)  # [n, T+1, *latent]
TRAJECTORY_TIMESTEPS = TensorField("trajectory.timesteps", FLOAT_DTYPES, 1, required=False)  # [T], shared
TRAJECTORY_SIGMAS = TensorField("trajectory.sigmas", FLOAT_DTYPES, 1, required=False)  # [T+1], shared
# With trajectory_steps: which entries of 0..T the trajectory's latents hold [K'] (shared).
TRAJECTORY_STEPS = TensorField("trajectory.steps", INT_DTYPES, 1, required=False)
# With return_conditioning: what the transformer was conditioned on, as its keywords name it (shared, [1, ...]):
# "conditioning.cond.<keyword>", "conditioning.uncond.<keyword>", "conditioning.image.<name>",
# "conditioning.guidance" (common/diffusion/conditioning.py).
CONDITIONING = TensorField("conditioning.", FLOAT_DTYPES | INT_DTYPES | {"bool"}, (1, 2, 3, 4, 5, 6),
                           required=False, prefix=True)
LORA_BLOB = TensorField("lora.blob", FLOAT_DTYPES, 1, required=False)  # an adapter's tensors, flat, in order
# What a rollout adds; it rides from the denoise worker through the decode worker unchanged.
ROLLOUT_OUTPUTS = (LOG_PROBS, *STREAM_LOG_PROBS.values(), LOG_PROB_STEPS, TRAJECTORY_LATENTS, TRAJECTORY_TIMESTEPS, TRAJECTORY_SIGMAS,
                   TRAJECTORY_STEPS, KL, REF_LOG_PROBS, CONDITIONING)
# The tensors of a result with one row per sample (the rest are shared by the request's samples).
PER_SAMPLE = (OUTPUT, AUDIO, LOG_PROBS, *STREAM_LOG_PROBS.values(), TRAJECTORY_LATENTS, KL, REF_LOG_PROBS)


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


# A shared-memory segment's name (see common/transport/shm.py): a file name in /dev/shm, never a path.
ShmName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$", max_length=255)]


# torch's name for the shared-memory file holding CUDA IPC reference counters: "/torch_<digits and _>".
RefCounterName = Annotated[str, msgspec.Meta(pattern=r"^/torch_[0-9_]+$", max_length=128)]


class CudaIpcHandle(_Strict, frozen=True):
    """A CUDA allocation of the sending process, opened by the receiver with CUDA IPC
    (same node, both ends GPU workers; see common/transport/cuda_ipc.py). The fields are the
    ones ``torch.UntypedStorage._share_cuda_`` returns, as plain bytes and integers."""

    device: Annotated[int, msgspec.Meta(ge=0, le=255)]
    handle: Annotated[bytes, msgspec.Meta(min_length=1, max_length=1024)]
    storage_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 48)]
    offset_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 48)]
    ref_counter: RefCounterName
    # torch keeps 10000 counters per reference-counter file.
    ref_counter_offset: Annotated[int, msgspec.Meta(ge=0, lt=10000)]
    event: Annotated[bytes, msgspec.Meta(max_length=1024)] | None  # None when no event needs waiting for
    event_sync: bool


class TensorSpec(_Strict, frozen=True, omit_defaults=True):
    """Descriptor of one tensor: a raw frame that follows the header or, when ``shm``
    names a segment, the bytes of that shared-memory segment (same host only), or,
    when ``cuda`` is set, the sender's GPU memory (same node, GPU to GPU)."""

    name: str
    dtype: str
    shape: list[int]
    shm: ShmName | None = None
    cuda: CudaIpcHandle | None = None


class Route(_Strict, frozen=True):
    """Instances chosen by the router at admission, as indices into the topology.

    Indices, not addresses: a worker only ever connects to endpoints from its
    own topology configuration, never to an address a message names.
    """

    encoder: int
    denoise: int
    decode: int


# An adapter's name: what requests and the adapter endpoints call it.
LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
LoraName = Annotated[str, msgspec.Meta(pattern=LORA_NAME_PATTERN)]


class CacheParams(_Strict):
    """A request's step caching: reuse a transformer output between close steps (serving, never an SDE step)."""

    method: CacheMethod
    threshold: float


class RolloutParams(_Strict):
    """What ``/rollout/generate`` adds to a generation request."""

    sde_scheduler: bool = True  # False: the serving scheduler, exactly as /generate (HTTP field "rollout")
    sde_type: SdeType = "sde"
    noise_level: float = 0.7
    sde_step_indices: list[int] | None = None  # None: every step
    sde_window: list[int] | None = None  # [start, stop): the window picked from the seed (common/diffusion/windows.py)
    ode_solver: OdeSolver = "euler"  # after the last SDE step: the Euler step, or the serving scheduler
    return_trajectory: bool = False
    # return_trajectory: the entries of 0..T (the latents before each step, T: after the last) to return,
    # ascending; None: all of them.
    trajectory_steps: list[int] | None = None
    # The conditioning tensors the transformer took (text, image, embedded guidance), for a trainer's recompute.
    return_conditioning: bool = False
    return_log_probs: bool = True
    schedule: RolloutSchedule = "rollout"  # whose sigmas and timesteps the SDE steps follow
    return_kl: bool = False  # per SDE step: KL against kl_reference and the log-prob under it
    kl_reference: KlReference = "base"
    # Every sample's initial noise from this seed (the same noise for all); sample i's generator (seed + i)
    # then draws only its SDE noise. None: each sample's from its own generator.
    initial_noise_seed: int | None = None
    # A group (n > 1) whose samples share the initial noise of ``seed`` and the deterministic steps before the
    # first SDE step, computed once on one row, then branch (denoise_worker/branching.py).
    share_prefix: bool = False
    # Models with several latent streams (LTX-2's video and audio): those the SDE steps take, the others
    # following their ODE (the Euler step). None: every stream.
    sde_streams: list[str] | None = None


FieldValue = Union[bool, int, float, str]


class GenerationParams(_Strict):
    """Everything a request asks for, after the router validated it."""

    prompt: str
    negative_prompt: str
    height: int
    width: int
    num_frames: int  # 1 for image families
    num_inference_steps: int
    guidance_scale: float
    seed: int  # sample i of the request draws from seed + i (unless seeds)
    n: Annotated[int, msgspec.Meta(ge=1)] = 1  # samples, one unit of work through every stage
    seeds: list[int] | None = None  # sample i's own seed, one per sample (seed is then seeds[0])
    output_type: OutputType = "frames"
    # The family's own fields (its binding's request_fields, e.g. a second expert's guidance scale), filled
    # with their defaults by the router: read with common.diffusion.request_fields.field_value.
    fields: dict[str, FieldValue] = {}
    sigmas: list[float] | None = None
    sigmas_as_given: bool = False  # the sigmas are the grid itself, never shifted again (flow-match Euler)
    timesteps: list[float] | None = None
    mu: float | None = None
    rollout: RolloutParams | None = None
    lora_name: LoraName | None = None  # a loaded LoRA adapter, applied at lora_scale; None: the base model
    lora_scale: float = 1.0
    max_sequence_length: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 512  # the text encoder's token budget
    cache: CacheParams | None = None  # None: every step runs the transformer
    # Absolute deadline (seconds since the epoch): past it, workers drop the request
    # instead of spending compute on an answer nobody waits for any more.
    deadline: float | None = None
    # Samples answered as each is decoded (the decode worker decodes them one by one and sends each as a
    # SampleDone ahead of the request's Result).
    stream: bool = False

    def sample_seed(self, i: int) -> int:
        """The seed of sample ``i``'s generator."""
        return self.seeds[i] if self.seeds is not None else self.seed + i


class _Header(_Strict, tag_field="kind", kw_only=True):
    v: int
    request_id: str
    tensors: list[TensorSpec] = []
    carries: ClassVar[tuple[TensorField, ...]] = ()  # the tensors this kind may carry; none by default
    # The role that receives this kind ("router": an answer), where a family's tensors may ride it.
    receiver: ClassVar[str | None] = None

    @classmethod
    def contract(cls) -> dict[str, TensorField]:
        return {f.name: f for f in cls.carries}


class EncodeRequest(_Header, tag="encode", kw_only=True):
    """The request's images, when it has any (image-to-video), ride along as pixels."""

    carries = (*REQUEST_IMAGES, INITIAL_LATENTS)
    receiver = "encoder"

    route: Route
    params: GenerationParams
    timings: dict[str, float] = {}


class DenoiseRequest(_Header, tag="denoise", kw_only=True):
    """The prompt's text tensors as its family's binding declares them (``Binding.text.fields``), e.g. embeddings
    trimmed to their real token length ([L, D]) that the denoise worker zero-pads to ``max_sequence_length`` as
    the pipeline does, which keeps the padding off the wire. A request with images adds its image side's tensors
    (``Binding.condition.fields``). The family's own tensors are its contract's (common/protocol/contracts.py)."""

    carries = (PROMPT_EMBEDS, NEGATIVE_PROMPT_EMBEDS, PROMPT_MASK, NEGATIVE_PROMPT_MASK, INITIAL_LATENTS)
    receiver = "denoise"

    route: Route
    params: GenerationParams
    timings: dict[str, float] = {}
    peak_memory: dict[str, int] = {}  # each stage's peak while it held the request, bytes (by role)


class DecodeRequest(_Header, tag="decode", kw_only=True):
    """Latents still normalised; the decode worker de-normalises them for the VAE."""

    carries = (LATENTS, *ROLLOUT_OUTPUTS)
    receiver = "decode"

    route: Route
    params: GenerationParams
    timings: dict[str, float] = {}
    peak_memory: dict[str, int] = {}
    info: dict[str, Info] = {}


class Result(_Header, tag="result", kw_only=True):
    """Final answer for one request. ``info`` holds per-request facts such as the
    scheduler that ran and the weight version, and per-sample counts (lists, one entry per sample)."""

    carries = (OUTPUT, AUDIO, *ROLLOUT_OUTPUTS)
    receiver = "router"

    stage: str
    timings: dict[str, float] = {}
    peak_memory: dict[str, int] = {}
    info: dict[str, Info] = {}


class SampleDone(_Header, tag="sample_done", kw_only=True):
    """Decode worker -> router, for a streaming request (``GenerationParams.stream``): sample ``index`` decoded,
    its rows of the per-sample tensors ([1, ...]) and the shared ones. The request's Result follows with every
    sample as usual, so an answer never depends on these."""

    carries = (OUTPUT, AUDIO, *ROLLOUT_OUTPUTS)
    receiver = "router"

    stage: str
    index: Annotated[int, msgspec.Meta(ge=0)]
    timings: dict[str, float] = {}
    info: dict[str, Info] = {}


class Cancel(_Header, tag="cancel", kw_only=True):
    """Router -> encoder, then along the route: a stage holding ``request_id`` drops it (answers 499 ``cancelled``),
    else passes this on behind it on the same socket. ``partial``: a denoise worker answers a rollout's steps done."""

    route: Route
    decode: bool = True  # whether the request goes through a decode worker (not for output_type latent)
    partial: bool = False


class Progress(_Header, tag="progress", kw_only=True):
    """A stage finished with a request and handed it on; lets the router tell,
    when a worker dies, which in-flight requests died with it."""

    stage: str


class StepProgress(_Header, tag="step_progress", kw_only=True):
    """Denoise worker -> router, every so often while a request denoises: ``step`` of ``steps`` taken.
    The router's job progress, long-request log lines and step metrics come from these."""

    step: Annotated[int, msgspec.Meta(ge=0)]
    steps: Annotated[int, msgspec.Meta(ge=1)]


class ErrorReply(_Header, tag="error", kw_only=True):
    """A request failed in ``stage``; ``status`` is the HTTP status to answer with."""

    stage: str
    type: str
    message: str
    status: int = 500


class Heartbeat(_Header, tag="heartbeat", kw_only=True):
    role: str
    index: int
    pid: int
    device: str
    endpoint: str
    socket_type: str
    state: str
    # Tensors this worker sent and received as CUDA IPC handles since it started (common/transport/cuda_ipc.py).
    cuda_ipc_sent: int = 0
    cuda_ipc_received: int = 0
    # Tensors it sent and received through shared-memory segments (common/transport/shm.py).
    shm_sent: int = 0
    shm_received: int = 0


class PeerMoved(_Header, tag="peer_moved", kw_only=True):
    """Router -> worker: a worker now runs elsewhere (``launch.py --ray`` replaced it on another node after
    its node died). Send to it at ``endpoint``; admit its connections by ``public_key`` (z85; empty without
    CURVE) instead of its old one."""

    role: Literal["encoder", "denoise", "decode"]
    index: Annotated[int, msgspec.Meta(ge=0)]
    endpoint: Annotated[str, msgspec.Meta(pattern=r"^tcp://[0-9.]+:[0-9]{1,5}$")]
    public_key: Annotated[str, msgspec.Meta(pattern=r"^([0-9A-Za-z.:+=^!/*?&<>()\[\]{}@%$#-]{40})?$")]
    node: Annotated[str, msgspec.Meta(max_length=128)] = ""


# The data and bookkeeping kinds; the control kinds are in common/protocol/control.py (the codec takes both).
Message = Union[
    EncodeRequest, DenoiseRequest, DecodeRequest, Result, ErrorReply, Heartbeat, Cancel, Progress, StepProgress,
    PeerMoved, SampleDone,
]
REQUEST_KINDS = {"encoder": EncodeRequest, "denoise": DenoiseRequest, "decode": DecodeRequest}
