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
from pathlib import Path

CACHE_ENV = "DISAGG_DIFFUSION_CACHE"
DEFAULT_CACHE_DIR = Path("~/.cache/disagg-diffusion")

# Bump when the builder changes in a way that changes its output, so that
# cached directories from an older builder are not reused.
_FORMAT_VERSION = 1
# Generation output depends on these packages (weights init, serialisation).
_VERSIONED_PACKAGES = ("torch", "diffusers", "transformers", "tokenizers")


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$DISAGG_DIFFUSION_CACHE``, else ``~/.cache/disagg-diffusion``."""
    return Path(cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()


def keyed_fields(spec) -> dict:
    """The spec fields that go into its cache key.

    Fields added after the first cached models existed (``later_field``)
    count only when they differ from their default, so the keys (directory
    names) of specs that leave them alone stay what they were.
    """
    out = dataclasses.asdict(spec)
    for f in dataclasses.fields(spec):
        if f.metadata.get("keyed_if_set") and getattr(spec, f.name) == f.default:
            del out[f.name]
    return out


def cache_key(spec) -> str:
    payload = {
        "format": _FORMAT_VERSION,
        "spec": keyed_fields(spec),
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
    root = cache_root(cache_dir)
    target = root / cache_key(spec)
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
