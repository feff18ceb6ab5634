"""Reading, checking, loading, saving and fingerprinting model weights.

Used for in-place weight updates of a running denoise worker (an RL trainer
pushes new transformer weights with ``POST /update_weights_from_disk``) and
for verifying them (``GET /weights_checksum`` is compared against
:func:`state_dict_checksum` of the trainer's own copy).

Only the safetensors format is read: it holds plain tensors, so loading a
file can never run code (unlike pickle-based ``.bin`` / ``.pt`` files, which
are refused).

Typical flow on the trainer side::

    save_weights(model, "/shared/ckpt/step-100")       # -> .../diffusion_pytorch_model.safetensors
    expected = state_dict_checksum(model)              # or of the state cast to the engine's dtype

and on the worker side::

    state = read_weights(path, allowed_roots=[Path("/shared/ckpt")])
    load_into(transformer, state)                      # validates first; all or nothing
    state_dict_checksum(transformer)
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["WEIGHTS_INDEX_NAME", "WEIGHTS_NAME", "WeightsError", "load_into", "read_weights", "save_weights",
           "state_dict_checksum", "validate_against", "resolve_weight_roots"]

# File names diffusers' ModelMixin.save_pretrained uses.
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
SAFETENSORS_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
# How many offending names an error message lists before summarising.
_MAX_LISTED = 5


class WeightsError(ValueError):
    """The given weights (or their path) cannot be used; the message says why."""


# --------------------------------------------------------------------------
# Checksum
# --------------------------------------------------------------------------


def _state_of(obj: Any) -> Mapping[str, torch.Tensor]:
    if isinstance(obj, torch.nn.Module):
        return obj.state_dict()
    if isinstance(obj, Mapping):
        return obj
    raise TypeError(f"expected a torch.nn.Module or a mapping of name -> tensor, got {type(obj).__name__}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements as little-endian bytes, in row-major order.

    Reinterpreting as uint8 works for every dtype, including those numpy
    lacks (bfloat16, float8); reshape(-1) also covers 0-d tensors.
    """
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def state_dict_checksum(obj: torch.nn.Module | Mapping[str, torch.Tensor]) -> str:
    """SHA-256 hex digest of a module's ``state_dict()`` or of a name -> tensor mapping.

    Covers, for every name in sorted order, the name, the dtype, the shape
    and the exact bytes of the values, so any change to one of them changes
    the digest, and the same weights give the same digest in any process
    and on any device. A module and its own ``state_dict()`` give the same
    digest; weights held in another dtype do not (cast them first).
    """
    state = _state_of(obj)
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r}: expected a tensor, got {type(tensor).__name__}")
        data = _raw_bytes(tensor)
        # JSON escapes every separator a name could contain, and the length
        # of the data follows, so no two different entries hash alike.
        header = json.dumps([name, _dtype_name(tensor.dtype), list(tensor.shape), data.nbytes])
        digest.update(header.encode("utf-8") + b"\n")
        digest.update(data)
    return digest.hexdigest()


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def check_allowed(path: Path, roots: list[Path] | None, shown: Path | None = None) -> None:
    if roots is None:
        return
    real = _real(path)
    if not any(real == root or real.is_relative_to(root) for root in roots):
        shown = shown or path
        via = f" (resolves to {real})" if real != Path(os.path.abspath(shown)) else ""
        raise WeightsError(
            f"{shown}{via} is outside the allowed weight directories: {', '.join(map(str, roots))}")


def load_safetensors_file(path: Path, roots: list[Path] | None) -> dict[str, torch.Tensor]:
    """The tensors of one .safetensors file on the CPU, after checking it lies below ``roots``."""
    from safetensors.torch import load_file

    check_allowed(path, roots)
    if not path.is_file():
        raise WeightsError(f"{path} is not a regular file")
    if not path.name.endswith(SAFETENSORS_SUFFIX):
        raise WeightsError(
            f"{path} is not a {SAFETENSORS_SUFFIX} file; only safetensors weights are accepted "
            "(pickle-based .bin/.pt/.ckpt files are refused)")
    try:
        return load_file(_real(path), device="cpu")
    except Exception as e:  # SafetensorError, OSError, ...
        raise WeightsError(f"{path} is not a readable safetensors file: {e}") from e


