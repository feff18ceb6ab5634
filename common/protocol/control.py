"""Control messages: router -> worker administration, one kind per operation, each with its typed reply.

A worker answers each with the reply its handler returns, or with an ``ErrorReply`` (a refusal, a failure,
or a kind it does not handle). Weight updates wait until no request is in flight; adapter changes apply
between two steps (requests in flight keep the adapter version they started with).
Like every message kind, each is strict: unknown fields, wrong types and values out of bounds are refused
by the codec before a worker sees them.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

import msgspec

from common.protocol.messages import LORA_BLOB, CudaIpcHandle, ExpertName, LoraName, ShmName, _Header, _Strict

Path = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
Rank = Annotated[int, msgspec.Meta(ge=1)]


class LoraTensor(_Strict, frozen=True):
    """One tensor of an adapter sent from memory: its state-dict key and shape inside ``LORA_BLOB``."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    shape: Annotated[list[Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]], msgspec.Meta(min_length=1, max_length=2)]


class WeightTensor(_Strict, frozen=True):
    """One tensor of a weight update from memory: its state-dict name, dtype, shape, and where its
    bytes lie (bucket index, byte offset) in the update's buckets (common/diffusion/weight_buckets.py)."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    dtype: str
    shape: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]], msgspec.Meta(max_length=8)]
    bucket: Annotated[int, msgspec.Meta(ge=0)]
    offset: Annotated[int, msgspec.Meta(ge=0, le=1 << 48)]


class WeightBucket(_Strict, frozen=True):
    """One bucket of a weight update: its size and, on one host, the shared-memory segment holding it
    (written by the trainer; common/transport/weight_segments.py) or the CUDA IPC handle of the trainer's
    GPU buffer holding it. Broadcast buckets have neither."""

    nbytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 48)]
    segment: ShmName | None = None
    cuda: CudaIpcHandle | None = None


# --- replies (worker -> router) ---------------------------------------------------------------

class _ControlReply(_Header, kw_only=True):
    role: str
    index: int

    def body(self) -> dict:
        """The reply's own fields (what the router reports per worker), header aside."""
        return {f: getattr(self, f) for f in self.__struct_fields__ if f not in _ControlReply.__struct_fields__}


class WeightsReply(_ControlReply, tag="weights_reply", kw_only=True):
    weight_version: int
    load_s: float
    sha256: str | None  # None: the update asked for no checksum


class ChecksumReply(_ControlReply, tag="checksum_reply", kw_only=True):
    weight_version: int
    sha256: str


class LoraReply(_ControlReply, tag="lora_reply", kw_only=True):
    lora_name: str
    lora_version: int
    rank: int
    scale: float | None  # alpha / r, when every module agrees
    target_modules: list[str]
    experts: list[str]
    sha256: str


class UnloadLoraReply(_ControlReply, tag="unload_lora_reply", kw_only=True):
    lora_name: str


class GroupReply(_ControlReply, tag="group_reply", kw_only=True):
    rank: int
    world_size: int
    backend: str


class GroupDestroyedReply(_ControlReply, tag="group_destroyed_reply", kw_only=True):
    group: Literal["destroyed", "none"]


class ReleaseReply(_ControlReply, tag="release_reply", kw_only=True):
    """What the process held before and after (``memory_usage``: bytes by kind), for the trainer's logs."""

    level: int
    released_bytes: int
    before: dict[str, int]
    after: dict[str, int]


class ResumeReply(_ControlReply, tag="resume_reply", kw_only=True):
    level: int
    after: dict[str, int]
    weight_version: int | None = None  # denoise workers: their weight version after the resume
    reloaded: list[str] = []  # the modules loaded again from the model directory


class PinReply(_ControlReply, tag="pin_reply", kw_only=True):
    """The weight version now pinned as ``kl_reference: "pinned"``, the experts copied and their bytes."""

    weight_version: int
    experts: list[str]
    nbytes: int
    pin_s: float


# --- requests (router -> worker) -------------------------------------------------------------

class _Control(_Header, kw_only=True):
    replies: ClassVar[tuple[type[_ControlReply], ...]] = ()  # the kinds a worker answers it with (or an ErrorReply)


class UpdateWeights(_Control, tag="update_weights", kw_only=True):
    """A module's new weights from a checkpoint below a weight root (denoise workers)."""

    replies = (WeightsReply,)

    module: ExpertName = "transformer"
    path: Path
    version: int | None = None  # the weight version to report after the load; None: the worker's next
    checksum: bool = True  # answer with the sha256 of the new weights (one pass over them)


