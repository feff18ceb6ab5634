"""The limits a running engine enforces on request bodies, as JSON-schema keywords for ``/openapi.json``.

What does not depend on the engine is in the body models themselves (router/request/schemas.py); what its flags
(``--max-n``, ``--max-steps``, sizes, ``--request-timeout``, ``--max-lora-rank``) and its model directory (the
size multiple, the fields the family takes, images, dynamic shifting) decide is said here, by body model
(its schema's ``title``) and property; the family's own fields are ``added`` (the bodies take no other
field). The checks (common/diffusion/params.py) stay the authority;
these facts say the same thing to clients and fuzzers.
"""

from __future__ import annotations

from pathlib import Path
from typing import get_args

from common.config.engine import EngineConfig
from common.diffusion.cache_signals import cache_problem
from common.diffusion.model_info import ModelInfo
from common.protocol.messages import CacheMethod
from router.core.engine import served_model_id
from router.api.media import MEDIA_TYPES, file_types
from router.request.schemas import HttpOutputType
from router.core.request_params import makes_sound, max_images
from common.diffusion.params import OWN_SLOTS, size_multiple
from router.api.openapi import constrain

NULL_ONLY = {"type": "null"}  # a field this model refuses whatever its value: only null (or left out)
MAX_ENUM = 256  # the most values an enum may list; past it the schema says less (a pattern, bounds)


def _frames(config: EngineConfig, info: ModelInfo) -> list[int]:
    if not info.family.video:
        return [1]
    return list(range(1, config.limits.max_num_frames + 1, info.vae_scale_temporal))  # (Wan 4k+1, LTX-2 8k+1)


def _sizes(multiple: int, config: EngineConfig) -> dict:
    """``"WIDTHxHEIGHT"`` (the OpenAI fields): an enum while the engine takes few sizes, else a pattern."""
    widths = range(multiple, config.limits.max_width + 1, multiple)
    heights = range(multiple, config.limits.max_height + 1, multiple)
    if len(widths) * len(heights) <= MAX_ENUM:
        return {"enum": [f"{w}x{h}" for h in heights for w in widths]}
    return {"pattern": "^[1-9][0-9]*[xX][1-9][0-9]*$"}


def _edit_sizes(sizes: dict) -> dict:
    """An edit's ``size``: one of ``sizes``, or auto (the model's size for the images)."""
    if "enum" in sizes:
        return {"enum": ["auto", *sizes["enum"]]}
    return {"pattern": "^(auto|[1-9][0-9]*[xX][1-9][0-9]*)$"}


def _seconds(info: ModelInfo, frames: list[int]) -> dict:
    values = [f"{(f - 1) / info.fps:g}" for f in frames if f > 1]
    return {"enum": values} if 0 < len(values) <= MAX_ENUM else {"pattern": "^[0-9]*\\.?[0-9]+$"}


def _generation(config: EngineConfig, info: ModelInfo) -> dict[str, dict]:
    """The fields every generation body shares (/generate, /rollout/generate, images, videos)."""
    limits, family = config.limits, info.family
    fixed = family.text.fixed_length(info)
    methods = [m for m in get_args(CacheMethod) if cache_problem(m, family, config.workers, info) is None]
    facts = {
        "prompt": {"maxLength": limits.max_prompt_chars},
        "negative_prompt": {"maxLength": limits.max_prompt_chars},
        "num_inference_steps": {"minimum": 2 if info.scheduler_config.get("shift_terminal") else 1,
                                "maximum": limits.max_steps},
        "n": {"maximum": limits.max_n},
        "timeout_s": {"maximum": limits.request_timeout_s},
        "cache": {"properties": {"method": {"enum": methods}}} if methods else NULL_ONLY,
    }
    length = next((f for f in family.request_fields if f.name == "max_sequence_length"), None)
    facts["max_sequence_length"] = NULL_ONLY if length is None else {"enum": [fixed]} if fixed \
        else {"maximum": length.maximum}
    if family.cfg_field != "guidance_scale" and family.guidance.embedded(info, 1.0) is None:
        facts["guidance_scale"] = NULL_ONLY
    if not info.dynamic_shifting:
        facts["mu"] = NULL_ONLY
    if family.condition.image_input(info) is None:
        facts["image"] = NULL_ONLY
    else:
        facts["image"] = {"maxItems": max_images(info)}  # a list: as many as the model takes
    if family.condition.last_image_input(info) is None:
        facts["last_image"] = NULL_ONLY
    facts["num_frames"] = {"enum": _frames(config, info)}
    return facts


def family_properties(info: ModelInfo) -> dict[str, dict]:
    """The served family's own fields (its binding's ``request_fields`` beyond GenerationParams' own slots) as
    schema properties; one this model directory refuses (e.g. a second expert's guidance on one expert): null."""
    out = {}
    for field in info.family.request_fields:
        if field.name not in OWN_SLOTS:
            refused = field.model_check is not None and field.model_check(info) is not None
            out[field.name] = constrain(field.json_schema(), NULL_ONLY) if refused else field.json_schema()
    return out


def body_facts(config: EngineConfig, info: ModelInfo) -> dict[str, dict]:
    """Body model title -> what this engine adds to its schema: ``properties`` (property -> JSON-schema
    keywords, merged into its non-null form; ``NULL_ONLY``: refused whatever its value) and ``required``."""
    limits, multiple = config.limits, size_multiple(info)
    common = _generation(config, info)
    steps = {"maxItems": limits.max_steps}
    # A model that snaps sizes takes any within the bounds (the multiple rule holds for the snapped size).
    step = {"minimum": 1} if info.family.latents.snaps_sizes else {"minimum": multiple, "multipleOf": multiple}
    native = {
        **common,
        "height": {**step, "maximum": limits.max_height},
        "width": {**step, "maximum": limits.max_width},
        "sigmas": steps,
        "timesteps": {**steps, "items": {"maximum": float(info.num_train_timesteps)}},
        # wav (the sound alone) from a model that makes sound only
        "output_type": {"enum": [t for t in get_args(HttpOutputType)
                                 if t not in MEDIA_TYPES or t in file_types(makes_sound(info))]},
    }
    openai = {**common, "size": _sizes(multiple, config), "model": {"enum": [served_model_id(Path(info.path))]}}
    rank = {"properties": {"rank": {"maximum": limits.max_lora_rank}}}
    added = family_properties(info)
    window = {"sde_window_size": {"maximum": limits.max_steps},
              "sde_window_range": {"items": {"maximum": limits.max_steps}}}
    facts = {"GenerateBody": {"properties": native, "added": added},
             "RolloutBody": {"properties": {**native, "sde_step_indices": steps, **window}, "added": added},
             "ImagesBody": {"properties": openai, "added": added},
             "EditsBody": {"properties": {**openai, "size": _edit_sizes(openai["size"])}, "added": added},
             "VideoBody": {"properties": {**openai, "seconds": _seconds(info, common["num_frames"]["enum"])},
                           "added": added},
             "LoadLoraTensorsBody": rank, "LoraFromMemoryBody": rank}
    if info.family.condition.image_input(info) == "required":
        for title in ("GenerateBody", "RolloutBody", "VideoBody"):
            facts[title]["required"] = ["prompt", "image"]
    return facts
