"""Request-local schedulers rebuilt from templates.

The denoise worker loads each scheduler *template* once, from the model's own
``scheduler/`` config. A request never shares a scheduler: :func:`build`
makes a fresh object from a template's config and sets it up from the
request's ``sigmas`` / ``timesteps`` / ``num_inference_steps`` / ``mu``.
Templates are never stepped or mutated, so requests cannot leak state into
each other through them.
"""

from __future__ import annotations

import inspect
import logging

import diffusers
import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from common.protocol.errors import RequestError
from common.protocol.messages import GenerationParams
from common.diffusion.model_info import ModelInfo, flow_shift_of

log = logging.getLogger("disagg.denoise")


def load_serving_template(info: ModelInfo):
    """The model's own scheduler (UniPC with flow sigmas for Wan), built from its config."""
    config = info.scheduler_config
    cls = getattr(diffusers, config.get("_class_name", ""), None)
    if cls is None or not isinstance(cls, type):
        raise ValueError(f"{info.path / 'scheduler'}: unknown scheduler class {config.get('_class_name')!r}")
    return cls.from_config(config)


def rollout_template_for(serving) -> FlowMatchEulerDiscreteScheduler:
    """First-order flow-match Euler with the serving scheduler's shift and training steps; with its whole
    config when it shifts dynamically (FLUX, Qwen-Image: the base / max shift and sequence lengths, the
    terminal sigma), so that a request's ``mu`` shifts both schedules alike."""
    if serving.config.get("use_dynamic_shifting", False):
        return FlowMatchEulerDiscreteScheduler.from_config(
            {**serving.config, "stochastic_sampling": False, "use_karras_sigmas": False,
             "use_exponential_sigmas": False, "use_beta_sigmas": False})
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=serving.config.num_train_timesteps,
        shift=flow_shift_of(serving.config),
    )


def _static_shift(config) -> float | None:
    return None if config.get("use_dynamic_shifting", False) else flow_shift_of(config)


def _unshift(sigmas: np.ndarray, shift: float) -> np.ndarray:
    """Inverse of the static flow shift ``s' = k s / (1 + (k - 1) s)``."""
    return sigmas / (shift - (shift - 1.0) * sigmas)


def calculate_shift(image_seq_len: int, config) -> float:
    """The dynamic shift ``mu`` for an image sequence length: linear between the config's base and max
    shift over its base and max sequence lengths, as diffusers' FLUX, Qwen-Image and SD3 pipelines do."""
    base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * m + (base_shift - m * base_len)


def dynamic(config) -> bool:
    """The scheduler shifts by a request's ``mu`` (else ``mu`` means nothing to it)."""
    return bool(config.get("use_dynamic_shifting", False))


def build(template, params: GenerationParams, device: torch.device | str = "cpu", *, image_seq_len: int = 0,
          default_sigmas=False, mu: float | None = None):
    """A fresh scheduler for one request: sigmas first, else timesteps, else the step count.

    ``timesteps`` name the exact timesteps to run; the scheduler's sigmas become
    ``timesteps / num_train_timesteps`` (the flow-match convention), which for
    a statically shifted scheduler means handing it the un-shifted sigmas.
    A dynamically shifted scheduler takes the request's ``mu``, else the one of
    ``image_seq_len`` (:func:`calculate_shift`) unless the family gives its own (``mu``); ``default_sigmas``: the step count
    becomes ``sigmas = linspace(1, 1/N, N)`` (or ``default_sigmas(N)`` where it is a function), as the family's
    pipeline passes them.
    """
    scheduler = type(template).from_config(template.config)
    try:
        _set_up(scheduler, params, device, image_seq_len, default_sigmas, mu)
    except (ValueError, ZeroDivisionError, OverflowError) as e:
        if isinstance(e, RequestError):
            raise
        # A config diffusers' own pipeline cannot run this schedule with either (e.g. exponential sigmas down to 0)
        raise RequestError(f"num_inference_steps: this model's {type(scheduler).__name__} config cannot make the "
                           f"schedule of {params.num_inference_steps} steps: {e}") from None
    if params.sigmas_as_given and params.sigmas is not None:
        _as_given(scheduler, params.sigmas)
    scheduler.set_begin_index(0)
    return scheduler


