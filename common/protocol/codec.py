"""Wire codec: a msgpack header frame followed by raw tensor frames.

Frame 0 is a :mod:`common.protocol.messages` struct encoded with msgpack; it lists a
``TensorSpec`` (name, dtype, shape) for every tensor. Tensor frames are the
tensor's C-order little-endian bytes, handed to ZeroMQ without a copy. On
receive every size is checked against its descriptor before a tensor is
built, and tensors are views over the received frames (no copy).

Same host only: with a sender object from :mod:`common.transport.shm`, a large tensor
goes into a shared-memory segment instead of a frame and its descriptor names
the segment (``TensorSpec.shm``); the receiver needs its own receiver object
to accept such a descriptor, checks the segment's size the same way, and the
tensor is a view over the mapped segment. Without one (tcp, or shared memory
off) a descriptor that names a segment is rejected.

Same node, GPU to GPU: with a sender object from :mod:`common.transport.cuda_ipc`, a
CUDA tensor travels as a CUDA IPC handle (``TensorSpec.cuda``) and the
receiver's object copies it into its own GPU memory; a receiver without one
rejects such a descriptor.

Nothing here can execute code from a peer: msgpack plus raw bytes only.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any, Protocol, Sequence, Union

import msgspec
import torch

from common.protocol.contracts import SHARED, WireContract
from common.protocol.control import ControlReply, ControlRequest
from common.protocol.messages import PROTOCOL_VERSION, CudaIpcHandle, Message, TensorSpec

if sys.byteorder != "little":  # raw frames are little-endian by contract
    raise RuntimeError("disagg-diffusion's wire format needs a little-endian host")

MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 64
MAX_NDIM = 8
# Bound on a descriptor's element count with zero dimensions read as 1: a
# zero-size tensor of shape [0, 2**63] matches an empty frame, yet torch
# cannot build it (it raises instead of returning an empty tensor).
MAX_ELEMENTS = 1 << 56

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# Every kind a peer may send: the data and bookkeeping kinds, and the control requests and their replies.
Wire = Union[Message, ControlRequest, ControlReply]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Wire)


class WireError(ValueError):
    """A received message that cannot be accepted.

    ``request_id`` is set when the header was readable enough to name the
    request, so that the receiver can answer that request with an error.
    """

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


class ShmSend(Protocol):
    """Sender side of the shared-memory data plane (``common.transport.shm.ShmSender``)."""

    def put(self, t: torch.Tensor) -> str | None: ...  # a segment name, or None: send a frame

    def discard(self, name: str) -> None: ...


class ShmReceive(Protocol):
    """Receiver side (``common.transport.shm.ShmReceiver``)."""

    def open(self, name: str, nbytes: int, request_id: str | None = None) -> memoryview: ...

    def discard(self, name: object) -> None: ...


class CudaSend(Protocol):
    """Sender side of the GPU data plane (``common.transport.cuda_ipc.CudaIpcSender``)."""

    def put(self, t: torch.Tensor) -> CudaIpcHandle | None: ...  # None: stage through host memory

    def discard(self, h: CudaIpcHandle) -> None: ...


class CudaReceive(Protocol):
    """Receiver side (``common.transport.cuda_ipc.CudaIpcReceiver``)."""

    def open(self, h: CudaIpcHandle, dtype: torch.dtype, shape: list[int], nbytes: int,
             request_id: str | None = None) -> torch.Tensor: ...

    def discard(self, h: CudaIpcHandle) -> None: ...


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's raw bytes as a zero-copy view (after making it contiguous on CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    # Viewing as uint8 works for every dtype, bfloat16 included (numpy has no bf16).
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def encode(
    msg: Wire,
    tensors: dict[str, torch.Tensor] | None = None,
    shm: ShmSend | None = None,
    cuda: CudaSend | None = None,
) -> list[Any]:
    """Frames for ``msg`` plus ``tensors``; ``msg.tensors`` is filled in here.

    Per tensor: ``cuda`` (same node, both ends GPU workers) may send a CUDA tensor
    as a CUDA IPC handle; else ``shm`` (same host) may put it into a shared-memory
    segment; else it is a frame.
    """
    tensors = tensors or {}
    specs, frames, segments, handles = [], [], [], []
    try:
        for name, t in tensors.items():
            if t.dtype not in DTYPE_NAMES:
                raise TypeError(f"tensor {name!r}: dtype {t.dtype} cannot travel on the wire")
            handle = cuda.put(t) if cuda is not None else None
            segment = shm.put(t) if shm is not None and handle is None else None
            specs.append(TensorSpec(name=name, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape), shm=segment,
                                    cuda=handle))
            if handle is not None:
                handles.append(handle)
            elif segment is not None:
                segments.append(segment)
            else:
                frames.append(tensor_bytes(t))
        msg = msgspec.structs.replace(msg, tensors=specs)
        return [_encoder.encode(msg), *frames]
    except BaseException:
        for segment in segments:  # nobody will ever open them
            shm.discard(segment)
        for handle in handles:
            cuda.discard(handle)
        raise


def _peek_request_id(raw: bytes) -> str | None:
    """Best-effort request id from a header that failed strict decoding."""
    try:
        loose = msgspec.msgpack.decode(raw)
    except Exception:
        return None
    if isinstance(loose, dict):
        rid = loose.get("request_id")
        if isinstance(rid, str) and 0 < len(rid) <= 256:
            return rid
    return None


def _frame_buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)
    return memoryview(buf)


def _expected_bytes(spec: TensorSpec, request_id: str) -> int:
    """The descriptor's byte count, after checking its dtype and shape."""
    if spec.dtype not in DTYPES:
        raise WireError(f"tensor {spec.name!r}: unknown dtype {spec.dtype!r}", request_id)
    if (
        len(spec.shape) > MAX_NDIM
        or any(d < 0 for d in spec.shape)
        or math.prod(max(d, 1) for d in spec.shape) > MAX_ELEMENTS
    ):
        raise WireError(f"tensor {spec.name!r}: invalid shape {spec.shape}", request_id)
    return math.prod(spec.shape) * torch.empty((), dtype=DTYPES[spec.dtype]).element_size()


