"""An SGLang ``RolloutRequest`` as the engine's own ``/rollout/generate`` body, and what its answer needs to know.

Pure: no HTTP and no I/O but reading ``image_path`` files (below an ``--image-root``). SGLang rolls out on its
pipeline's own scheduler grid (UniPC's for Wan, the flow-match Euler one elsewhere), so the native body asks for
``schedule: "serving"`` wherever the model's serving scheduler has flow-matching sigmas; its steps outside
``rollout_sde_step_indices`` are Euler steps, as the native ``ode_solver: "euler"``.
"""

from __future__ import annotations

import base64
import os
import secrets
from dataclasses import dataclass

from common.diffusion.model_info import ModelInfo
from common.diffusion.request_fields import declared
from common.diffusion.rollout_params import serving_has_flow_sigmas
from router.request.schemas import RolloutBody
from router.core.errors import FieldError
from router.peers.sglang.schemas import RolloutRequest

# Body fields only SGLang's RolloutRequest has: a body naming one is SGLang's, whatever the engine's --peer-api.
SGLANG_ONLY = frozenset({"generator_device", "num_outputs_per_prompt", "image_path", "suppress_logs",
                         "extra_sampling_params"})
# The native field each SGLang field becomes: a native check's error names the field the caller sent.
NATIVE_NAMES = {"n": "num_outputs_per_prompt", "sde_type": "rollout_sde_type", "noise_level": "rollout_noise_level",
                "sde_step_indices": "rollout_sde_step_indices", "trajectory_steps": "rollout_return_step_indices",
                "image": "image_path"}
NATIVE_FIELDS = frozenset(RolloutBody.model_fields)


def speaks_sglang(body: dict) -> bool:
    """Whether a ``/rollout/generate`` body is SGLang's by its fields (a body both could send is the engine's
    own unless it runs with ``--peer-api sglang``)."""
    return any(k in SGLANG_ONLY or k.startswith("rollout_") for k in body)


@dataclass(frozen=True)
class Plan:
    """What the answer is built from besides the native outcome."""

    seed: int
    steps: int  # T, the denoising steps
    rollout: bool
    sde_type: str
    noise_level: float
    no_const: bool
    dit_trajectory: bool
    return_steps: list[int] | None  # the trajectory entries asked for (None: all)
    peak_memory: bool