def _set_up(scheduler, params: GenerationParams, device, image_seq_len: int, default_sigmas,
            mu: float | None) -> None:
    """``scheduler.set_timesteps`` as :func:`build` describes."""
    accepts = inspect.signature(scheduler.set_timesteps).parameters
    kwargs: dict = {"device": device}
    if params.mu is not None:
        kwargs["mu"] = params.mu
    elif dynamic(scheduler.config):
        kwargs["mu"] = calculate_shift(image_seq_len, scheduler.config) if mu is None else mu
    sigmas = params.sigmas
    if sigmas is None and params.timesteps is None and default_sigmas and "sigmas" in accepts \
            and not scheduler.config.get("use_flow_sigmas", False):
        n = params.num_inference_steps
        sigmas = default_sigmas(n) if callable(default_sigmas) else np.linspace(1.0, 1 / n, n)
    if sigmas is not None:
        if "sigmas" not in accepts:
            raise RequestError(f"sigmas: {type(scheduler).__name__} does not take custom sigmas")
        # float64 arrays: what diffusers' flow schedulers compute their shift in.
        scheduler.set_timesteps(sigmas=np.asarray(sigmas, dtype=np.float64), **kwargs)
    elif params.timesteps is not None:
        shift = _static_shift(scheduler.config)
        if shift is None or "sigmas" not in accepts:
            raise RequestError(
                f"timesteps: {type(scheduler).__name__} with this config cannot run caller timesteps; pass sigmas"
            )
        n_train = scheduler.config.num_train_timesteps
        t = np.asarray(params.timesteps, dtype=np.float64)
        sigmas = _unshift(t / n_train, shift)
        if "timesteps" in accepts:
            kwargs["timesteps"] = t.astype(np.float32).tolist()
        scheduler.set_timesteps(sigmas=sigmas, **kwargs)
        if "timesteps" not in accepts:
            # E.g. UniPC derives (integer) timesteps from sigmas; keep the caller's
            # exactly instead of a float round-trip of them, in the scheduler's dtype.
            ts = scheduler.timesteps
            scheduler.timesteps = torch.as_tensor(t, dtype=torch.float64).to(ts.dtype).to(ts.device)
    else:
        scheduler.set_timesteps(params.num_inference_steps, **kwargs)


def _as_given(scheduler, sigmas: list[float]) -> None:
    """The caller's sigmas themselves (already shifted, as a trainer's schedule holds them), not shifted again:
    a flow-match Euler scheduler steps on whatever grid it holds, its timesteps ``sigmas * num_train_timesteps``
    and its terminal sigma its own."""
    if not type(scheduler).__name__.startswith("FlowMatch"):
        raise RequestError(f"sigmas_as_given: {type(scheduler).__name__} derives its own grid from sigmas; use a "
                           "flow-match Euler schedule (a rollout's default schedule)")
    held = scheduler.sigmas
    given = torch.tensor(list(sigmas), dtype=held.dtype, device=held.device)
    scheduler.sigmas = torch.cat([given, held[-1:]])
    scheduler.timesteps = (given * scheduler.config.num_train_timesteps).to(scheduler.timesteps.dtype)


class ConventionError(RuntimeError):
    """The rollout scheduler breaks the flow-match convention the SDE math relies on."""

    status = 500


# Configurations whose convention check has been logged in this process (a fact per configuration,
# not per request).
_logged_conventions: set[tuple[str, int]] = set()


def check_flow_match_convention(scheduler, atol: float = 1e-3) -> float:
    """Require ``timesteps == sigmas[:-1] * num_train_timesteps``; return the max deviation.

    The SDE step and its log-prob read sigmas while the model is conditioned on
    timesteps, so the two must describe the same points. Success is logged once
    per process (schedulers are per request; the fact is per configuration).
    """
    n_train = scheduler.config.num_train_timesteps
    ts = scheduler.timesteps.double().cpu()
    sig = scheduler.sigmas.double().cpu()
    if sig.numel() != ts.numel() + 1:
        raise ConventionError(
            f"{type(scheduler).__name__}: {sig.numel()} sigmas for {ts.numel()} timesteps (expected one more)"
        )
    deviation = float((ts - sig[:-1] * n_train).abs().max()) if ts.numel() else 0.0
    if not deviation <= atol:
        raise ConventionError(
            f"{type(scheduler).__name__} breaks the flow-match convention timesteps == sigmas[:-1] * "
            f"{n_train}: max deviation {deviation:.4g} > {atol}"
        )
    if (type(scheduler).__name__, n_train) not in _logged_conventions:
        _logged_conventions.add((type(scheduler).__name__, n_train))
        log.info(
            "rollout scheduler %s satisfies timesteps == sigmas[:-1] * %d (max deviation %.3g)",
            type(scheduler).__name__, n_train, deviation,
        )
    return deviation


def check_rollout_schedule(scheduler, atol: float = 1e-3) -> float:
    """The check a rollout's scheduler passes before its first SDE step; returns the convention's deviation.

    A flow-match Euler schedule (the rollout template's, or a serving one such as FLUX's) must satisfy the
    flow-match convention (:func:`check_flow_match_convention`). Another serving schedule (Wan's UniPC, SANA's
    DPM-Solver with flow sigmas) conditions the model on its own timesteps (UniPC's are integers, not
    ``sigmas * 1000``), which the SDE steps take as they are: its sigmas only need to be a flow schedule, one
    more than its timesteps, within [0, 1] and non-increasing (0.0 is returned).
    """
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return check_flow_match_convention(scheduler, atol)
    sig = scheduler.sigmas.double().cpu()
    if sig.numel() != len(scheduler.timesteps) + 1:
        raise ConventionError(f"{type(scheduler).__name__}: {sig.numel()} sigmas for {len(scheduler.timesteps)} "
                              "timesteps (expected one more)")
    if not bool(((sig >= 0) & (sig <= 1)).all()) or bool((sig[1:] > sig[:-1]).any()):
        raise ConventionError(f"{type(scheduler).__name__}'s sigmas are not a flow-matching schedule (non-increasing "
                              f"within [0, 1]): {sig.tolist()}")
    return 0.0
