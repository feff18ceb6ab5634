"""A request's rollout fields as :class:`RolloutParams`, with every check that depends on the model and the step
count: the step variant and its noise level, the schedule, the SDE steps (given, or a window picked from the
seed), the trajectory's entries, the latent streams, the KL reference, and groups that share their noise."""

from __future__ import annotations

from typing import get_args

from common.diffusion import windows
from common.diffusion.field_error import FieldError
from common.diffusion.model_info import ModelInfo
from common.diffusion.step_variants import STEP_VARIANTS, step_variant
from common.protocol.messages import ROLLOUT_SCHEDULES, KlReference, OdeSolver, RolloutParams

MAX_SEED = 2**63 - 1
ROLLOUT = ("rollout", "sde_type", "noise_level", "sde_step_indices", "return_trajectory", "return_log_probs",
           "trajectory_steps", "return_conditioning", "ode_solver", "schedule", "return_kl", "kl_reference",
           "initial_noise_seed", "share_prefix", "sde_streams")
WINDOW = ("sde_window_size", "sde_window_range")  # resolved into RolloutParams.sde_window and sde_step_indices


def serving_has_flow_sigmas(info: ModelInfo) -> bool:
    """Whether the model's serving scheduler has flow-matching sigmas (in [0, 1], what the SDE steps read): a
    flow-match scheduler, or one with ``use_flow_sigmas``; ``schedule: "serving"`` needs them."""
    config = info.scheduler_config
    return str(config.get("_class_name", "")).startswith("FlowMatch") or bool(config.get("use_flow_sigmas"))


def _check_rollout_schedule(r: RolloutParams, info: ModelInfo) -> None:
    """``schedule``: a known name; ``"serving"`` on a serving scheduler with flow-matching sigmas."""
    if r.schedule not in ROLLOUT_SCHEDULES:
        raise FieldError("schedule", f"must be one of {ROLLOUT_SCHEDULES}, got {r.schedule!r}")
    config = info.scheduler_config
    if r.schedule == "serving" and not serving_has_flow_sigmas(info):
        raise FieldError("schedule", f"this model's serving scheduler ({config.get('_class_name')}) has no "
                                     "flow-matching sigmas for SDE steps: use the rollout schedule")


def rollout_params(request: dict, steps: int, info: ModelInfo) -> RolloutParams:
    given = {k: request[k] for k in ROLLOUT if request.get(k) is not None}
    r = RolloutParams(**{("sde_scheduler" if k == "rollout" else k): v for k, v in given.items()})
    if r.sde_type not in STEP_VARIANTS:
        raise FieldError("sde_type", f"must be one of {tuple(STEP_VARIANTS)}, got {r.sde_type!r}")
    _check_rollout_schedule(r, info)
    try:  # the step variant's own rule (e.g. cps takes [0, 1]), so that no such request reaches a worker
        step_variant(r.sde_type, r.noise_level)
    except ValueError as e:
        raise FieldError("noise_level", str(e)) from None
    idx = r.sde_step_indices
    if idx is not None:
        if len(idx) > steps or len(set(idx)) != len(idx):
            raise FieldError("sde_step_indices", "must be distinct step indices")
        if any(i < 0 or i >= steps for i in idx):
            raise FieldError("sde_step_indices", f"indices must be within 0..{steps - 1}")
        r.sde_step_indices = sorted(idx)
    if r.sde_scheduler:  # an SDE step goes from sigma down to sigma_next: a rising schedule has none
        for name in ("sigmas", "timesteps"):
            values = request.get(name)
            if values is not None and any(b > a for a, b in zip(values, values[1:])):
                raise FieldError(name, "a rollout's values must not increase from one step to the next")
    _resolve_window(request, r, steps)
    _resolve_trajectory_steps(r, steps)
    _check_streams(r, info)
    _check_kl(r)
    _check_branching(r, request)
    return r


