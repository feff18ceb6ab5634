"""A request's fields to the engine's :class:`GenerationParams`: the one conversion the router and a trainer
(``rl.TrainerPolicy.params``) both call.

A request is a dict of the fields given (a key left out, or None: the model's default). The model's serving
defaults are filled in; then come, in this order, the checks that depend on the family (the fields it
declares, :attr:`Binding.request_fields`), on the model directory (:class:`ModelInfo`) and on the engine's
limits (``limits``: ``common.config.engine.Limits`` or anything with its attributes, passed in as values).
Every failure is a :class:`FieldError` naming the offending field. Pure: no HTTP, no I/O.
"""

from __future__ import annotations

import math

from common.diffusion import step_cache
from common.diffusion.field_error import FieldError
from common.diffusion.model_info import ModelInfo
from common.diffusion.request_fields import FROM_MODEL, RequestField
from common.diffusion.rollout_params import MAX_SEED, ROLLOUT, WINDOW, rollout_params
from common.protocol.messages import CacheParams, GenerationParams

FILLED = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")
# The fields every family takes (image, last_image, timeout_s, return_partial: the router's), and those that
# are GenerationParams' own but taken only by the families that declare them.
COMMON = frozenset({"prompt", "negative_prompt", "height", "width", "num_inference_steps", "guidance_scale",
                    "seed", "n", "seeds", "sigmas", "sigmas_as_given", "timesteps", "mu", "output_type",
                    "lora_name", "lora_scale", "cache",
                    "timeout_s", "image", "last_image", "return_partial", "initial_latents", "output_dtype", "stream",
                    *ROLLOUT, *WINDOW})
OWN_SLOTS = ("num_frames", "max_sequence_length")


def size_multiple(info: ModelInfo) -> int:
    """What height and width must be multiples of on this model directory, as its pipeline asks: whole patches
    of whole latent pixels, its VAE's scale times its patches (diffusers' ``height % (vae_scale_factor *
    patch_size)``, or the 2x2 packing's ``vae_scale_factor * 2``), and the family's own fixed rule where its
    pipeline has one (:attr:`Binding.size_multiple`). A size the pipeline would round down (with a warning) is
    refused: the engine makes the size asked."""
    return math.lcm(info.family.size_multiple, info.vae_scale_spatial * info.patch_size[-1])


def check_size(name: str, value: int, info: ModelInfo, maximum: int) -> None:
    multiple = size_multiple(info)
    if value < multiple or value % multiple:
        cells = info.vae_scale_spatial * info.patch_size[-1]
        why = f"this model's VAE's {info.vae_scale_spatial}x times its {info.patch_size[-1]}x patches" \
            if cells == multiple else f"{info.family.pipeline} takes multiples of {info.family.size_multiple}"
        raise FieldError(name, f"must be a positive multiple of {multiple}, got {value} ({why})")
    if value > maximum:
        raise FieldError(name, f"must be at most {maximum}, got {value}")


def check_family_fields(request: dict, info: ModelInfo) -> None:
    """A field the family's pipeline (or this model directory) has no use for is refused, never ignored."""
    family, declared = info.family, {f.name: f for f in info.family.request_fields}
    for name, value in request.items():
        if name in COMMON or value is None:
            continue
        field = declared.get(name)
        if field is None:
            if name == "num_frames" and value == 1 and not family.video:
                continue
            what = "makes images: num_frames must be 1 or left out" if name == "num_frames" else f"takes no {name}"
            raise FieldError(name, f"{family.pipeline} {what}, got {value!r}")
        problem = field.problem(value) or (field.model_check(info) if field.model_check else None)
        if problem:
            raise FieldError(name, problem)


def check_model_fields(request: dict, info: ModelInfo) -> None:
    """The common fields whose meaning depends on the model directory, not only its family."""
    family = info.family
    if request.get("mu") is not None and not info.dynamic_shifting:
        raise FieldError("mu", f"this model's scheduler has no dynamic shifting (use_dynamic_shifting is false), "
                               f"so {family.pipeline} takes no mu")
    if (info.scheduler_config.get("shift_terminal") and request.get("num_inference_steps") == 1
            and request.get("sigmas") is None):
        # linspace(1, 1, 1) stretched to the terminal sigma divides 0 by 0 (diffusers gives NaN images).
        raise FieldError("num_inference_steps", "this model's scheduler stretches its schedule to shift_terminal, "
                                                "which needs at least 2 steps")
    refused = family.guidance.refusal(info, request)
    if refused is not None:
        raise FieldError(*refused)
    g = request.get("guidance_scale")
    if g is not None and family.cfg_field != "guidance_scale" and family.guidance.embedded(info, g) is None:
        raise FieldError("guidance_scale", f"this {family.pipeline} transformer has no guidance embedding (its "
                                           f"guidance_embeds is false); classifier-free guidance is "
                                           f"{family.cfg_field} with a negative_prompt")


