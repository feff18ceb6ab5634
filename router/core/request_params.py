"""A validated request body to the engine's :class:`GenerationParams`: the model's defaults filled in, then
the limits that depend on the engine's flags, the family and the model directory. Every failure names the
offending field (:class:`~router.api.schemas.FieldError`)."""

from __future__ import annotations

import math

from common.config.engine import Limits
from common.diffusion.binding import Binding
from common.diffusion.step_variants import step_variant
from common.diffusion import step_cache
from common.protocol.messages import CacheParams, GenerationParams, RolloutParams
from router.api.schemas import MAX_SEED, MEDIA_OUTPUTS, FieldError, GenerateBody, RolloutBody


def _check_size(name: str, value: int, multiple: int, maximum: int) -> None:
    if value < multiple or value % multiple:
        raise FieldError(name, f"must be a positive multiple of {multiple}, got {value}")
    if value > maximum:
        raise FieldError(name, f"must be at most {maximum}, got {value}")


def _check_schedule(name: str, values: list[float], lo: float, hi: float, max_len: int) -> None:
    if not 1 <= len(values) <= max_len:
        raise FieldError(name, f"must hold 1..{max_len} values, got {len(values)}")
    if any(not math.isfinite(v) or v < lo or v > hi for v in values):
        raise FieldError(name, f"values must be finite and within [{lo}, {hi}]")


FILLED = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")


def _filled(body: GenerateBody, defaults: dict) -> dict:
    """The fields that fall back to the model's serving defaults, filled in."""
    return {name: defaults[name] if getattr(body, name) is None else getattr(body, name) for name in FILLED}


def _check_prompts(body: GenerateBody, limits: Limits) -> None:
    for name in ("prompt", "negative_prompt"):
        if len(getattr(body, name) or "") > limits.max_prompt_chars:
            raise FieldError(name, f"longer than {limits.max_prompt_chars} characters")


def check_family_fields(body: GenerateBody, family: Binding) -> None:
    """A field the family's pipeline has no use for is refused, never ignored."""
    for name in ("num_frames", "guidance_scale_2", "max_sequence_length", "true_cfg_scale"):
        value = getattr(body, name)
        if value is None or name in family.fields or (name == "num_frames" and value == 1 and not family.video):
            continue
        what = "makes images: num_frames must be 1 or left out" if name == "num_frames" else f"takes no {name}"
        raise FieldError(name, f"{family.pipeline} {what}, got {value}")


def size_multiple(info) -> int:
    """What height and width must be multiples of on this model directory (``info``: its ModelInfo)."""
    return max(info.family.size_multiple, info.vae_scale_spatial * info.patch_size[-1])


def check_model_fields(body: GenerateBody, info) -> None:
    """The fields whose meaning depends on the model directory (``info``: its ModelInfo), not only its family."""
    family = info.family
    if body.mu is not None and not info.dynamic_shifting:
        raise FieldError("mu", f"this model's scheduler has no dynamic shifting (use_dynamic_shifting is false), "
                               f"so {family.pipeline} takes no mu")
    multiple = size_multiple(info)
    for name in ("height", "width"):  # e.g. Wan2.2 TI2V: a 16x VAE and 2x2 patches, so multiples of 32
        value = getattr(body, name)
        if value is not None and value % multiple:
            raise FieldError(name, f"must be a positive multiple of {multiple} for this model (its VAE's "
                                   f"{info.vae_scale_spatial}x times its {info.patch_size[-1]}x patches), got {value}")
    if info.scheduler_config.get("shift_terminal") and body.num_inference_steps == 1 and body.sigmas is None:
        # linspace(1, 1, 1) stretched to the terminal sigma divides 0 by 0 (diffusers gives NaN images).
        raise FieldError("num_inference_steps", "this model's scheduler stretches its schedule to shift_terminal, "
                                                "which needs at least 2 steps")
    if (body.guidance_scale is not None and family.cfg_field != "guidance_scale"
            and family.guidance.embedded(info, body.guidance_scale) is None):
        raise FieldError("guidance_scale", f"this {family.pipeline} transformer has no guidance embedding (its "
                                           "guidance_embeds is false); classifier-free guidance is true_cfg_scale "
                                           "with a negative_prompt")