def _resolve_trajectory_steps(r: RolloutParams, steps: int) -> None:
    """``trajectory_steps``: entries of the trajectory (0..steps) to return, or ``"sde"``: those a trainer needs to
    recompute the SDE steps' log-probs (each SDE step's x_i and x_{i+1}; None, all, without an SDE subset)."""
    asked = r.trajectory_steps
    if asked is None:
        return
    if not r.return_trajectory:
        raise FieldError("trajectory_steps", "needs return_trajectory: true")
    if asked == "sde":
        idx = r.sde_step_indices
        r.trajectory_steps = None if idx is None else sorted({j for i in idx for j in (i, i + 1)})
        return
    if not isinstance(asked, list) or len(set(asked)) != len(asked):  # []: the schedule alone
        raise FieldError("trajectory_steps", 'must be "sde" or a list of distinct entries')
    if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i <= steps for i in asked):
        raise FieldError("trajectory_steps", f"entries must be within 0..{steps} (the latents before each step, "
                                             f"{steps}: after the last)")
    r.trajectory_steps = sorted(asked)


def _check_streams(r: RolloutParams, info: ModelInfo) -> None:
    """``sde_streams``: distinct names of the model's latent streams."""
    if r.sde_streams is None:
        return
    streams = info.family.latents.streams
    if not streams:
        raise FieldError("sde_streams", f"this {info.family.pipeline} model has one latent stream")
    unknown = [s for s in r.sde_streams if s not in streams]
    if unknown or len(set(r.sde_streams)) != len(r.sde_streams):
        raise FieldError("sde_streams", f"must be distinct names among {list(streams)}, got {r.sde_streams}")
    r.sde_streams = [s for s in streams if s in r.sde_streams]  # in the model's order


def _resolve_window(request: dict, r: RolloutParams, steps: int) -> None:
    """``sde_window_size`` / ``sde_window_range`` as the concrete window of this request's seed: the wire and
    the trainer's params carry the steps themselves (``sde_window``, ``sde_step_indices``)."""
    if r.ode_solver not in get_args(OdeSolver):
        raise FieldError("ode_solver", f"must be one of {', '.join(get_args(OdeSolver))}, got {r.ode_solver!r}")
    size, window_range = request.get("sde_window_size"), request.get("sde_window_range")
    if size is None:
        if window_range is not None:
            raise FieldError("sde_window_range", "needs sde_window_size")
        return
    if r.sde_step_indices is not None:
        raise FieldError("sde_window_size", "give either sde_window_size or sde_step_indices, not both")
    problem = windows.window_problem(size, window_range, steps)
    if problem:
        raise FieldError(*problem)
    start, stop = windows.pick_window(request.get("seed", 0), size, window_range, steps)
    r.sde_window, r.sde_step_indices = [start, stop], list(range(start, stop))


def _check_kl(r: RolloutParams) -> None:
    """``return_kl`` compares SDE steps, which only the rollout scheduler takes; one reference exists."""
    if r.kl_reference not in get_args(KlReference):
        raise FieldError("kl_reference", f"must be one of {get_args(KlReference)}, got {r.kl_reference!r}")
    if not isinstance(r.return_kl, bool):
        raise FieldError("return_kl", f"must be true or false, got {r.return_kl!r}")
    if r.return_kl and not r.sde_scheduler:
        raise FieldError("return_kl", "needs the rollout scheduler's SDE steps (rollout: true)")


def _check_branching(r: RolloutParams, request: dict) -> None:
    """``initial_noise_seed`` and ``share_prefix`` (denoise_worker/branching.py)."""
    if r.initial_noise_seed is not None and not 0 <= r.initial_noise_seed <= MAX_SEED:
        raise FieldError("initial_noise_seed", "must fit in a signed 64-bit integer, at least 0")
    if not r.share_prefix:
        return
    if not r.sde_scheduler:
        raise FieldError("share_prefix", "needs the rollout's SDE scheduler (rollout: true)")
    if request.get("cache") is not None:  # the prefix's one row would need a cache state per branch
        raise FieldError("cache", "step caching does not combine with share_prefix")
