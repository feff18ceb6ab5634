"""Wire codec: a msgpack header frame followed by raw tensor frames.

Frame 0 is a :mod:`common.messages` struct encoded with msgpack; it lists a
``TensorSpec`` (name, dtype, shape) for every following frame. Tensor frames
are the tensor's C-order little-endian bytes, handed to ZeroMQ without a copy.
On receive every size is checked against its descriptor before a tensor is
built, and tensors are views over the received frames (no copy).

Nothing here can execute code from a peer: msgpack plus raw bytes only.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any, Sequence

import msgspec
import torch

from common.messages import PROTOCOL_VERSION, Message, TensorSpec

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

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class WireError(ValueError):
    """A received message that cannot be accepted.

    ``request_id`` is set when the header was readable enough to name the
    request, so that the receiver can answer that request with an error.
    """

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


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


def encode(msg: Message, tensors: dict[str, torch.Tensor] | None = None) -> list[Any]:
    """Frames for ``msg`` plus ``tensors``; ``msg.tensors`` is filled in here."""
    tensors = tensors or {}
    specs, frames = [], []
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} cannot travel on the wire")
        specs.append(TensorSpec(name=name, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape)))
        frames.append(tensor_bytes(t))
    msg = msgspec.structs.replace(msg, tensors=specs)
    return [_encoder.encode(msg), *frames]


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


def _build_tensor(spec: TensorSpec, buf: memoryview, request_id: str) -> torch.Tensor:
    if spec.dtype not in DTYPES:
        raise WireError(f"tensor {spec.name!r}: unknown dtype {spec.dtype!r}", request_id)
    if (
        len(spec.shape) > MAX_NDIM
        or any(d < 0 for d in spec.shape)
        or math.prod(max(d, 1) for d in spec.shape) > MAX_ELEMENTS
    ):
        raise WireError(f"tensor {spec.name!r}: invalid shape {spec.shape}", request_id)
    dtype = DTYPES[spec.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(spec.shape) * itemsize
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


def decode(frames: Sequence[Any]) -> tuple[Message, dict[str, torch.Tensor]]:
    """Validate and decode a multipart message. Raises :class:`WireError`."""
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
        raise WireError(
            f"protocol version {msg.v} is not {PROTOCOL_VERSION}", msg.request_id or None
        )
    if len(msg.tensors) > MAX_TENSORS:
        raise WireError(f"{len(msg.tensors)} tensors exceed the limit {MAX_TENSORS}", msg.request_id)
    if len(frames) - 1 != len(msg.tensors):
        raise WireError(
            f"header names {len(msg.tensors)} tensors but {len(frames) - 1} frames follow",
            msg.request_id,
        )
    names = [s.name for s in msg.tensors]
    if len(set(names)) != len(names):
        raise WireError("duplicate tensor names", msg.request_id)
    tensors = {
        spec.name: _build_tensor(spec, _frame_buffer(f), msg.request_id)
        for spec, f in zip(msg.tensors, frames[1:])
    }
    return msg, tensors