def check_image_fields(body: GenerateBody, info) -> None:
    """``image`` and ``last_image`` as the model directory takes them (``info``: its ModelInfo): refused where
    it takes none, required where it cannot run without one. The images themselves: router/api/images.py."""
    family, takes = info.family, info.family.condition.image_input(info)
    if body.image is None and takes == "required":
        raise FieldError("image", f"this {family.pipeline} model makes videos from an image: give image "
                                  "(a base64 PNG, JPEG or WEBP, or a data: URL)")
    if body.image is not None and takes is None:
        raise FieldError("image", f"this {family.pipeline} model takes no image (it is not an image-to-video model)")
    fixed = family.text.fixed_length(info)
    if fixed is not None and body.max_sequence_length not in (None, fixed):
        raise FieldError("max_sequence_length", f"this {family.pipeline} model's attention takes exactly {fixed} "
                                                f"text tokens before its image tokens, got {body.max_sequence_length}")
    last = family.condition.last_image_input(info)
    if body.last_image is None and last == "required" and body.image is not None:
        raise FieldError("last_image", f"this {family.pipeline} model makes videos between two frames: give "
                                       "last_image too")
    if body.last_image is not None:
        if body.image is None:
            raise FieldError("last_image", "needs image (the first frame) too")
        if last is None:
            raise FieldError("last_image", f"this {family.pipeline} model has no first-last-frame conditioning")


def _true_cfg_scale(body: GenerateBody, defaults: dict, family: Binding | None) -> float | None:
    """The true-CFG scale in effect (families whose CFG is ``true_cfg_scale``): 1 without a negative prompt,
    as their pipelines; an explicit scale above 1 without one is refused rather than ignored."""
    if family is None or family.cfg_field != "true_cfg_scale":
        return None
    if body.negative_prompt is None:
        if body.true_cfg_scale is not None and body.true_cfg_scale > 1.0:
            raise FieldError("true_cfg_scale", f"{family.pipeline} runs true classifier-free guidance only with a "
                                               "negative_prompt; give one (it may be \" \")")
        return 1.0
    value = defaults.get("true_cfg_scale", 1.0) if body.true_cfg_scale is None else body.true_cfg_scale
    if not 0.0 <= value <= 100.0:
        raise FieldError("true_cfg_scale", f"must be within [0, 100], got {value}")
    return float(value)


def _check_video(v: dict, limits: Limits, family: Binding | None = None) -> None:
    multiple = 16 if family is None else family.size_multiple
    _check_size("height", v["height"], multiple, limits.max_height)
    _check_size("width", v["width"], multiple, limits.max_width)
    if family is not None and not family.video:
        return  # one frame: check_family_fields allows num_frames 1 only
    f = v["num_frames"]
    if f < 1 or (f - 1) % 4:
        raise FieldError("num_frames", f"must be of the form 4k+1, got {f}")
    if f > limits.max_num_frames:
        raise FieldError("num_frames", f"must be at most {limits.max_num_frames}, got {f}")


def _check_sampling(v: dict, body: GenerateBody, limits: Limits) -> None:
    steps = v["num_inference_steps"]
    if not 1 <= steps <= limits.max_steps:
        raise FieldError("num_inference_steps", f"must be within 1..{limits.max_steps}, got {steps}")
    for name, val in (("guidance_scale", v["guidance_scale"]), ("guidance_scale_2", body.guidance_scale_2)):
        if val is not None and not 0.0 <= val <= 100.0:
            raise FieldError(name, f"must be within [0, 100], got {val}")
    if body.n > limits.max_n:
        raise FieldError("n", f"must be within 1..{limits.max_n}, got {body.n}")
    if body.seed + body.n - 1 > MAX_SEED:
        raise FieldError("seed", "seed + n - 1 must fit in a signed 64-bit integer")


def _schedule_steps(body: GenerateBody, steps: int, limits: Limits, n_train: int) -> int:
    """The step count: a custom schedule's length, else ``steps``."""
    if body.sigmas is not None:
        _check_schedule("sigmas", body.sigmas, 0.0, 1.0, limits.max_steps)
        return len(body.sigmas)
    if body.timesteps is not None:
        _check_schedule("timesteps", body.timesteps, 0.0, float(n_train), limits.max_steps)
        return len(body.timesteps)
    return steps


