"""The builder of the built-in random-weight models, written once for every family.

A built-in's directory has exactly the layout of a real diffusers checkpoint of its family
(``model_index.json`` and one folder per component, written by the pipeline's own ``save_pretrained``), plus
``serving_defaults.json`` (the request it serves by default) and, for a family without a published TeaCache
polynomial, ``step_cache.json``; so the engine and the tests exercise the real ``from_pretrained`` loading
code without downloadable weights. Generation is deterministic: the same spec and library versions give
byte-identical files. The spec and the components come from the family's module in
:mod:`common.builtin.specs`; every component's weights are drawn by :func:`seeded`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from common.diffusion.model_info import SERVING_DEFAULTS_FILE, STEP_CACHE_FILE

if TYPE_CHECKING:
    import torch

# A component built as another class than the one that loads it, and the (library, class) model_index.json
# names for it, as the real checkpoint does: transformers' PIL image processor is built (CLIPImageProcessor
# itself is the torchvision one when torchvision is installed) so the saved files do not depend on whether
# it is; loading CLIPImageProcessor reads them.
SAVED_AS = {"CLIPImageProcessorPil": ("transformers", "CLIPImageProcessor"),
            # Qwen2VLProcessor without its (torchvision) video processor: common/families/qwen_image/processor.py.
            "ImageTextProcessor": ("transformers", "Qwen2VLProcessor"),
            # SigLIP's PIL image processor, saved under the class real checkpoints name (as CLIP's above).
            "SiglipImageProcessorPil": ("transformers", "SiglipImageProcessor")}


def component_seed(spec, component: str) -> int:
    digest = hashlib.sha256(f"{spec.seed}/{component}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def reinit_(module: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded normal noise.

    This makes the weights independent of the libraries' own init schemes
    (which change between versions and leave norm gains at exactly 1) and
    keeps activations O(1) through the stacks: matrices/kernels use
    std = 1/sqrt(fan_in), norm gains 1 + N(0, 0.1), other vectors
    N(0, 0.02). With a fixed std of 0.02 everywhere the decoded video is
    nearly flat and the prompt has no visible effect on it.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if param.ndim == 0:  # a scalar setting held as a parameter (LTX-2 VAE's timestep_scale_multiplier)
                continue
            if leaf == "gamma" or (param.ndim == 1 and leaf == "weight" and "norm" in name):
                param.copy_(1.0 + 0.1 * noise)
            elif param.ndim == 1:
                param.copy_(0.02 * noise)
            else:
                param.copy_(noise / math.sqrt(param[0].numel()))


def seeded(spec, component: str, make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``make()`` under the component's seed (from the spec's ``seed`` and the component's name), then its
    weights overwritten from that seed (:func:`reinit_`); every component with weights is made so."""
    import torch

    seed = component_seed(spec, component)
    torch.manual_seed(seed)
    model = make()
    reinit_(model, seed)
    return model.eval()


def assemble(pipeline: str, components: dict):
    """The diffusers pipeline class ``pipeline`` of ``components``, named in its model_index.json as the
    classes that load them (:data:`SAVED_AS`)."""
    import diffusers

    pipe = getattr(diffusers, pipeline)(**components)
    for name, component in components.items():
        entry = SAVED_AS.get(type(component).__name__)
        if entry is not None:
            pipe.register_to_config(**{name: entry})
    return pipe


def build(spec, out_dir: str | Path) -> Path:
    """Write the diffusers directory of ``spec`` into ``out_dir`` and return it: its family module's
    ``components(spec)`` in the spec's pipeline, made under float32 and a forked RNG (neither leaks into the
    caller), stored in the spec's ``weights_dtype``, then its serving defaults and step-cache settings."""
    import torch

    family = importlib.import_module(type(spec).__module__)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.random.fork_rng(devices=[]):
            pipe = assemble(spec.pipeline, family.components(spec))
    finally:
        torch.set_default_dtype(default_dtype)
    if spec.weights_dtype != "float32":
        pipe.to(getattr(torch, spec.weights_dtype))
    out = Path(out_dir)
    _save_quietly(pipe, out, spec)
    defaults = {k: getattr(spec, k) for k in spec.SERVING_DEFAULT_KEYS}
    (out / SERVING_DEFAULTS_FILE).write_text(json.dumps(defaults, indent=2, sort_keys=True) + "\n")
    coefficients = getattr(spec, "teacache_coefficients", None)
    if coefficients is not None:  # a family without a published TeaCache polynomial: the one fitted for its built-ins
        settings = {"teacache_coefficients": list(coefficients), "teacache_warmup": 1,
                    "source": f"fitted on the built-in {spec.TEACACHE_FITTED_ON} (random weights) by "
                              "bench/fit_teacache.py --degree 1"}
        (out / STEP_CACHE_FILE).write_text(json.dumps(settings, indent=2) + "\n")
    return out


def _save_quietly(pipe, out: Path, spec) -> None:
    from transformers.utils import logging as transformers_logging

    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # the text encoders' "Writing model shards": noise at a first start
    try:
        layout = {k: v for k in ("max_shard_size", "variant") if (v := getattr(spec, k, None)) is not None}
        pipe.save_pretrained(out, safe_serialization=True, **layout)
    finally:
        if bars:
            transformers_logging.enable_progress_bar()
