"""The trainers' own steps as step variants (``flow_grpo_wan``, ``dance_grpo``) and rollouts on the serving
scheduler's schedule (``schedule: "serving"``), in process.

1. ``sde_step`` of each variant (mean, noise scale, ``x_next`` from given noise, log-prob) equals a float64
   transcription of its trainer's formula, written here in the trainer's own form (Flow-GRPO's Wan step:
   ``std_t = s_min + (s_max - s_min) s``; DanceGRPO's ``flux_step``: the score form with ``eta``), on several
   sigma grids: the rollout (flow-match Euler) grid, Wan's UniPC flow grid from the tiny model's serving
   scheduler, DanceGRPO's ``shift(linspace(1, 0, N + 1))``, and a grid that ends above 0 (``s_min > 0``).
2. Through the engine path (tests/family_harness.py) on every family, each variant's log-probs equal the
   float64 recompute from the trajectory and the trainer's velocity (``TrainerPolicy.velocity``), and
   ``TrainerPolicy.log_probs`` agrees, within 1e-5.
3. ``flow_grpo_wan`` on Wan's serving schedule: the trajectory's sigmas and (integer) timesteps are the UniPC
   scheduler's, the model is conditioned on them, the log-probs equal the recompute; ``dance_grpo`` likewise on
   SANA's DPM-Solver.
4. The rules: an unknown ``schedule`` or ``sde_type``, or ``schedule: "serving"`` on a serving scheduler without
   flow sigmas, is a FieldError naming the field; the serving schedule of an Euler family passes the flow-match
   convention check (and is the rollout one there); the answer's info says which schedule ran.
"""

from __future__ import annotations

import dataclasses
import math

import msgspec
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from common.builtin import ensure_builtin
from common.config.engine import Limits
from common.diffusion import schedulers
from common.diffusion.params import FieldError, to_params
from common.protocol.errors import RequestError
from common.diffusion.policy import step_at
from common.diffusion.sde import log_prob_of, sde_step
from common.diffusion.step_variants import DanceGrpo, FlowGrpoWan
from common.families import read_model
from common.protocol.messages import (
    LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS, TRAJECTORY_TIMESTEPS, RolloutParams,
)
from family_harness import InStage, ModuleModels
from rl import Trajectory
from test_wan_i2v import picture

TOL = 1e-5
MODELS = ["tiny", "tiny-wan-i2v", "tiny-sd3", "tiny-flux", "tiny-qwen-image", "tiny-sana", "tiny-z-image",
          "tiny-flux2-klein", "tiny-hunyuan-video15"]
VARIANTS = {"flow_grpo_wan": 0.7, "dance_grpo": 0.3}  # 0.7: unused by flow_grpo_wan; 0.3: DanceGRPO's eta
IMAGE = picture(40, 24, 1)
_MODELS = ModuleModels()


@pytest.fixture(scope="module", autouse=True)
def _module_state():
    yield from _MODELS.module_scope()


# --- float64 transcriptions of the trainers' formulas -------------------------------------------------------

def _gaussian_log_prob(x_next, mean, sd, mask=None):
    """The full Gaussian log-density, averaged over the non-batch elements (those of ``mask``)."""
    lp = -((x_next - mean) ** 2) / (2 * sd ** 2) - math.log(sd) - math.log(math.sqrt(2 * math.pi))
    if mask is None:
        return lp.flatten(1).mean(1)
    keep = mask.double().expand_as(lp)
    return (lp * keep).flatten(1).sum(1) / keep.flatten(1).sum(1)


def flow_grpo_wan(x, v, sigmas, i, noise_level):
    """Flow-GRPO's Wan ``sde_step_with_logprob``: (mean, sd) in float64 (``noise_level`` has no part in it)."""
    s, s_prev = float(sigmas[i]), float(sigmas[i + 1])
    s_max, s_min = float(sigmas[1]), float(sigmas[-1])
    dt = s_prev - s
    std_dev_t = s_min + (s_max - s_min) * s
    mean = x * (1 + std_dev_t ** 2 / (2 * s) * dt) + v * (1 + std_dev_t ** 2 * (1 - s) / (2 * s)) * dt
    return mean, std_dev_t * math.sqrt(-dt)


def dance_grpo(x, v, sigmas, i, eta):
    """DanceGRPO's ``flux_step`` (sde_solver): the Euler mean plus the score term, std ``eta sqrt(s - s')``."""
    s, s_next = float(sigmas[i]), float(sigmas[i + 1])
    dsigma = s_next - s
    m0 = x + dsigma * v
    x0_hat = x - s * v
    score = -(x - x0_hat * (1 - s)) / s ** 2
    mean = m0 + (-0.5 * eta ** 2 * score) * dsigma
    return mean, eta * math.sqrt(s - s_next)


