"""The built-in random-weight models of every family, by name (``--model tiny-sd3``), and their cache."""

from __future__ import annotations

import difflib
from pathlib import Path

from common.diffusion.cache_signals import cache_problem
from common.families.flux.tiny_specs import SPECS as FLUX_SPECS
from common.families.qwen_image.tiny_specs import SPECS as QWEN_IMAGE_SPECS
from common.families.sd3.tiny_specs import SPECS as SD3_SPECS
from common.families.smooth_time import smooth_variants
from common.families.tiny_cache import ensure
from common.families.wan.tiny_specs import SPECS as WAN_SPECS
from common.families.wan_i2v.tiny_specs import SPECS as WAN_I2V_SPECS

BUILTINS: dict = {**WAN_SPECS, **WAN_I2V_SPECS, **SD3_SPECS, **FLUX_SPECS, **QWEN_IMAGE_SPECS}
# ``<name>-smooth``: the model with a timestep embedding that changes smoothly between steps, as a trained
# one's (common/families/smooth_time.py), for step caching.
SMOOTH_BASES = ("tiny", "small", "tiny-moe", "tiny-sd3", "small-sd3", "tiny-flux", "small-flux", "tiny-qwen-image",
                "small-qwen-image", "tiny-wan-i2v", "small-wan-i2v")
# Wan text-to-video's are smoother still: TeaCache4Wan2.1's published polynomial (fitted on the trained 1.3B)
# gives its reported speed-ups at thresholds 0.05-0.08 only where the modulated input moves about 1% per step
# (p(0.01) = 0.043, p(0.026) = 0.088); these move a median 1.3% (2.6% with the defaults). docs/operations.md.
WAN_T2V_SMOOTHER = dict(keep_rad=0.02, drop_rad=0.08)
BUILTINS.update(smooth_variants(BUILTINS, SMOOTH_BASES, {b: WAN_T2V_SMOOTHER for b in ("tiny", "small", "tiny-moe")}))


def ensure_builtin(name, cache_dir: str | Path | None = None) -> Path:
    """The directory of built-in model ``name`` (or of a spec object), generated on first use."""
    spec = BUILTINS.get(name) if isinstance(name, str) else name
    if spec is None:
        raise ValueError(f"unknown built-in model {name!r}; known: {sorted(BUILTINS)}")
    return ensure(spec, cache_dir)


class ModelNotFound(ValueError):
    """``--model`` names neither a built-in model nor a diffusers model directory."""


def resolve(name: str) -> Path:
    """A built-in model's directory (generated on first use), or ``name`` as a model directory. A name that
    is neither is refused saying whether the path exists, with the built-in names (and the closest ones)."""
    if name in BUILTINS:
        return ensure_builtin(name)
    path = Path(name).expanduser().resolve()
    if (path / "model_index.json").is_file():
        return path
    close = difflib.get_close_matches(name, list(BUILTINS), n=3)
    why = ("does not exist" if not path.exists() else "is not a directory" if not path.is_dir()
           else "has no model_index.json (not a diffusers model directory)")
    raise ModelNotFound(f"--model {name}: not a built-in model, and {path} {why}"
                        + (f"; did you mean {' or '.join(close)}?" if close else "")
                        + f" (built-in models: {', '.join(BUILTINS)})")


def layout_problem(info, workers, cache=None) -> str | None:
    """Why the model's (``info``: its ModelInfo) transformer cannot run the topology's denoise layouts
    (``workers``: the engine's WorkerSpecs), or serve the default step caching ``cache`` (--cache) on them;
    None: it can."""
    family = info.family
    if not family.transformer.context_parallel:
        for spec in workers:
            if spec.role == "denoise" and (spec.ulysses > 1 or spec.ring > 1):
                return (f"--topology: {family.pipeline}'s transformer has no context-parallel plan in diffusers, "
                        "so its denoise workers cannot use ulysses or ring (cfg works)")
    problem = None if cache is None else cache_problem(cache.method, family, workers, info)
    return problem and f"--cache: {problem}"
