"""What a weights file declares, read from its header alone: each tensor's name, dtype and shape.

A safetensors file starts with the length of its JSON header, then the header (each tensor's dtype, shape and
byte range), then the data; a file cut short (an interrupted download) is found by comparing its size with the
end of the last range, without reading the data. A GGUF file's header is read with the ``gguf`` package (its
tensors' shapes are stored innermost first: reversed here into torch's order). The launcher's checks
(common/diffusion/checkpoint_check.py) compare these with the shapes a model's config gives.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

# safetensors' dtype names and whether each holds floating-point values.
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"}
INT_DTYPES = {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"}
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound


class HeaderError(ValueError):
    """The file is not a readable weights file; the message says why (one line, naming the file)."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str  # safetensors' name (F32, BF16, ...); a GGUF file's quantization type name (Q8_0, F16, ...)
    shape: tuple[int, ...]
    is_float: bool  # the values are floating-point (a quantized GGUF tensor's are, once dequantized)


def safetensors_entries(file: Path) -> dict[str, TensorEntry]:
    """The tensors a .safetensors file declares; a file whose header is unreadable or whose data is shorter
    than the header says raises :class:`HeaderError`."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HeaderError(f"{file}: truncated ({size} bytes, shorter than a safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER_BYTES or 8 + n > size:
                raise HeaderError(f"{file}: truncated or not a safetensors file ({size} bytes; its header "
                                  f"claims {n} bytes)")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeaderError(f"{file}: not a readable safetensors file ({e})") from e
    if not isinstance(header, dict):
        raise HeaderError(f"{file}: not a safetensors file (its header is not a JSON object)")
    entries, end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise HeaderError(f"{file}: tensor {name!r} has no valid dtype, shape and data_offsets") from e
        if dtype not in FLOAT_DTYPES | INT_DTYPES:
            raise HeaderError(f"{file}: tensor {name!r} has dtype {dtype}, which torch does not read")
        entries[name] = TensorEntry(dtype, shape, dtype in FLOAT_DTYPES)
        end = max(end, int(stop))
    if 8 + n + end > size:
        raise HeaderError(f"{file}: truncated ({size} bytes; its header describes {8 + n + end})")
    return entries


def gguf_entries(file: Path) -> dict[str, TensorEntry]:
    """The tensors a .gguf file declares (each one's shape in torch's order)."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise HeaderError(f"{file}: reading GGUF files needs the gguf package (pip install "
                          "'disagg-diffusion[gguf]')") from e
    try:
        reader = GGUFReader(file)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError... on damaged files
        raise HeaderError(f"{file}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    out = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        out[t.name] = TensorEntry(kind, tuple(int(d) for d in reversed(list(t.shape))), not kind.startswith("I"))
    return out


def entries_of(file: Path) -> dict[str, TensorEntry]:
    """The tensors a .safetensors or .gguf file declares."""
    return gguf_entries(file) if file.suffix == ".gguf" else safetensors_entries(file)