def _build_tensor(spec: TensorSpec, buf: memoryview, request_id: str) -> torch.Tensor:
    dtype = DTYPES[spec.dtype]
    expected = _expected_bytes(spec, request_id)
    if buf.nbytes != expected:
        raise WireError(
            f"tensor {spec.name!r}: frame has {buf.nbytes} bytes, descriptor "
            f"{spec.dtype}{spec.shape} needs {expected}",
            request_id,
        )
    if expected == 0:
        return torch.empty(spec.shape, dtype=dtype)
    with warnings.catch_warnings():
        # ZeroMQ frames are read-only buffers; the tensor is a view over one.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(dtype).reshape(spec.shape)


def decode(
    frames: Sequence[Any], shm: ShmReceive | None = None, cuda: CudaReceive | None = None,
    contract: WireContract = SHARED,
) -> tuple[Wire, dict[str, torch.Tensor]]:
    """Validate and decode a multipart message, its tensors checked against its kind's contract
    (``carries``: names, dtype classes, ranks, required ones present) with the receiver's family's tensors
    (``contract``: the served family's; the shared tensors alone by default). Raises :class:`WireError`.

    ``shm``: this process's shared-memory receiver (same host only); without one a
    descriptor that names a segment is rejected. ``cuda``: this GPU worker's CUDA IPC
    receiver; without one a descriptor that carries a CUDA IPC handle is rejected.
    """
    return _decode(frames, shm, cuda, contract)


def decode_frames(
    frames: Sequence[Any], shm: ShmReceive | None = None, cuda: CudaReceive | None = None
) -> tuple[Wire, dict[str, torch.Tensor]]:
    """:func:`decode` without the message kind's tensor contract: the data plane alone
    (header, descriptors, frames, segments, handles), for code that moves arbitrary tensors."""
    return _decode(frames, shm, cuda, None)