def _check_timeout_and_mu(body: GenerateBody, limits: Limits) -> None:
    if body.timeout_s is not None and body.timeout_s > limits.request_timeout_s:
        raise FieldError("timeout_s", f"must be at most the engine's --request-timeout {limits.request_timeout_s}")
    if body.mu is not None and abs(body.mu) > 100:
        raise FieldError("mu", f"must be within [-100, 100], got {body.mu}")


def _rollout_params(body: RolloutBody, steps: int) -> RolloutParams:
    try:  # the SDE step's own rule (e.g. cps takes [0, 1]), so that no such request reaches a worker
        step_variant(body.sde_type, body.noise_level)
    except ValueError as e:
        raise FieldError("noise_level", str(e)) from None
    idx = body.sde_step_indices
    if idx is not None:
        if len(idx) > steps or len(set(idx)) != len(idx):
            raise FieldError("sde_step_indices", "must be distinct step indices")
        if any(i < 0 or i >= steps for i in idx):
            raise FieldError("sde_step_indices", f"indices must be within 0..{steps - 1}")
    return RolloutParams(
        sde_scheduler=body.rollout,
        sde_type=body.sde_type,
        noise_level=body.noise_level,
        sde_step_indices=sorted(idx) if idx is not None else None,
        return_trajectory=body.return_trajectory,
        return_log_probs=body.return_log_probs,
    )


def _max_sequence_length(body: GenerateBody, defaults: dict, family: Binding | None) -> int:
    length = body.max_sequence_length or defaults.get("max_sequence_length", 512)
    limit = 512 if family is None else family.max_sequence_length_limit
    if length > limit:
        raise FieldError("max_sequence_length", f"must be within 1..{limit}, got {length}")
    return length


def cache_params(body: GenerateBody, default: CacheParams | None) -> CacheParams | None:
    """The request's step caching: its ``cache`` (null: off), else the engine's default (--cache)."""
    if "cache" not in body.model_fields_set:
        return default
    if body.cache is None:
        return None
    method = body.cache.method
    threshold = body.cache.threshold
    if threshold is None:
        threshold = step_cache.METHODS[method].default_threshold
    problem = step_cache.threshold_problem(method, threshold)
    if problem:
        raise FieldError("cache.threshold", problem)
    return CacheParams(method=method, threshold=threshold)


def to_params(body: GenerateBody, defaults: dict, limits: Limits, n_train: int = 1000,
              family: Binding | None = None, cache: CacheParams | None = None) -> GenerationParams:
    """Fill model defaults and enforce the engine's limits (checked in this order). ``family``: the served
    model's binding (its fields, sizes, one frame for images); None checks as for a video family. ``cache``:
    the engine's default step caching."""
    if family is not None:
        check_family_fields(body, family)
    v = _filled(body, {"num_frames": 1, **defaults})
    _check_prompts(body, limits)
    _check_video(v, limits, family)
    if body.output_type == "png" and v["num_frames"] != 1:
        raise FieldError("output_type", f"png holds one frame: set num_frames to 1 (got {v['num_frames']}), or ask for mp4")
    _check_sampling(v, body, limits)
    steps = _schedule_steps(body, v["num_inference_steps"], limits, n_train)
    _check_timeout_and_mu(body, limits)
    length = _max_sequence_length(body, defaults, family)
    true_cfg = _true_cfg_scale(body, defaults, family)
    return GenerationParams(
        true_cfg_scale=true_cfg,
        max_sequence_length=length,
        rollout=_rollout_params(body, steps) if isinstance(body, RolloutBody) else None,
        prompt=body.prompt,
        negative_prompt=body.negative_prompt or "",
        height=v["height"],
        width=v["width"],
        num_frames=v["num_frames"],
        num_inference_steps=steps,
        guidance_scale=float(v["guidance_scale"]),
        guidance_scale_2=body.guidance_scale_2,
        seed=body.seed,
        n=body.n,
        output_type="frames" if body.output_type in MEDIA_OUTPUTS else body.output_type,
        lora_name=body.lora_name,
        lora_scale=body.lora_scale,
        sigmas=body.sigmas,
        timesteps=body.timesteps,
        mu=body.mu,
        cache=cache_params(body, cache),
    )