def _load_sharded(index: Path, roots: list[Path] | None) -> dict[str, torch.Tensor]:
    check_allowed(index, roots)
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise TypeError("weight_map must map tensor names to file names")
    except Exception as e:
        raise WeightsError(f"{index} is not a valid safetensors index: {e}") from e

    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        # Shards are plain file names next to the index, never paths.
        if Path(shard).name != shard or shard in (".", ".."):
            raise WeightsError(f"{index} names shard {shard!r}, which is not a plain file name")
        shard_path = index.parent / shard
        if not shard_path.exists():
            raise WeightsError(f"{index} names shard {shard!r}, which does not exist")
        part = load_safetensors_file(shard_path, roots)
        listed = {k for k, v in weight_map.items() if v == shard}
        if set(part) != listed:
            extra = sorted(set(part) - listed)
            absent = sorted(listed - set(part))
            raise WeightsError(
                f"shard {shard_path} does not match {index.name}: "
                f"{_describe('not listed', extra)}; {_describe('missing', absent)}")
        state.update(part)
    return state


def read_weights(path: str | os.PathLike, allowed_roots: list[Path] | None = None) -> dict[str, torch.Tensor]:
    """Read the tensors stored at ``path`` onto the CPU, without running any code from it.

    ``path`` is a ``.safetensors`` file, or a folder holding (checked in
    this order) a sharded diffusers checkpoint
    (``diffusion_pytorch_model.safetensors.index.json`` plus its shards),
    a single ``diffusion_pytorch_model.safetensors``, exactly one other
    ``*.safetensors.index.json`` with its shards, or exactly one
    ``*.safetensors`` file.

    With ``allowed_roots``, the path and every file read must, after
    resolving symlinks, lie inside one of those directories.

    Raises :class:`WeightsError` for anything wrong with the path or files.
    """
    given = Path(os.path.expanduser(os.fspath(path)))
    roots = None if allowed_roots is None else [_real(Path(os.path.expanduser(r))) for r in allowed_roots]
    # Roots first, so that callers cannot probe which paths exist outside them.
    check_allowed(given, roots)
    if not given.exists():
        raise WeightsError(f"{given} does not exist")

    if not given.is_dir():
        return load_safetensors_file(given, roots)

    if (given / WEIGHTS_INDEX_NAME).is_file():
        return _load_sharded(given / WEIGHTS_INDEX_NAME, roots)
    if (given / WEIGHTS_NAME).exists():
        return load_safetensors_file(given / WEIGHTS_NAME, roots)
    indexes = sorted(p for p in given.iterdir() if p.name.endswith(INDEX_SUFFIX))
    if len(indexes) == 1:
        return _load_sharded(indexes[0], roots)
    if len(indexes) > 1:
        raise WeightsError(f"{given} holds several safetensors indexes ({_names(indexes)}); pass one file")
    files = sorted(p for p in given.iterdir() if p.name.endswith(SAFETENSORS_SUFFIX))
    if len(files) == 1:
        return load_safetensors_file(files[0], roots)
    if len(files) > 1:
        raise WeightsError(
            f"{given} holds several .safetensors files ({_names(files)}) and no index; pass one file")

    hint = ""
    others = sorted(p for p in given.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if others:
        hint = f"; found {_names(others)}, but only safetensors weights are accepted"
    elif (given / "model_index.json").is_file():
        hint = "; this looks like a pipeline folder: pass its transformer subfolder"
    raise WeightsError(f"{given} holds no .safetensors weights{hint}")


# --------------------------------------------------------------------------
# Validation and loading
# --------------------------------------------------------------------------


def _names(paths: list[Path]) -> str:
    shown = ", ".join(p.name for p in paths[:_MAX_LISTED])
    return shown + (f", ... ({len(paths)} in all)" if len(paths) > _MAX_LISTED else "")


def _describe(what: str, names: list[str]) -> str:
    if not names:
        return f"0 {what}"
    shown = ", ".join(names[:_MAX_LISTED])
    more = ", ..." if len(names) > _MAX_LISTED else ""
    return f"{len(names)} {what} ({shown}{more})"


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(map(str, t.shape)) + ")"


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every value is finite, in one pass that allocates nothing (``isfinite(t).all()`` writes a
    mask of the whole tensor first, 80x slower). NaN and inf carry through a sum, so a finite sum means
    finite values; a sum that is not finite (or finite values whose sum overflowed) is settled by the
    min and the max, which NaN and inf carry through too and which cannot overflow."""
    if t.numel() == 0 or bool(torch.isfinite(t.sum())):
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(t))).all())


def validate_against(module: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Check that ``state`` can replace ``module``'s weights exactly.

    Its names must equal those of ``module.state_dict()``, every shape must
    match, and values for floating-point weights must be finite
    floating-point tensors (any float dtype: they are cast on load). Other
    weights (integer buffers) must have the module's dtype.

    Raises :class:`WeightsError` naming the offending entries.
    """
    if not isinstance(state, Mapping):
        raise WeightsError(f"expected a mapping of name -> tensor, got {type(state).__name__}")
    if any(hasattr(p, "quant_type") for p in module.parameters()):  # GGUF's, dequantized in each forward
        raise WeightsError("the model's weights are GGUF-quantized (--transformer-file *.gguf): updates cannot replace them")
    expected = module.state_dict()
    not_tensors = sorted(str(k) for k, v in state.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        raise WeightsError(f"values must be tensors: {_describe('entries are not', not_tensors)}")
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(str(k) for k in set(state) - set(expected))
    if missing or unexpected:
        raise WeightsError(
            f"the weights do not match the module's parameters: {_describe('missing', missing)}; "
            f"{_describe('unexpected', unexpected)}")

    bad_shapes = [f"{name}: expected {_shape(expected[name])}, got {_shape(state[name])}"
                  for name in sorted(expected) if state[name].shape != expected[name].shape]
    if bad_shapes:
        raise WeightsError(f"shape mismatch for {_describe('tensors', bad_shapes)}")

    bad_dtypes = []
    for name in sorted(expected):
        want, got = expected[name].dtype, state[name].dtype
        if want.is_floating_point != got.is_floating_point or (not want.is_floating_point and want != got):
            bad_dtypes.append(f"{name}: expected {_dtype_name(want)}, got {_dtype_name(got)}")
    if bad_dtypes:
        raise WeightsError(f"dtype mismatch for {_describe('tensors', bad_dtypes)}")

    if any(state[name].is_meta for name in expected):
        raise WeightsError("the weights hold meta tensors, which have no values")
    non_finite = []
    for name in sorted(expected):
        tensor = state[name]
        if tensor.is_floating_point() and not _all_finite(tensor):
            bad = tensor.numel() - int(torch.isfinite(tensor).sum())
            non_finite.append(f"{name}: {bad} of {tensor.numel()}")
    if non_finite:
        raise WeightsError(f"non-finite values (NaN or inf) in {_describe('tensors', non_finite)}")


def load_into(module: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Replace ``module``'s weights with ``state`` in place.

    ``state`` is validated first (:func:`validate_against`), so when it is
    unusable a :class:`WeightsError` is raised and the module is unchanged.
    The values are then copied into the existing parameters and buffers,
    cast to each one's dtype and device; the parameter and buffer objects
    and their storage stay the same, so references to them remain valid.
    Afterwards ``state_dict_checksum(module)`` equals the checksum
    of ``state`` cast to the module's dtypes.

    Should the copy itself fail part way (e.g. device out of memory), a
    RuntimeError says so: the module then holds a mix of old and new weights.
    """
    validate_against(module, state)
    targets = module.state_dict()  # detached views sharing the parameters' storage
    names = sorted(targets)
    done = 0
    try:
        with torch.no_grad():
            for name in names:
                targets[name].copy_(state[name])
                done += 1
    except Exception as e:
        raise RuntimeError(
            f"weight copy failed at {names[done]!r} after {done} of {len(names)} tensors; "
            f"the module is partially updated: {e}") from e


# --------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------


def save_weights(module_or_state: torch.nn.Module | Mapping[str, torch.Tensor],
                 path: str | os.PathLike) -> Path:
    """Write a module's ``state_dict()`` (or a name -> tensor mapping) as safetensors.

    A ``path`` ending in ``.safetensors`` is the file to write; any other
    path is taken as a folder, created if needed, and the file written is
    ``diffusion_pytorch_model.safetensors`` inside it (the layout
    :func:`read_weights` and diffusers both read). The file appears
    atomically, complete or not at all. Returns the file's path.
    """
    from safetensors.torch import save_file

    state = _state_of(module_or_state)
    out: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise WeightsError(f"{name!r}: expected a tensor, got {type(tensor).__name__}")
        t = tensor.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        # safetensors refuses tensors that share memory (tied weights, views
        # into a larger buffer): give those their own copy.
        if storage.data_ptr() in seen_storage or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen_storage.add(t.untyped_storage().data_ptr())
        out[str(name)] = t

    target = Path(os.path.expanduser(os.fspath(path)))
    if not target.name.endswith(SAFETENSORS_SUFFIX):
        target = target / WEIGHTS_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        save_file(out, tmp, metadata={"format": "pt"})
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the reader may be another user
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


# --------------------------------------------------------------------------
# Weight-path allow-list (launcher side: --weight-root)
# --------------------------------------------------------------------------


def resolve_weight_roots(dirs: list[str], flag: str = "--weight-root") -> list[str]:
    """``flag``'s values (``--weight-root``) as absolute real paths of existing directories (symlinks resolved)."""
    roots: list[str] = []
    for d in dirs:
        real = os.path.realpath(os.path.expanduser(d))
        if not os.path.isdir(real):
            raise ValueError(f"{flag} {d}: not a directory")
        if real not in roots:
            roots.append(real)
    return roots
