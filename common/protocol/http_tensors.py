"""Tensors in HTTP bodies: ``{"dtype", "shape", "data"}``.

In JSON ``data`` is the base64 of the raw little-endian C-order bytes; in
msgpack it is those bytes as-is. The router and the Python client share this
module so that both sides agree byte for byte.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import torch

from common.protocol.codec import DTYPE_NAMES, DTYPES, tensor_bytes


def tensor_to_body(t: torch.Tensor, binary: bool) -> dict[str, Any]:
    raw = tensor_bytes(t)
    data: Any = raw if binary else base64.b64encode(raw).decode("ascii")
    return {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data": data}


def body_to_tensor(obj: dict[str, Any]) -> torch.Tensor:
    dtype = DTYPES[obj["dtype"]]
    shape = [int(d) for d in obj["shape"]]
    data = obj["data"]
    raw = base64.b64decode(data) if isinstance(data, str) else bytes(data)
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if len(raw) != expected:
        raise ValueError(f"tensor body has {len(raw)} bytes, {obj['dtype']}{shape} needs {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def decode_tensors(obj: Any) -> Any:
    """Recursively turn every tensor body in a decoded response into a torch tensor."""
    if isinstance(obj, dict):
        if set(obj) == {"dtype", "shape", "data"}:
            return body_to_tensor(obj)
        return {k: decode_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_tensors(v) for v in obj]
    return obj