class Checksum(_Control, tag="checksum", kw_only=True):
    replies = (ChecksumReply,)

    module: ExpertName = "transformer"
    # engine: the state dict's names, dtypes, shapes and bytes (common/diffusion/weights.py); sglang: SGLang
    # diffusion's digest of the parameters (its /get_weights_checksum); vllm_omni: vLLM-Omni's (with dtypes, shapes).
    scheme: Literal["engine", "sglang", "vllm_omni"] = "engine"


class _FromMemory(_Control, kw_only=True):
    """A module's new weights, or with ``lora_name`` an adapter of it (peft names), from the trainer's memory:
    the tensors and their buckets (segments or CUDA IPC handles on one host, else broadcast over its group)."""

    module: ExpertName = "transformer"
    version: int | None = None
    checksum: bool = True
    weight_tensors: list[WeightTensor] = []
    weight_buckets: list[WeightBucket] = []
    lora_name: LoraName | None = None
    lora_rank: Rank | None = None
    lora_alpha: float | None = None
    # A group's broadcast of one tensor per bucket in that tensor's own dtype (SGLang's trainers), where the
    # engine's own trainer broadcasts raw bytes.
    typed_broadcast: bool = False

    replies = (WeightsReply, LoraReply)


class UpdateWeightsFromTensors(_FromMemory, tag="update_weights_from_tensors", kw_only=True):
    pass


class UpdateWeightsFromGroup(_FromMemory, tag="update_weights_from_distributed", kw_only=True):
    pass


class InitWeightsGroup(_Control, tag="init_weights_group", kw_only=True):
    """Join the trainer's torch.distributed group (the trainer is rank 0 and hosts the store)."""

    replies = (GroupReply,)

    master_address: Annotated[str, msgspec.Meta(max_length=255)]
    master_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    world_size: Annotated[int, msgspec.Meta(ge=2)]
    rank: Rank
    backend: Literal["gloo", "nccl"] = "gloo"
    group_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 600.0


class DestroyWeightsGroup(_Control, tag="destroy_weights_group", kw_only=True):
    replies = (GroupDestroyedReply,)


class LoadLora(_Control, tag="load_lora", kw_only=True):
    """An adapter from a path below a weight root, or from the trainer's tensors: consecutive pieces of
    ``LORA_BLOB``, named and shaped by ``lora_tensors``, with its rank and alpha."""

    carries = (LORA_BLOB,)
    replies = (LoraReply,)

    lora_name: LoraName
    version: int | None = None  # the adapter version to report; None: the worker's next for this name
    path: Path | None = None
    load_into_transformer_2: bool = False  # from a path: its transformer keys go to the second expert
    module: ExpertName = "transformer"  # from memory: the expert the tensors belong to
    lora_tensors: list[LoraTensor] = []
    lora_rank: Rank | None = None
    lora_alpha: float | None = None


class UnloadLora(_Control, tag="unload_lora", kw_only=True):
    replies = (UnloadLoraReply,)

    lora_name: LoraName


class ReleaseMemory(_Control, tag="release_memory", kw_only=True):
    """Level 1 moves the worker's weights to host memory, 2 drops them; ``abort``: drop the requests it holds
    instead of finishing them first (any worker)."""

    replies = (ReleaseReply,)

    level: Literal[1, 2] = 1
    abort: bool = False


class ResumeMemory(_Control, tag="resume_memory", kw_only=True):
    """``reload="disk"`` loads dropped weights from the model directory (with ``version``: the denoise
    worker's weight version after it)."""

    replies = (ResumeReply,)

    reload: Literal["disk"] | None = None
    version: int | None = None


class PinReference(_Control, tag="pin_reference", kw_only=True):
    """Copy every expert's current weights as the reference of ``kl_reference: "pinned"`` (denoise workers; a
    later pin replaces the copy)."""

    replies = (PinReply,)


ControlRequest = Union[UpdateWeights, Checksum, UpdateWeightsFromTensors, UpdateWeightsFromGroup, InitWeightsGroup,
                       DestroyWeightsGroup, LoadLora, UnloadLora, ReleaseMemory, ResumeMemory, PinReference]
ControlReply = Union[WeightsReply, ChecksumReply, LoraReply, UnloadLoraReply, GroupReply, GroupDestroyedReply,
                     ReleaseReply, ResumeReply, PinReply]
FromMemory = Union[UpdateWeightsFromTensors, UpdateWeightsFromGroup]  # weights, or an adapter, from the trainer
CONTROL_REQUESTS: tuple[type, ...] = ControlRequest.__args__
CONTROL_REPLIES: tuple[type, ...] = ControlReply.__args__


def kind_of(msg: object) -> str:
    """A message's (or a message class's) wire kind, its tag: for log lines and errors."""
    return msg.__struct_config__.tag
