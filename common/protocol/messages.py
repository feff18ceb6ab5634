"""Typed messages exchanged between the router and the workers.

Every message is a msgspec Struct tagged by ``kind``; the wire codec
(:mod:`common.protocol.codec`) encodes the struct as frame 0 and the tensors it names
as the following raw frames. Decoding is strict: wrong types, unknown fields
and unknown kinds are rejected before any worker code sees the message.

Schedulers never appear here: a request carries only the numbers a denoise
worker needs to rebuild its own request-local scheduler.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec

PROTOCOL_VERSION = 1

ROLES = ("encoder", "denoise", "decode")
OutputType = Literal["frames", "latent"]


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


SdeType = Literal["sde", "cps", "ode"]
WeightModule = Literal["transformer", "transformer_2"]


class RolloutParams(_Strict):
    """What ``/rollout/generate`` adds to a generation request."""

    rollout: bool = True  # False: the serving scheduler, exactly as /generate
    sde_type: SdeType = "sde"
    noise_level: float = 0.7
    sde_step_indices: list[int] | None = None  # None: every step
    return_trajectory: bool = False
    return_log_probs: bool = True


class GenerationParams(_Strict):
    """Everything a request asks for, after the router validated it."""

    prompt: str
    negative_prompt: str
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    output_type: OutputType = "frames"
    guidance_scale_2: float | None = None
    sigmas: list[float] | None = None
    timesteps: list[float] | None = None
    mu: float | None = None
    rollout: RolloutParams | None = None
    # Absolute deadline (seconds since the epoch): past it, workers drop the request
    # instead of spending compute on an answer nobody waits for any more.
    deadline: float | None = None


class _Header(_Strict, tag_field="kind", kw_only=True):
    v: int
    request_id: str
    tensors: list[TensorSpec] = []


class EncodeRequest(_Header, tag="encode", kw_only=True):
    route: Route
    params: GenerationParams
    timings: dict[str, float] = {}


class DenoiseRequest(_Header, tag="denoise", kw_only=True):
    """Carries ``prompt_embeds`` and, with guidance, ``negative_prompt_embeds``.

    Embeddings travel trimmed to their real token length ([L, D]); the denoise
    worker zero-pads them to ``max_sequence_length`` as diffusers does, which
    keeps the 512-token padding off the wire.
    """

    route: Route
    params: GenerationParams
    timings: dict[str, float] = {}


class DecodeRequest(_Header, tag="decode", kw_only=True):
    """Carries ``latents`` [1, C, F', H', W'] (normalised, as the transformer sees them)."""

    route: Route
    params: GenerationParams
    timings: dict[str, float] = {}
    info: dict[str, str | int | float] = {}


class Result(_Header, tag="result", kw_only=True):
    """Final answer for one request; carries ``output`` and any rollout tensors.

    ``info`` holds per-request facts such as the scheduler that ran and the
    weight version; rollout tensors (``log_probs``, ``trajectory.*``) ride
    along from the denoise worker through the decode worker unchanged.
    """

    stage: str
    timings: dict[str, float] = {}
    info: dict[str, str | int | float] = {}


class ControlRequest(_Header, tag="control", kw_only=True):
    """Router -> worker administration, handled between requests."""

    op: Literal["update_weights", "checksum"]
    module: WeightModule = "transformer"
    path: str | None = None
    version: int | None = None  # the weight version to report after a successful update


class ControlReply(_Header, tag="control_reply", kw_only=True):
    role: str
    index: int
    data: dict[str, str | int | float | None] = {}


class Progress(_Header, tag="progress", kw_only=True):
    """A stage finished with a request and handed it on; lets the router tell,
    when a worker dies, which in-flight requests died with it."""

    stage: str


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
    busy: int = 0
    # Tensors this worker sent and received as CUDA IPC handles since it started (common/transport/cuda_ipc.py).
    cuda_ipc_sent: int = 0
    cuda_ipc_received: int = 0


Message = Union[
    EncodeRequest,
    DenoiseRequest,
    DecodeRequest,
    Result,
    ErrorReply,
    Heartbeat,
    ControlRequest,
    ControlReply,
    Progress,
]
REQUEST_KINDS = {"encoder": EncodeRequest, "denoise": DenoiseRequest, "decode": DecodeRequest}