REFERENCES = {"flow_grpo_wan": flow_grpo_wan, "dance_grpo": dance_grpo}


def _tiny_serving():
    return schedulers.load_serving_template(read_model(ensure_builtin("tiny")))


def _grids() -> dict[str, torch.Tensor]:
    n = 8
    euler = schedulers.rollout_template_for(_tiny_serving())
    euler.set_timesteps(n)
    unipc = UniPCMultistepScheduler.from_config(_tiny_serving().config)
    unipc.set_timesteps(n)
    u = torch.linspace(1, 0, n + 1)
    return {"rollout-euler": euler.sigmas, "wan-unipc": unipc.sigmas, "dance-shift3": 3 * u / (1 + 2 * u),
            "ends-above-0": torch.tensor([0.9, 0.75, 0.6, 0.4, 0.25, 0.1])}


GRIDS = _grids()


# --- 1. sde_step against the formulas -----------------------------------------------------------------------

@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("name", list(VARIANTS))
def test_sde_step_equals_the_trainers_formula(name, grid):
    sigmas = GRIDS[grid].float()
    assert float(sigmas[-1]) > 0 or grid != "ends-above-0"
    variant = {"flow_grpo_wan": FlowGrpoWan, "dance_grpo": DanceGrpo}[name](VARIANTS[name])
    g = torch.Generator().manual_seed(7)
    worst = 0.0
    for i in range(len(sigmas) - 1):
        x, v, eps = (torch.randn(2, 4, 3, 5, generator=g) for _ in range(3))
        out = sde_step(v, x, sigmas[i], sigmas[i + 1], sigmas[1], sigma_min=sigmas[-1], sde_type=variant, noise=eps)
        mean, sd = REFERENCES[name](x.double(), v.double(), sigmas.double(), i, VARIANTS[name])
        x_next = mean + sd * eps.double()
        diffs = [(out.mean.double() - mean).abs().max(), (out.prev_sample.double() - x_next).abs().max(),
                 (out.noise_scale.double() - sd).abs().max(),
                 (out.log_prob.double() - _gaussian_log_prob(x_next, mean, sd)).abs().max()]
        # The trainer's recompute of a recorded step: the log-prob of the engine's x_next.
        again = log_prob_of(v, x, out.prev_sample, sigmas[i], sigmas[i + 1], sigmas[1], sigma_min=sigmas[-1],
                            sde_type=variant)
        diffs.append((again.double() - _gaussian_log_prob(out.prev_sample.double(), mean, sd)).abs().max())
        # step_at reads s_max and s_min off the schedule: the same step.
        at = step_at(sigmas, i, v, x, variant, prev_sample=out.prev_sample)
        assert torch.equal(at.log_prob, again) and torch.equal(at.mean, out.mean)
        worst = max(worst, *(float(d) for d in diffs))
    print(f"\n[{name} on {grid}] max |engine - float64| {worst:.3g}")
    assert worst <= TOL


def test_flow_grpo_wan_uses_s_min_and_ignores_noise_level():
    """The linear std moves with the schedule's last sigma, and the noise level changes nothing."""
    x, v, eps = (torch.randn(1, 6, generator=torch.Generator().manual_seed(s)) for s in range(3))
    args = (v, x, 0.6, 0.4, 0.9)
    base = sde_step(*args, sigma_min=0.0, sde_type=FlowGrpoWan(0.7), noise=eps)
    assert torch.equal(base.mean, sde_step(*args, sigma_min=0.0, sde_type=FlowGrpoWan(1.5), noise=eps).mean)
    lifted = sde_step(*args, sigma_min=0.1, sde_type=FlowGrpoWan(0.7), noise=eps)
    assert float(lifted.noise_scale) == pytest.approx((0.1 + 0.8 * 0.6) * math.sqrt(0.2), rel=1e-6)
    assert float(base.noise_scale) == pytest.approx(0.9 * 0.6 * math.sqrt(0.2), rel=1e-6)


# --- 2. the engine path on every family ---------------------------------------------------------------------

