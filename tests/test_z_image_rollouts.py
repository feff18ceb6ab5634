"""Z-Image rollouts: every step variant's log-probs equal the trainer's recompute (with and without guidance,
its guidance settings on, an SDE window); requests batched with others at other steps equal their runs alone."""

from __future__ import annotations

import pytest
import torch

from common.builtin import ensure_builtin
from common.protocol.messages import (LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS,
                                      TRAJECTORY_TIMESTEPS, RolloutParams)
from family_harness import ModuleModels, compare_tasks, max_diff
from rl import Trajectory

TOL = 1e-5
STEPS = 4
MODEL = "tiny-z-image"
models = ModuleModels()
# cfg_truncation 0.2: guidance off at the last two of the four steps ((1000 - t) / 1000 = 0, 0.1, 0.25, 0.5)
GUIDED = dict(guidance_scale=4.0, cfg_normalization=1.0, cfg_truncation=0.2, negative_prompt="blurry, dark")


@pytest.fixture(scope="module", autouse=True)
def _module():
    yield from models.module_scope()


def rollout(eng, sde_type: str, guided: bool, n: int = 2, seed: int = 3, **rollout_fields):
    over = GUIDED if guided else dict(guidance_scale=0.0)
    noise_level = 0.8 if sde_type == "cps" else 0.7
    return eng.params(num_inference_steps=STEPS, n=n, seed=seed, prompt="a lighthouse at dusk",
                      rollout=RolloutParams(sde_type=sde_type, noise_level=noise_level, return_trajectory=True,
                                            **rollout_fields), **over)


# (step variant, guided, the SDE's steps: None every one)
CASES = {"sde-guided": ("sde", True, None), "cps-turbo": ("cps", False, None),
         "flow_grpo_wan-guided": ("flow_grpo_wan", True, None), "dance_grpo-window": ("dance_grpo", True, [1, 2]),
         "sde-window-turbo": ("sde", False, [0, 2])}


@pytest.mark.parametrize("case", list(CASES))
def test_the_trainer_recomputes_the_log_probs(case, record_property):
    sde_type, guided, window = CASES[case]
    model_dir = ensure_builtin(MODEL)
    eng, trainer = models.engine(model_dir), models.trainer(model_dir)
    torch.set_num_threads(1)
    p = rollout(eng, sde_type, guided, **({} if window is None else {"sde_step_indices": window}))
    ex = eng.run(p).extras()
    steps = ex[LOG_PROB_STEPS.name]
    # (within the window; cps takes no log-prob at the last step, whose next sigma is 0)
    assert len(steps) and set(steps.tolist()) <= set(window or range(STEPS))
    embeddings = trainer.embeddings(p)
    assert (embeddings[1] is None) == (not guided)
    diffs = {}
    for i in range(p.n):
        sample = Trajectory(ex[TRAJECTORY_LATENTS.name][i], ex[TRAJECTORY_TIMESTEPS.name], ex[TRAJECTORY_SIGMAS.name])
        with torch.no_grad():
            got = trainer.log_probs(sample, steps, p, embeddings=embeddings)
        diffs[i] = max_diff(got, ex[LOG_PROBS.name][i])
    record_property("diffs", diffs)
    assert torch.isfinite(ex[LOG_PROBS.name]).all()
    assert all(d <= TOL for d in diffs.values()), diffs


def test_requests_batched_at_other_steps_equal_their_runs_alone():
    """A guided rollout, a Turbo generation and a guided generation with other settings and another prompt
    length, started one step apart, in shared forwards: each equals its run alone."""
    eng = models.engine(ensure_builtin(MODEL))
    made = [rollout(eng, "sde", True, seed=11),
            eng.params(num_inference_steps=STEPS, seed=12, guidance_scale=0.0, prompt="a boat"),
            eng.params(num_inference_steps=STEPS, seed=13, guidance_scale=2.5, cfg_truncation=0.3,
                       prompt="a small red boat on a calm green lake under a pale sky", negative_prompt="noise")]
    alone = [eng.run(p) for p in made]
    tasks = [eng.task(made[0])]
    eng.step(tasks)
    tasks.append(eng.task(made[1]))
    eng.step(tasks)
    tasks.append(eng.task(made[2]))
    before = eng.shared_forwards
    while not all(t.done for t in tasks):
        eng.step([t for t in tasks if not t.done])
    assert eng.shared_forwards > before
    scale = max(a.latents.abs().max().item() for a in alone)
    diffs = [compare_tasks(a, b) for a, b in zip(alone, tasks)]
    assert all(d <= TOL * max(1.0, scale) for d in diffs), (diffs, scale)