def check_images(request: dict, info: ModelInfo) -> None:
    """``image`` (one, or a list on models that take several) and ``last_image`` as the model directory takes
    them: refused where it takes none, required where it cannot run without one (the images themselves: the
    router's)."""
    family, condition = info.family, info.family.condition
    takes, last, most = condition.image_input(info), condition.last_image_input(info), condition.images_allowed(info)
    image, last_image = request.get("image"), request.get("last_image")
    if isinstance(image, list):
        if not image:
            raise FieldError("image", "an empty list: give one image, or a list of images")
        if len(image) > 1 and most <= 1:
            raise FieldError("image", f"this {family.pipeline} model takes one image, got a list of {len(image)}")
        if len(image) > most:
            raise FieldError("image", f"this {family.pipeline} model takes at most {most} images, got {len(image)}")
        if last_image is not None:
            raise FieldError("last_image", "goes with one image, not a list")
    if image is None and takes == "required":
        what = "makes videos from an image: give image" if family.video else "edits images: give image"
        raise FieldError("image", f"this {family.pipeline} model {what} (a base64 PNG, JPEG or WEBP, or a "
                                  "data: URL)")
    if image is not None and takes is None:
        raise FieldError("image", f"this {family.pipeline} model takes no image (it makes {'videos' if family.video else 'images'} "
                                  "from text)")
    if image is None:
        for field in family.request_fields:
            if field.needs_image and request.get(field.name) is not None:
                raise FieldError(field.name, f"{family.pipeline} takes {field.name} with an image only")
    if last_image is None and last == "required" and image is not None:
        raise FieldError("last_image", f"this {family.pipeline} model makes videos between two frames: give "
                                       "last_image too")
    if last_image is not None:
        if image is None:
            raise FieldError("last_image", "needs image (the first frame) too")
        if last is None:
            raise FieldError("last_image", f"this {family.pipeline} model has no first-last-frame conditioning")
        frames = request.get("num_frames") or info.defaults.get("num_frames", 1)
        if frames < 2:  # (the pipeline's frames between the two would be -1)
            raise FieldError("num_frames", f"a video from image to last_image has two frames or more, got {frames}")


def _check_schedule(name: str, values: list[float], lo: float, hi: float, max_len: int) -> None:
    if not 1 <= len(values) <= max_len:
        raise FieldError(name, f"must hold 1..{max_len} values, got {len(values)}")
    if any(not math.isfinite(v) or v < lo or v > hi for v in values):
        raise FieldError(name, f"values must be finite and within [{lo}, {hi}]")


def _check_video(v: dict, info: ModelInfo, limits, fields: dict) -> None:
    # The multiple rule holds for the size the latents are made at (LatentsPart.size: a pipeline that snaps
    # sizes takes any requested one), the bounds for both.
    made = info.family.latents.size(info, v["height"], v["width"], fields)
    for name, asked, at, maximum in (("height", v["height"], made[0], limits.max_height),
                                     ("width", v["width"], made[1], limits.max_width)):
        check_size(name, at, info, maximum)
        if asked != at and not 1 <= asked <= maximum:
            raise FieldError(name, f"must be within 1..{maximum}, got {asked}")
    if not info.family.video:
        return  # one frame: check_family_fields allows num_frames 1 only
    f, k = v["num_frames"], info.vae_scale_temporal  # the VAE's frames per latent frame (Wan 4, LTX-2 8)
    if f < 1 or (f - 1) % k:
        raise FieldError("num_frames", f"must be of the form {k}k+1, got {f}")
    if f > limits.max_num_frames:
        raise FieldError("num_frames", f"must be at most {limits.max_num_frames}, got {f}")


