"""A request's diffusers pipeline call, for any family: the engine's request fields by the names the pipeline's
``__call__`` takes (the family's own fields travel under the pipeline's own names), its image(s), a CPU
generator of the request's seed. What the family's request fields name otherwise (LTX-2's ``stg_block``) is
translated here once, the only place that names one."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import torch

from common.protocol.messages import GenerationParams
from family_harness import negative_for

# Request fields the engine keeps by another name than the pipeline's argument.
TRANSLATED = {"stg_block": lambda v: {"spatio_temporal_guidance_blocks": [int(v)]}}
# Engine-only fields (the sampling plan, not the pipeline's arguments).
ENGINE_ONLY = {"seed", "n", "seeds", "output_type", "fields", "sigmas", "sigmas_as_given", "timesteps", "mu",
               "rollout", "lora_name", "lora_scale", "cache", "deadline", "stream"}


def pipeline_for(model_dir: Path):
    """The directory's diffusers pipeline in float32, laid out as the engine lays out its components
    (``conftest.reference_pipeline``); a Qwen-VL ``processor`` (the edit pipelines') loaded as the engine loads it,
    since transformers' own class needs torchvision."""
    import diffusers

    from common.families import read_model
    from common.families.qwen_image.processor import load_processor

    cls = getattr(diffusers, read_model(model_dir).family.pipeline)
    given = {}
    if "processor" in inspect.signature(cls.__init__).parameters and (model_dir / "processor").is_dir():
        given["processor"] = load_processor(model_dir)
    from conftest import reference_pipeline

    return reference_pipeline(cls.from_pretrained(model_dir, dtype=torch.float32, **given))


def pipeline_call(pipe, info, p: GenerationParams, images: dict | None = None) -> dict:
    """The keyword arguments of ``pipe(...)`` that make request ``p`` (``images``: ``image``, ``last_image``: PIL
    images, or lists of them)."""
    takes = inspect.signature(pipe.__call__).parameters
    values = {k: getattr(p, k) for k in GenerationParams.__struct_fields__ if k not in ENGINE_ONLY}
    values.update(p.fields)
    call = {}
    for name, value in values.items():
        if value is None:
            continue
        if name in TRANSLATED:
            call.update(TRANSLATED[name](value))
        elif name in takes:
            call[name] = value
    if "negative_prompt" in call and negative_for(info, call["negative_prompt"]) is None:
        del call["negative_prompt"]
    call.update({k: v for k, v in (images or {}).items() if k in takes})
    call["generator"] = torch.Generator("cpu").manual_seed(p.seed)
    return call


def pipeline_outputs(pipe, info, p: GenerationParams, images: dict | None = None, output_type: str = "latent"):
    """The pipeline's output for request ``p``: its first sample's latents (``"latent"``) or frames as floats in
    [0, 1], [F, H, W, 3] (``"np"``)."""
    out = pipe(**pipeline_call(pipe, info, p, images), output_type=output_type)
    got = getattr(out, "frames", None)
    if got is None:
        got = out.images
    first = got[0] if isinstance(got, (list, tuple)) else got[0]
    first = torch.from_numpy(np.asarray(first)) if not isinstance(first, torch.Tensor) else first
    if output_type == "np" and first.ndim == 3:  # an image: one frame
        first = first[None]
    return first.float()