def native_body(req: RolloutRequest, info: ModelInfo, image_roots: list[str],
                max_image_bytes: int = 32 << 20, raw: dict | None = None) -> tuple[dict, Plan]:
    """The native body (a dict for :class:`RolloutBody`) of ``req`` and its :class:`Plan`; ``raw``: the body as
    sent, whose fields the served family declares (by name or alias) pass on, checked as the family checks them."""
    seed = req.seed if req.seed is not None else secrets.randbelow(2**31)  # answered: it reproduces the samples
    if req.rollout and req.rollout_sde_type != "ode" and not req.rollout_log_prob_no_const \
            and req.rollout_noise_level <= 0:
        raise FieldError("rollout_noise_level", "the full log-probability needs a noise level above 0 (or "
                                                "rollout_log_prob_no_const: true)")
    if req.rollout and req.rollout_sde_type == "ode" and not req.rollout_log_prob_no_const:
        raise FieldError("rollout_log_prob_no_const", "an ODE rollout has no log-probability density: set it true "
                                                      "(its log-probs are then 0)")
    body: dict = {"prompt": req.prompt, "seed": seed, "output_type": "frames", "rollout": req.rollout}
    for name in ("negative_prompt", "width", "height", "num_inference_steps", "guidance_scale", "num_frames"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.num_outputs_per_prompt is not None:
        body["n"] = req.num_outputs_per_prompt
    for key, value in {**(raw or {}), "fps": req.fps}.items():  # the family's own fields SGLang's body carries
        field = declared(info.family.request_fields, key)
        if field is not None and value is not None and key not in NATIVE_FIELDS:
            body[field.name] = float(value) if field.type is float and isinstance(value, int) else value
    if req.rollout:
        body.update(sde_type=req.rollout_sde_type, noise_level=req.rollout_noise_level, return_trajectory=True,
                    schedule="serving" if serving_has_flow_sigmas(info) else "rollout",
                    return_conditioning=req.rollout_return_denoising_env)
        if req.rollout_sde_type == "ode":  # every step the Euler step: no SDE step, log-probs all 0
            body.update(sde_type="sde", sde_step_indices=[])
        elif req.rollout_sde_step_indices is not None:
            body["sde_step_indices"] = req.rollout_sde_step_indices
        # The trajectory's entries asked for; [] still answers the schedule, which the log-probs' conversion reads.
        body["trajectory_steps"] = ([] if not req.rollout_return_dit_trajectory
                                    else req.rollout_return_step_indices)
        if body["trajectory_steps"] is None:
            del body["trajectory_steps"]
    if req.image_path is not None:
        images = [read_image(path, f"image_path.{i}", image_roots, max_image_bytes)
                  for i, path in enumerate(req.image_path)]
        body["image"] = images[0] if len(images) == 1 else images
    for key, value in (req.extra_sampling_params or {}).items():  # as SGLang: they override, rollout stays
        if key not in NATIVE_FIELDS and declared(info.family.request_fields, key) is None:
            raise FieldError(f"extra_sampling_params.{key}", "not a field of this engine's /rollout/generate for "
                                                              "this model (docs/api.md)")
        if key != "rollout":
            body[key] = value
    steps = len(body["sigmas"]) if body.get("sigmas") else len(body["timesteps"]) if body.get("timesteps") \
        else body.get("num_inference_steps") or info.defaults["num_inference_steps"]
    # The step that runs (extra_sampling_params may name another): its log-probs' convention follows it.
    sde_type = "ode" if req.rollout_sde_type == "ode" else body.get("sde_type", req.rollout_sde_type)
    plan = Plan(seed=body.get("seed", seed), steps=steps, rollout=req.rollout, sde_type=sde_type,
                noise_level=body.get("noise_level", req.rollout_noise_level), no_const=req.rollout_log_prob_no_const,
                dit_trajectory=req.rollout and req.rollout_return_dit_trajectory,
                return_steps=req.rollout_return_step_indices, peak_memory=not req.suppress_logs)
    return body, plan


def read_image(path: str, field: str, roots: list[str], max_bytes: int) -> str:
    """An ``image_path`` file's bytes (base64) when it lies below an ``--image-root`` (symlinks resolved)."""
    if not roots:
        raise FieldError(field, "this engine reads no image files: start it with --image-root DIR, or send the "
                                "image itself in extra_sampling_params.image (base64)")
    if "\x00" in path or not os.path.isabs(path):
        raise FieldError(field, f"must be an absolute path, got {path!r}")
    real = os.path.realpath(path)
    if not any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots):
        raise FieldError(field, f"{path} is outside the allowed image directories: {', '.join(roots)}")
    try:
        with open(real, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise FieldError(field, f"cannot read {path}: {e.strerror}") from None
    if len(data) > max_bytes:
        raise FieldError(field, f"{path} exceeds --max-image-bytes ({max_bytes})")
    return base64.b64encode(data).decode("ascii")


def sglang_field(field: str, info: ModelInfo | None = None) -> str:
    """The SGLang name of a native field a check refused (its first part: ``sde_step_indices.0``; a family's
    field by the alias SGLang knows it by)."""
    head, _, rest = field.partition(".")
    own = declared(info.family.request_fields, head) if info is not None else None
    name = NATIVE_NAMES.get(head) or next((a for a in (own.aliases if own else ()) if a in RolloutRequest.model_fields),
                                          head)
    return f"{name}.{rest}" if rest else name