def _seeds(request: dict) -> tuple[int, int, list[int] | None]:
    """(seed, n, seeds): ``seeds``, one per sample, set n (an n given must agree) and seed (its first)."""
    seeds, n = request.get("seeds"), request.get("n", 1)
    if seeds is None:
        return request.get("seed", 0), n, None
    if not isinstance(seeds, list) or not seeds:
        raise FieldError("seeds", "must be a list of seeds, one per sample")
    if any(not isinstance(s, int) or isinstance(s, bool) or not 0 <= s <= MAX_SEED for s in seeds):
        raise FieldError("seeds", "each must be an integer in [0, 2^63 - 1]")
    if n not in (1, len(seeds)):
        raise FieldError("seeds", f"holds {len(seeds)} seeds for n = {n} samples: give one per sample")
    if len(set(seeds)) != len(seeds):
        raise FieldError("seeds", "must be distinct (a repeated seed repeats its sample)")
    if request.get("seed") not in (None, 0, seeds[0]):
        raise FieldError("seed", "give seed or seeds, not both")
    return seeds[0], len(seeds), seeds


def _check_sampling(v: dict, request: dict, limits) -> None:
    steps, n, seed = v["num_inference_steps"], request.get("n", 1), request.get("seed", 0)
    if not 1 <= steps <= limits.max_steps:
        raise FieldError("num_inference_steps", f"must be within 1..{limits.max_steps}, got {steps}")
    if not 0.0 <= v["guidance_scale"] <= 100.0:
        raise FieldError("guidance_scale", f"must be within [0, 100], got {v['guidance_scale']}")
    if not 1 <= n <= limits.max_n:
        raise FieldError("n", f"must be within 1..{limits.max_n}, got {n}")
    if not 0 <= seed or seed + n - 1 > MAX_SEED:
        raise FieldError("seed", "seed + n - 1 must fit in a signed 64-bit integer")


def _schedule_steps(request: dict, steps: int, limits, n_train: int) -> int:
    """The step count: a custom schedule's length, else ``steps``."""
    if request.get("sigmas") is not None:
        _check_schedule("sigmas", request["sigmas"], 0.0, 1.0, limits.max_steps)
        return len(request["sigmas"])
    if request.get("timesteps") is not None:
        _check_schedule("timesteps", request["timesteps"], 0.0, float(n_train), limits.max_steps)
        return len(request["timesteps"])
    return steps


def _as_given(request: dict, info: ModelInfo) -> bool:
    """``sigmas_as_given``: with sigmas, on a flow-match Euler schedule (the rollout's, or a serving scheduler of
    that class); a scheduler that derives its own grid from sigmas would not hold them as given."""
    if not request.get("sigmas_as_given"):
        return False
    if request.get("sigmas") is None:
        raise FieldError("sigmas_as_given", "needs sigmas")
    on_rollout = request.get("rollout", True) is not False and request.get("schedule", "rollout") == "rollout" \
        and any(request.get(k) is not None for k in ROLLOUT + WINDOW)
    serving = str(info.scheduler_config.get("_class_name", ""))
    if not on_rollout and not serving.startswith("FlowMatch"):
        raise FieldError("sigmas_as_given", f"{serving} derives its own grid from sigmas; use a flow-match Euler "
                                            "schedule (a rollout's default schedule)")
    return True


def _check_timeout_and_mu(request: dict, limits) -> None:
    timeout_s, mu = request.get("timeout_s"), request.get("mu")
    if timeout_s is not None and timeout_s > limits.request_timeout_s:
        raise FieldError("timeout_s", f"must be at most the engine's --request-timeout {limits.request_timeout_s}")
    if mu is not None and abs(mu) > 100:
        raise FieldError("mu", f"must be within [-100, 100], got {mu}")


def _max_sequence_length(request: dict, info: ModelInfo) -> int:
    length = request.get("max_sequence_length") or info.defaults.get("max_sequence_length", 512)
    fixed = info.family.text.fixed_length(info)
    if fixed is not None and length != fixed:
        raise FieldError("max_sequence_length", f"this {info.family.pipeline} model's attention takes exactly "
                                                f"{fixed} text tokens before its image tokens, got {length}")
    declared = {f.name: f for f in info.family.request_fields}.get("max_sequence_length")
    limit = 512 if declared is None else declared.maximum
    if length > limit:
        raise FieldError("max_sequence_length", f"must be within 1..{limit}, got {length}")
    return length