def _recompute(trainer, p, traj, steps, image):
    """Per step of ``steps``: the float64 log-prob of the recorded step from the trainer's velocity."""
    inputs = None if image is None else trainer.image(p, image)
    cond, uncond = trainer.embeddings(p, inputs)
    name, level = p.rollout.sde_type, p.rollout.noise_level
    out = []
    with torch.no_grad():
        for i in steps:
            x = traj.latents[i : i + 1]
            v = trainer.velocity(x, traj.timesteps[i], cond, uncond, p, inputs).double()
            mean, sd = REFERENCES[name](x.double(), v, traj.sigmas.double(), i, level)
            mask = trainer.family.condition.log_prob_mask(trainer.info, x, None if inputs is None
                                                          else inputs.condition)
            out.append(_gaussian_log_prob(traj.latents[i + 1 : i + 2].double(), mean, sd, mask)[0])
        again = trainer.log_probs(traj, steps, p, (cond, uncond), inputs)
    return torch.stack(out), again


def _rollout(eng, name, image=None, **over):
    rollout = RolloutParams(sde_type=name, noise_level=VARIANTS[name], return_trajectory=True,
                            schedule=over.pop("schedule", "rollout"))
    p = eng.params(seed=over.pop("seed", 3), output_type="latent", rollout=rollout, **over)
    task = eng.run(p, image=image)
    ex = task.extras()
    traj = Trajectory(ex[TRAJECTORY_LATENTS.name][0], ex[TRAJECTORY_TIMESTEPS.name], ex[TRAJECTORY_SIGMAS.name])
    return p, task, traj, ex[LOG_PROB_STEPS.name].tolist(), ex[LOG_PROBS.name][0]


@pytest.mark.parametrize("model", MODELS)
def test_every_family_rolls_out_each_trainer_step(model, record_property):
    model_dir = ensure_builtin(model)
    eng, trainer = _MODELS.engine(model_dir), _MODELS.trainer(model_dir)
    image = IMAGE if eng.family.condition.image_input(eng.info) == "required" else None  # (optional ones: own tests)
    for name in VARIANTS:
        p, task, traj, steps, log_probs = _rollout(eng, name, image)
        assert steps == list(range(p.num_inference_steps)) and task.schedule == "rollout"
        mine, again = _recompute(trainer, p, traj, steps, image)
        d, d_trainer = (mine - log_probs.double()).abs().max().item(), (again - log_probs).abs().max().item()
        record_property(f"{name}_max_diff", d)
        print(f"\n[{model} {name}] log-probs vs float64 {d:.3g}, vs TrainerPolicy {d_trainer:.3g}")
        assert d <= TOL and d_trainer <= TOL


# --- 3. Flow-GRPO's Wan step on Wan's serving schedule ------------------------------------------------------

def test_flow_grpo_wan_on_the_serving_unipc_schedule(record_property):
    model_dir = ensure_builtin("tiny")
    eng, trainer = _MODELS.engine(model_dir), _MODELS.trainer(model_dir)
    p, task, traj, steps, log_probs = _rollout(eng, "flow_grpo_wan", schedule="serving", num_inference_steps=6,
                                               seed=9)
    assert isinstance(task.scheduler, UniPCMultistepScheduler) and task.schedule == "serving"
    unipc = UniPCMultistepScheduler.from_pretrained(model_dir / "scheduler")
    unipc.set_timesteps(6)
    assert torch.equal(traj.sigmas, unipc.sigmas.float()) and torch.equal(traj.timesteps, unipc.timesteps.float())
    assert torch.equal(traj.timesteps, traj.timesteps.round())  # integers ...
    assert (traj.timesteps.double() - traj.sigmas[:-1].double() * 1000).abs().max() > 0.1  # ... not sigmas * 1000
    mine, again = _recompute(trainer, p, traj, steps, None)
    d = (mine - log_probs.double()).abs().max().item()
    record_property("max_diff", d)
    assert d <= TOL and (again - log_probs).abs().max().item() <= TOL
    # The model was conditioned on the integer timesteps: sigmas * 1000 gives other velocities.
    cond, uncond = trainer.embeddings(p)
    with torch.no_grad():
        x = traj.latents[1:2]
        at_t = trainer.velocity(x, traj.timesteps[1], cond, uncond, p)
        at_sigma = trainer.velocity(x, traj.sigmas[1] * 1000, cond, uncond, p)
    assert (at_t - at_sigma).abs().max() > 1e-4


