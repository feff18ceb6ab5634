"""SGLang diffusion's ``/rollout/generate`` answer, built from the native outcome as sglang 0.5.23's
``rollout_api.py`` builds its own: a msgpack list with one map per sample, each tensor a
``{"__tensor__": True, "data", "shape", "dtype": "torch.float32"}`` whose ``data`` is a safetensors file holding it
under ``"t"`` (raw bytes; base64 text with ``--sglang-tensors base64``, as older releases sent them).

Log-probs come over all T steps, 0 on the steps without an SDE, in SGLang's convention: the native ones where
they agree (``sde`` with the constant, ``cps`` without it), else converted exactly (:func:`sglang_log_probs`).
"""

from __future__ import annotations

import base64
import math

import msgspec
import torch
from safetensors.torch import save

from common.diffusion.conditioning import grouped
from common.protocol.messages import (
    CONDITIONING, LOG_PROB_STEPS, LOG_PROBS, OUTPUT, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS, TRAJECTORY_STEPS, TRAJECTORY_TIMESTEPS,
)
from router.link.join import Outcome
from router.peers.sglang.translate import Plan

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def tensor(t: torch.Tensor, base64_data: bool = False) -> dict:
    """One tensor as SGLang's ``_maybe_serialize`` encodes it."""
    data = save({"t": t.detach().contiguous().cpu()})
    return {"__tensor__": True, "data": base64.b64encode(data).decode("ascii") if base64_data else data,
            "shape": list(t.shape), "dtype": str(t.dtype)}


def step_scale(sde_type: str, noise_level: float, sigmas: list[float], i: int) -> float:
    """The noise scale of step ``i`` (the standard deviation of x_{i+1} given x_i): ``sde``'s
    ``std_dev_t * sqrt(-dt)`` with sigma_max = sigmas[1] in place of a sigma of 1, ``cps``'s
    ``sigma_next * sin(noise_level * pi / 2)``."""
    s, s_next = sigmas[i], sigmas[i + 1]
    if sde_type == "cps":
        return s_next * math.sin(noise_level * math.pi / 2)
    s_max = sigmas[min(1, len(sigmas) - 1)]
    std_dev_t = noise_level * math.sqrt(s / (1 - (s_max if math.isclose(s, 1.0, rel_tol=1e-5, abs_tol=1e-8) else s)))
    return std_dev_t * math.sqrt(s - s_next)


def sglang_log_probs(native: torch.Tensor, steps: list[int], sigmas: list[float], total: int, plan: Plan) -> torch.Tensor:
    """[n, total] in SGLang's convention from the native [n, K] of SDE steps ``steps``.

    Native ``sde`` is the full Gaussian log-density averaged over the elements, ``-mean(eps^2)/2 - log sd -
    log sqrt(2 pi)``; native ``cps`` drops the constants, ``-sd^2 mean(eps^2)``. SGLang's ``sde`` without the
    constant is ``-sd^2 mean(eps^2)`` and its ``cps`` with them the full density: each follows from the other
    through the step's ``sd`` (computed here in float64)."""
    out = torch.zeros(native.shape[0], total, dtype=torch.float64)
    for k, i in enumerate(steps):  # another trainer's step (extra_sampling_params) keeps its own convention
        lp = native[:, k].double()
        if (plan.sde_type, plan.no_const) in (("sde", True), ("cps", False)):
            sd = step_scale(plan.sde_type, plan.noise_level, sigmas, i)
            lp = (2 * sd * sd * (lp + math.log(sd) + LOG_SQRT_2PI) if plan.sde_type == "sde"
                  else lp / (2 * sd * sd) - math.log(sd) - LOG_SQRT_2PI)
        out[:, i] = lp
    return out.float()


def samples(request_id: str, prompt: str, plan: Plan, outcome: Outcome, n: int, total_s: float,
            base64_data: bool = False) -> list[dict]:
    """Every sample's map, as ``RolloutResponse.model_dump()`` gives it."""
    t = outcome.tensors
    enc = lambda x: tensor(x, base64_data)  # noqa: E731
    log_probs = trajectory = None
    if plan.rollout:
        sigmas = [float(s) for s in t[TRAJECTORY_SIGMAS.name].double()]
        steps = [int(i) for i in t[LOG_PROB_STEPS.name]] if LOG_PROB_STEPS.name in t else []
        native = t.get(LOG_PROBS.name, torch.zeros(n, 0))
        log_probs = sglang_log_probs(native, steps, sigmas, plan.steps, plan) if plan.sde_type != "ode" \
            else torch.zeros(n, plan.steps)
        if plan.dit_trajectory:
            kept = t[TRAJECTORY_STEPS.name].tolist() if TRAJECTORY_STEPS.name in t else list(range(plan.steps + 1))
            timesteps = t[TRAJECTORY_TIMESTEPS.name].float()
            # The entry after the last step has timestep 0, as SGLang records it.
            trajectory = (torch.stack([timesteps[i] if i < plan.steps else timesteps.new_zeros(()) for i in kept])
                          if kept else timesteps.new_zeros(0), t[TRAJECTORY_SIGMAS.name].float())
    env = None
    conditioning = grouped({k.removeprefix(CONDITIONING.name): v for k, v in t.items() if CONDITIONING.names(k)})
    if plan.rollout and conditioning:  # SGLang's RolloutDenoisingEnv: the DiT's keyword arguments per branch
        pack = lambda d: None if not d else {k: enc(v) for k, v in d.items()}  # noqa: E731
        env = {"image_kwargs": pack(conditioning.get("image")), "pos_cond_kwargs": pack(conditioning.get("cond")),
               "neg_cond_kwargs": pack(conditioning.get("uncond")),
               "guidance": enc(conditioning["guidance"]) if "guidance" in conditioning else None}
    peaks = [v for v in outcome.peak_memory.values() if v]
    peak_mb = max(peaks) / 2**20 if plan.peak_memory and peaks else None
    out = []
    for i in range(n):
        frames = t[OUTPUT.name][i]  # [F, H, W, 3] -> SGLang's [3, F, H, W]
        sample = {"request_id": request_id, "prompt": prompt, "seed": plan.seed,
                  "generated_output": enc(frames.permute(3, 0, 1, 2).float()),
                  "rollout_log_probs": None, "rollout_debug_tensors": None, "denoising_env": env,
                  "dit_trajectory": None, "inference_time_s": total_s if total_s > 0 else None,
                  "peak_memory_mb": peak_mb}
        if log_probs is not None:
            sample["rollout_log_probs"] = enc(log_probs[i])
        if trajectory is not None:
            sample["dit_trajectory"] = {"latents": enc(t[TRAJECTORY_LATENTS.name][i]), "timesteps": enc(trajectory[0]),
                                        "sigmas": enc(trajectory[1])}
        out.append(sample)
    return out


def encode(payload: list[dict]) -> bytes:
    return msgspec.msgpack.encode(payload)