def _decode(frames: Sequence[Any], shm: ShmReceive | None, cuda: CudaReceive | None,
            contract: WireContract | None) -> tuple[Wire, dict[str, torch.Tensor]]:
    if not frames:
        raise WireError("empty message")
    head = _frame_buffer(frames[0])
    if head.nbytes > MAX_HEADER_BYTES:
        raise WireError(f"header of {head.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    raw = head.tobytes()
    try:
        msg = _decoder.decode(raw)
    except msgspec.DecodeError as e:
        raise WireError(f"invalid header: {e}", _peek_request_id(raw)) from None
    if msg.v != PROTOCOL_VERSION:
        raise WireError(f"protocol version {msg.v} is not {PROTOCOL_VERSION}", msg.request_id or None)
    opened: set[str] = set()
    try:
        if contract is not None:
            _check_contract(msg, contract)
        return msg, _tensors(msg, frames, shm, cuda, opened)
    except BaseException:
        # Out-of-band data of a rejected message: segments are removed (idempotent: an opened one is
        # already unlinked); CUDA IPC handles not yet opened are released, exactly once.
        for spec in msg.tensors:
            if spec.shm is not None and shm is not None:
                shm.discard(spec.shm)
            if spec.cuda is not None and cuda is not None and spec.name not in opened:
                cuda.discard(spec.cuda)
        raise


def _check_contract(msg: Wire, wire: WireContract) -> None:
    """Every tensor is one its kind declares, of the declared dtype class and rank; required ones are there."""
    contract = wire.of(type(msg))
    families = [f for f in contract.values() if f.prefix]
    kind = type(msg).__name__
    for spec in msg.tensors:
        field = contract.get(spec.name) or next((f for f in families if f.names(spec.name)), None)
        if field is None:
            raise WireError(f"a {kind} carries no tensor {spec.name!r} (it carries {sorted(contract) or 'none'})",
                            msg.request_id or None)
        problem = field.problem(spec.dtype, spec.shape)
        if problem is not None:
            raise WireError(f"tensor {spec.name!r} of a {kind}: {problem}", msg.request_id or None)
    missing = [f.name for f in contract.values() if f.required and f.name not in {s.name for s in msg.tensors}]
    if missing:
        raise WireError(f"a {kind} without {', '.join(missing)}", msg.request_id or None)


def _tensors(
    msg: Wire, frames: Sequence[Any], shm: ShmReceive | None, cuda: CudaReceive | None, opened: set[str]
) -> dict[str, torch.Tensor]:
    if len(msg.tensors) > MAX_TENSORS:
        raise WireError(f"{len(msg.tensors)} tensors exceed the limit {MAX_TENSORS}", msg.request_id)
    names = [s.name for s in msg.tensors]
    if len(set(names)) != len(names):
        raise WireError("duplicate tensor names", msg.request_id)
    if any(s.shm is not None and s.cuda is not None for s in msg.tensors):
        raise WireError("a tensor names both a shared-memory segment and a CUDA IPC handle", msg.request_id)
    framed = [s for s in msg.tensors if s.shm is None and s.cuda is None]
    if len(frames) - 1 != len(framed):
        raise WireError(
            f"header names {len(framed)} tensor frames but {len(frames) - 1} frames follow",
            msg.request_id,
        )
    if shm is None and any(s.shm is not None for s in msg.tensors):
        raise WireError("a tensor names a shared-memory segment, but this link takes none", msg.request_id)
    if cuda is None and any(s.cuda is not None for s in msg.tensors):
        raise WireError("a tensor carries a CUDA IPC handle, but this process takes none", msg.request_id)
    for spec in msg.tensors:  # every descriptor is checked before any segment or handle is opened
        if _expected_bytes(spec, msg.request_id) == 0 and spec.cuda is not None:
            raise WireError(f"tensor {spec.name!r}: an empty tensor never travels by CUDA IPC", msg.request_id)
    tensors = {}
    rest = iter(frames[1:])
    for spec in msg.tensors:
        if spec.cuda is not None:
            opened.add(spec.name)  # open() releases the handle itself if it fails
            tensors[spec.name] = cuda.open(spec.cuda, DTYPES[spec.dtype], spec.shape,
                                           _expected_bytes(spec, msg.request_id), msg.request_id)
            continue
        if spec.shm is None:
            buf = _frame_buffer(next(rest))
        else:
            buf = shm.open(spec.shm, _expected_bytes(spec, msg.request_id), msg.request_id)
        tensors[spec.name] = _build_tensor(spec, buf, msg.request_id)
    return tensors