def test_dance_grpo_on_sanas_serving_dpm_solver_schedule():
    """Another serving scheduler with flow sigmas: SANA's DPM-Solver, its sigmas and timesteps, recomputed."""
    model_dir = ensure_builtin("tiny-sana")
    eng, trainer = _MODELS.engine(model_dir), _MODELS.trainer(model_dir)
    p, task, traj, steps, log_probs = _rollout(eng, "dance_grpo", schedule="serving")
    dpm = DPMSolverMultistepScheduler.from_pretrained(model_dir / "scheduler")
    dpm.set_timesteps(p.num_inference_steps)
    assert isinstance(task.scheduler, DPMSolverMultistepScheduler) and task.schedule == "serving"
    assert torch.equal(traj.sigmas, dpm.sigmas.float()) and torch.equal(traj.timesteps, dpm.timesteps.float())
    mine, again = _recompute(trainer, p, traj, steps, None)
    assert (mine - log_probs.double()).abs().max().item() <= TOL and (again - log_probs).abs().max().item() <= TOL


# --- 4. the rules and the answer ----------------------------------------------------------------------------

def test_unknown_schedule_or_sde_type_and_a_serving_scheduler_without_flow_sigmas_are_refused():
    info = read_model(ensure_builtin("tiny"))
    base = {"prompt": "a fox", "sde_type": "flow_grpo_wan"}
    for field, value in (("schedule", "fastest"), ("sde_type", "euler_a")):
        with pytest.raises(FieldError) as e:
            to_params({**base, field: value}, info, Limits())
        assert e.value.field == field
    not_flow = dataclasses.replace(info, scheduler_config={**info.scheduler_config, "use_flow_sigmas": False})
    with pytest.raises(FieldError) as e:
        to_params({**base, "schedule": "serving"}, not_flow, Limits())
    assert e.value.field == "schedule" and "flow" in e.value.message
    assert to_params({**base, "schedule": "rollout"}, not_flow, Limits()).rollout.schedule == "rollout"
    assert to_params({**base, "schedule": "serving"}, info, Limits()).rollout.schedule == "serving"
    with pytest.raises(msgspec.ValidationError, match="schedule"):  # the wire decodes strictly
        msgspec.convert({"schedule": "fastest"}, RolloutParams)
    for field, rising in (("sigmas", [0.5, 0.9, 0.2]), ("timesteps", [0.06, 911.0, 400.0])):  # no SDE step up
        with pytest.raises(FieldError) as e:
            to_params({"prompt": "a fox", "rollout": True, field: rising}, info, Limits())
        assert e.value.field == field
        assert to_params({"prompt": "a fox", "rollout": False, field: rising}, info, Limits()).rollout is not None


def test_a_schedule_a_step_cannot_take_fails_the_request_before_its_first_step():
    eng = _MODELS.engine(ensure_builtin("tiny"))
    with pytest.raises(RequestError, match="sigma == 1"):  # sde's std divides by 1 - sigmas[1]
        eng.task(eng.params(sigmas=[1.0, 1.0, 0.5], rollout=RolloutParams(sde_type="sde")))
    eng.task(eng.params(sigmas=[1.0, 1.0, 0.5], rollout=RolloutParams(sde_type="cps", noise_level=0.5)))


def test_the_serving_schedule_of_an_euler_family_is_checked_and_is_the_rollout_one():
    eng = _MODELS.engine(ensure_builtin("tiny-sd3"))
    _, serving, traj_s, _, lp_s = _rollout(eng, "dance_grpo", schedule="serving")
    _, rollout, traj_r, _, lp_r = _rollout(eng, "dance_grpo")
    assert isinstance(serving.scheduler, FlowMatchEulerDiscreteScheduler) and serving.schedule == "serving"
    assert schedulers.check_rollout_schedule(serving.scheduler) <= 1e-3  # the flow-match convention
    assert torch.equal(traj_s.latents, traj_r.latents) and torch.equal(lp_s, lp_r)


def test_the_answer_says_which_schedule_ran(tmp_path):
    eng = _MODELS.engine(ensure_builtin("tiny"))
    stage = InStage(eng, tmp_path)
    rollout = {s: RolloutParams(sde_type="flow_grpo_wan", schedule=s) for s in ("rollout", "serving")}
    requests = {s: (eng.params(seed=1, output_type="latent", rollout=r), None) for s, r in rollout.items()}
    requests["plain"] = (eng.params(seed=1, output_type="latent"), None)
    out = stage.serve(requests)
    said = {rid: (f.msg.info["schedule"], f.msg.info["scheduler"]) for rid, f in out.items()}
    assert said == {"rollout": ("rollout", "FlowMatchEulerDiscreteScheduler"),
                    "serving": ("serving", "UniPCMultistepScheduler"),
                    "plain": ("serving", "UniPCMultistepScheduler")}
