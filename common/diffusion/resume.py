"""Resuming a rollout: a request that starts from given latents instead of its drawn initial noise.

A trainer whose rollout was aborted (a partial answer: ``steps_done`` = k, the trajectory's latents x_0..x_k)
sends x_k as ``initial_latents`` with the rest of the schedule (``sigmas[k:]``); the request then denoises from
there. The latents are checked here, once, against the request's latent layout (the family's, for its size and
frames), so that a bad tensor is a 400 naming the field, never a worker's failure. Pure: no HTTP, no I/O.
"""

from __future__ import annotations

from typing import Any

import torch

from common.diffusion.model_info import ModelInfo
from common.diffusion.params import FieldError
from common.protocol.errors import RequestError
from common.protocol.codec import DTYPE_NAMES, DTYPES
from common.protocol.http_tensors import body_to_tensor
from common.protocol.messages import INITIAL_LATENTS, GenerationParams

FIELD = INITIAL_LATENTS.name
# Variants whose step reads the whole schedule (flow_grpo_wan's std spans sigmas[1]..sigmas[-1]): on the
# remaining sigmas alone they would take another step than the aborted rollout's, so they do not resume.
SCHEDULE_WIDE = frozenset({"flow_grpo_wan"})


def resume_problem(params: GenerationParams) -> str | None:
    """Why this request cannot start from given latents, or None. Resuming needs the flow-match Euler rollout
    schedule (a first-order step: the remaining sigmas are the rest of the same run) and a step that depends on
    its own sigmas only; a multistep serving solver (UniPC, DPM-Solver) would restart its history."""
    r = params.rollout
    if r is None or not r.sde_scheduler or r.schedule != "rollout":
        return "resuming runs on the rollout schedule: rollout true and schedule \"rollout\""
    if r.sde_type in SCHEDULE_WIDE:
        return f"sde_type {r.sde_type} steps with the whole schedule's sigmas, which a resumed request lacks"
    if r.ode_solver != "euler":
        return "resuming takes ode_solver \"euler\" (the serving solver would restart its history)"
    if r.share_prefix or r.initial_noise_seed is not None:  # given latents replace the initial noise they name
        return "given latents are the start: share_prefix and initial_noise_seed do not apply"
    return None


def latent_shape(info: ModelInfo, params: GenerationParams) -> tuple[int, ...]:
    """One sample's latents as the family steps on them for this request's size and frames (leading 1)."""
    return tuple(info.family.latents.request_shape(info, params))


def from_body(body: Any) -> torch.Tensor:
    """A ``{dtype, shape, data}`` body (a dict or a model with those attributes) as a tensor."""
    if hasattr(body, "model_dump"):
        body = body.model_dump()
    if not isinstance(body, dict) or set(body) != {"dtype", "shape", "data"}:
        raise FieldError(FIELD, "must be a tensor: {dtype, shape, data}")
    if body["dtype"] not in DTYPES:
        raise FieldError(FIELD, f"dtype {body['dtype']!r} is not a wire dtype ({', '.join(sorted(DTYPES))})")
    try:
        return body_to_tensor(body)
    except (ValueError, TypeError, RuntimeError) as e:
        raise FieldError(FIELD, str(e)) from None


def checked(latents: torch.Tensor, info: ModelInfo, params: GenerationParams) -> torch.Tensor:
    """``latents`` if they fit the request: a floating dtype, shape [n or 1, *latent] (the family's layout for
    its size and frames), every value finite; as float32, contiguous. The request must be one that resumes
    (:func:`resume_problem`)."""
    why = resume_problem(params)
    if why:
        raise FieldError(FIELD, why)
    dtype = DTYPE_NAMES.get(latents.dtype, str(latents.dtype))
    problem = INITIAL_LATENTS.problem(dtype, list(latents.shape))
    if problem:
        raise FieldError(FIELD, problem)
    one = latent_shape(info, params)
    if tuple(latents.shape[1:]) != one[1:] or latents.shape[0] not in (1, params.n):
        want = [params.n if params.n == 1 else f"1 or {params.n}", *one[1:]]
        raise FieldError(FIELD, f"shape {list(latents.shape)} is not this request's latents' "
                                f"[{', '.join(map(str, want))}] ({info.family.pipeline}, {params.height}x"
                                f"{params.width}, {params.num_frames} frames)")
    latents = latents.float().contiguous()
    if not torch.isfinite(latents).all():
        raise FieldError(FIELD, "values must be finite (no NaN or inf)")
    return latents


def starting_latents(given: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
    """The request's starting latents from ``given`` ([1 or n, *latent]; one row serves every sample) in place of
    its ``drawn`` noise [n, *latent]. The router checked them; a worker still refuses a tensor that does not fit."""
    if tuple(given.shape[1:]) != tuple(drawn.shape[1:]) or given.shape[0] not in (1, drawn.shape[0]):
        raise RequestError(f"{FIELD}: shape {list(given.shape)} does not fit the request's latents "
                           f"{list(drawn.shape)}")
    return given.to(drawn.dtype).expand_as(drawn).clone().to(drawn.device)