def _value(field: RequestField, request: dict, info: ModelInfo):
    """A declared field's value in effect (None: the request has none)."""
    value = request.get(field.name)
    if value is None:
        value = info.defaults.get(field.name) if field.default == FROM_MODEL else field.default
    if field.resolve is not None and value is not None:
        try:
            value = field.resolve(value, request)
        except ValueError as e:
            raise FieldError(field.name, f"{info.family.pipeline} {e}") from None
    return value


def family_values(request: dict, info: ModelInfo) -> dict:
    """The family's own fields (those outside GenerationParams' own slots), with their defaults and checks."""
    out = {}
    for field in info.family.request_fields:
        if field.name in OWN_SLOTS:
            continue
        value = _value(field, request, info)
        if value is not None:
            problem = field.problem(value)
            if problem:
                raise FieldError(field.name, problem)
            out[field.name] = float(value) if field.type is float else value
    return out


def cache_params(request: dict, default: CacheParams | None) -> CacheParams | None:
    """The request's step caching: its ``cache`` (a dict; None: off), else the engine's default (--cache)."""
    if "cache" not in request:
        return default
    if request["cache"] is None:
        return None
    method, threshold = request["cache"]["method"], request["cache"].get("threshold")
    if threshold is None:
        threshold = step_cache.METHODS[method].default_threshold
    problem = step_cache.threshold_problem(method, threshold)
    if problem:
        raise FieldError("cache.threshold", problem)
    return CacheParams(method=method, threshold=threshold)


def to_params(request: dict, info: ModelInfo, limits, cache: CacheParams | None = None,
              image_sizes: list[tuple[int, int]] | None = None) -> GenerationParams:
    """``request`` (field -> value) as the params every stage reads, every check done (in the order of the
    module docstring). A rollout is a request with any of the rollout fields; ``cache``: the engine's default
    step caching. ``output_type`` is the wire's (frames or latent). ``image_sizes``: the request's images'
    (width, height), in order, where the model's output size follows them (image editing)."""
    check_family_fields(request, info)
    check_model_fields(request, info)
    fields = family_values(request, info)
    d = {"num_frames": 1, **info.defaults}
    from_images = info.family.condition.default_size(info, image_sizes or [], fields)
    if from_images is not None:  # each of height and width the request leaves out, as the edit pipelines
        d["height"], d["width"] = from_images
    v = {name: d[name] if request.get(name) is None else request[name] for name in FILLED}
    for name in ("prompt", "negative_prompt"):
        if len(request.get(name) or "") > limits.max_prompt_chars:
            raise FieldError(name, f"longer than {limits.max_prompt_chars} characters")
    try:
        _check_video(v, info, limits, fields)
    except FieldError as e:
        if from_images is None or request.get(e.field) is not None:
            raise
        raise FieldError(e.field, f"{e.message} (the size this model takes from the image's aspect: give height "
                                  "and width)") from None
    seed, n, seeds = _seeds(request)
    _check_sampling(v, {**request, "seed": seed, "n": n}, limits)
    steps = _schedule_steps(request, v["num_inference_steps"], limits, info.num_train_timesteps)
    _check_timeout_and_mu(request, limits)
    length = _max_sequence_length(request, info)
    rollout = any(request.get(k) is not None for k in ROLLOUT + WINDOW)
    return GenerationParams(
        prompt=request["prompt"],
        negative_prompt=request.get("negative_prompt") or "",
        height=v["height"],
        width=v["width"],
        num_frames=v["num_frames"],
        num_inference_steps=steps,
        guidance_scale=float(v["guidance_scale"]),
        seed=seed,
        n=n,
        seeds=seeds,
        stream=bool(request.get("stream")),
        output_type=request.get("output_type") or "frames",
        fields=fields,
        sigmas=request.get("sigmas"),
        sigmas_as_given=_as_given(request, info),
        timesteps=request.get("timesteps"),
        mu=request.get("mu"),
        rollout=rollout_params(request, steps, info) if rollout else None,
        lora_name=request.get("lora_name"),
        lora_scale=request.get("lora_scale", 1.0),
        max_sequence_length=length,
        # A shared prefix runs without the engine's default step caching (a request's own is refused).
        cache=None if rollout and request.get("share_prefix") else cache_params(request, cache),
    )
