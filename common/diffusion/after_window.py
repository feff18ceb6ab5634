"""The serving scheduler for the steps after a rollout's last SDE step (``ode_solver: "serving"``).

The model's own scheduler (Wan's UniPC, SANA's DPM-Solver, FLUX's flow-match Euler), started fresh at the latent
after the last SDE step, over the remaining sigmas of the request's rollout schedule. Those sigmas are already
shifted: they are set on the scheduler as they are (``set_timesteps`` first, for the scheduler's own state, then
its sigmas and timesteps replaced), never shifted again. Its timesteps are the rollout schedule's
(``sigma * num_train_timesteps``), so that the model stays conditioned on timesteps that match those sigmas (a
UniPC serving run would round them to integers). A multistep solver starts at first order: it has no history
from before the window.
"""

from __future__ import annotations

import numpy as np

from common.diffusion import schedulers


def serving_after(template, rollout_scheduler, start: int):
    """A fresh scheduler from ``template`` (the serving template) over ``rollout_scheduler``'s steps ``start``..:
    its sigmas ``sigmas[start:]`` (the terminal one included) and timesteps ``timesteps[start:]``."""
    sigmas, timesteps = rollout_scheduler.sigmas[start:], rollout_scheduler.timesteps[start:]
    steps = len(timesteps)
    if steps < 1:
        raise ValueError(f"no steps after step {start}")
    s = type(template).from_config(template.config)
    kwargs = {"device": timesteps.device}
    if schedulers.dynamic(s.config):
        kwargs["mu"] = 0.0  # any: the sigmas it makes are replaced below
    with np.errstate(all="ignore"):  # (a one-step schedule stretched to a terminal sigma divides 0 by 0)
        s.set_timesteps(steps, **kwargs)
    s.sigmas = sigmas.clone().to(device=s.sigmas.device, dtype=s.sigmas.dtype)
    s.timesteps = timesteps.clone()
    s.num_inference_steps = steps
    s.set_begin_index(0)
    return s


def last_sde_step(indices: list[int] | None) -> int | None:
    """The last step that takes the SDE step of a rollout whose SDE steps are ``indices`` (None: all, so no
    step comes after the last one; an empty list: none)."""
    return max(indices) if indices else None
