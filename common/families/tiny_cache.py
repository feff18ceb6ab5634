"""The cache of built-in random-weight models: one directory per spec and library versions.

A spec is a frozen dataclass with a ``name`` and ``build(out_dir)``; its directory's name is the spec's
name and a digest of its fields and of the versions of the libraries that generate it, so a changed spec
or library makes a new directory instead of reusing a stale one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from common.diffusion.model_info import SERVING_DEFAULTS_FILE, STEP_CACHE_FILE

CACHE_ENV = "DISAGG_DIFFUSION_CACHE"
DEFAULT_CACHE_DIR = Path("~/.cache/disagg-diffusion")

# Bump when the builder changes in a way that changes its output, so that
# cached directories from an older builder are not reused.
_FORMAT_VERSION = 1
# Generation output depends on these packages (weights init, serialisation).
_VERSIONED_PACKAGES = ("torch", "diffusers", "transformers", "tokenizers")


def _keyed_fields(spec) -> dict:
    """The spec fields that go into its cache key.

    Fields added after the first cached models existed (``_later_field``)
    count only when they differ from their default, so the keys (directory
    names) of specs that leave them alone stay what they were.
    """
    out = dataclasses.asdict(spec)
    for f in dataclasses.fields(spec):
        if f.metadata.get("keyed_if_set") and getattr(spec, f.name) == f.default:
            del out[f.name]
    return out


def _cache_key(spec) -> str:
    payload = {
        "format": _FORMAT_VERSION,
        "spec": _keyed_fields(spec),
        "versions": {pkg: importlib.metadata.version(pkg) for pkg in _VERSIONED_PACKAGES},
    }
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    return f"{spec.name}-{digest[:12]}"


def _is_complete(model_dir: Path) -> bool:
    # Directories only ever appear via an atomic rename of a finished build.
    return (model_dir / "model_index.json").is_file()


def ensure(spec, cache_dir: str | Path | None = None) -> Path:
    """Return the directory of built-in model ``spec`` (a dataclass with ``name`` and ``build(dir)``),
    generating it on first use.

    Safe under concurrent callers: each builds into a private temporary
    sibling and atomically renames it into place; losers discard theirs.
    """
    root = Path(cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()
    target = root / _cache_key(spec)
    if _is_complete(target):
        return target

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=root))
    try:
        spec.build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700; the cache may be shared
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race; its copy is identical to ours.
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return target


def save_built(spec, make_pipeline: Callable[[], object], out_dir: str | Path, default_keys: Iterable[str]) -> Path:
    """``make_pipeline()`` under float32 and a forked RNG (neither leaks into the caller), stored in the spec's
    ``weights_dtype`` with the pipeline's own ``save_pretrained`` (model_index.json as a real checkpoint has
    it), then the request it serves by default as ``serving_defaults.json``."""
    import torch

    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.random.fork_rng(devices=[]):
            pipe = make_pipeline()
    finally:
        torch.set_default_dtype(default_dtype)
    if spec.weights_dtype != "float32":
        pipe.to(getattr(torch, spec.weights_dtype))
    out = Path(out_dir)
    from transformers.utils import logging as transformers_logging

    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # the text encoders' "Writing model shards": noise at a first start
    try:
        pipe.save_pretrained(out, safe_serialization=True)
    finally:
        if bars:
            transformers_logging.enable_progress_bar()
    defaults = {k: getattr(spec, k) for k in default_keys}
    (out / SERVING_DEFAULTS_FILE).write_text(json.dumps(defaults, indent=2, sort_keys=True) + "\n")
    coefficients = getattr(spec, "teacache_coefficients", None)
    if coefficients is not None:  # a family without a published TeaCache polynomial: the one fitted for its built-ins
        settings = {"teacache_coefficients": list(coefficients), "teacache_warmup": 1,
                    "source": f"fitted on the built-in {spec.TEACACHE_FITTED_ON} (random weights) by "
                              "bench/fit_teacache.py --degree 1"}
        (out / STEP_CACHE_FILE).write_text(json.dumps(settings, indent=2) + "\n")
    return out
