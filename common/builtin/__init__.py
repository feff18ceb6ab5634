"""The built-in random-weight models of every family, by name (``--model tiny-sd3``), and their cache.

One builder (:mod:`.build`) makes every family's from its spec module (:mod:`.specs`) and the shared
component factories; :mod:`.cache` keeps one directory per spec; ``python -m common.builtin NAME...`` writes
them. The runtime, placement, launch.py, disagg/ and the router resolve ``--model`` names here; the families
never import it.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from common.builtin.cache import ensure
from common.builtin.smooth_time import smooth_variants
from common.builtin.specs.flux import SPECS as FLUX_SPECS
from common.builtin.specs.flux_kontext import SPECS as FLUX_KONTEXT_SPECS
from common.builtin.specs.flux2_klein import SPECS as FLUX2_KLEIN_SPECS
from common.builtin.specs.hunyuan_video15 import SPECS as HUNYUAN_VIDEO15_SPECS
from common.builtin.specs.ltx2 import SPECS as LTX2_SPECS
from common.builtin.specs.qwen_image import SPECS as QWEN_IMAGE_SPECS
from common.builtin.specs.qwen_image_edit import SPECS as QWEN_IMAGE_EDIT_SPECS
from common.builtin.specs.sana import SPECS as SANA_SPECS
from common.builtin.specs.sd3 import SPECS as SD3_SPECS
from common.builtin.specs.wan import SPECS as WAN_SPECS
from common.builtin.specs.wan_i2v import SPECS as WAN_I2V_SPECS
from common.builtin.specs.z_image import SPECS as Z_IMAGE_SPECS

BUILTINS: dict = {**WAN_SPECS, **WAN_I2V_SPECS, **SD3_SPECS, **FLUX_SPECS, **QWEN_IMAGE_SPECS, **SANA_SPECS,
            **QWEN_IMAGE_EDIT_SPECS, **FLUX_KONTEXT_SPECS, **LTX2_SPECS,
            **Z_IMAGE_SPECS, **FLUX2_KLEIN_SPECS,
            **HUNYUAN_VIDEO15_SPECS}
# ``<name>-smooth``: the model with a timestep embedding that changes smoothly between steps, as a trained
# one's (common/builtin/smooth_time.py), for step caching.
SMOOTH_BASES = ("tiny", "small", "tiny-moe", "tiny-sd3", "small-sd3", "tiny-flux", "small-flux", "tiny-qwen-image",
                "small-qwen-image", "tiny-wan-i2v", "small-wan-i2v", "tiny-sana", "small-sana", "tiny-qwen-image-edit",
                "tiny-qwen-image-edit-plus", "tiny-flux-kontext", "tiny-ltx2", "tiny-ltx2-i2v", "small-ltx2",
                "tiny-z-image", "small-z-image", "tiny-flux2-klein", "small-flux2-klein", "tiny-hunyuan-video15",
                "tiny-hunyuan-video15-i2v", "small-hunyuan-video15")
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
